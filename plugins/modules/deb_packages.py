#!/usr/bin/python
# Copyright: budgetgpu maintainers
# Apache License 2.0 (see galaxy.yml)
# ruff: noqa: E402 (Ansible modules import after DOCUMENTATION, EXAMPLES and RETURN)
"""Ansible module: which Debian packages are not installed as asked, and which are held."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: deb_packages
short_description: Which Debian packages are not installed as asked, and which are held
version_added: "0.1.0"
description:
  - Answers, with one C(dpkg-query) call, which of the given packages are not installed at the
    version asked for, and which are held. It only reads; it never changes anything.
  - It exists so that a role can skip the package manager when nothing is missing. On a no-change
    run every package is already there, yet each M(ansible.builtin.apt) task opens the apt cache
    (about 0.4 s of CPU a node); C(dpkg-query) answers in a few milliseconds.
  - A package counts as installed when dpkg's status is C(installed) (C(ii), or C(hi) when held).
    Removed packages that kept their configuration files (C(rc)) and half-installed or
    half-configured ones are missing, so apt gets to finish them.
  - Needs C(dpkg-query), that is a Debian or Ubuntu node.
author:
  - budgetgpu maintainers (!UNKNOWN)
options:
  names:
    description:
      - Packages as M(ansible.builtin.apt) takes them in its C(name) option.
      - C(name), C(name=version), or C(name=version-glob) where the version contains C(*)
        (C(docker-ce=5:27.3*)); a version glob is matched against the installed version.
      - A name may carry an architecture (C(libfoo:amd64)). Globs in the name are not supported.
    type: list
    elements: str
    required: true
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
  diff_mode:
    support: none
  platform:
    platforms: debian
seealso:
  - module: ansible.builtin.apt
  - module: ansible.builtin.package_facts
"""

EXAMPLES = r"""
- name: Find which NCCL packages are not installed at the pinned version
  budgetgpu.cluster.deb_packages:
    names: [libnccl2=2.21.5-1+cuda12.4, libnccl-dev=2.21.5-1+cuda12.4]
  register: _nccl

- name: Install NCCL (only when something is missing)
  ansible.builtin.apt:
    name: "{{ _nccl.missing }}"
    allow_change_held_packages: true
  when: _nccl.missing | length > 0

- name: Hold NCCL (only the packages not held yet)
  ansible.builtin.dpkg_selections:
    name: "{{ item }}"
    selection: hold
  loop: "{{ ['libnccl2', 'libnccl-dev'] | difference(_nccl.held) }}"

- name: Find which engine packages are not at the pinned Docker release
  budgetgpu.cluster.deb_packages:
    names: [docker-ce=5:27.3*, docker-ce-cli=5:27.3*, containerd.io]
"""

RETURN = r"""
installed:
  description: The asked names that are installed, with the installed version (whether or not it is the one asked for).
  returned: always
  type: dict
  sample: {containerd.io: 1.7.22-1, docker-ce: "5:27.3.1-1~debian.12~bookworm"}
missing:
  description: >-
    The specs, as given and in the given order without repeats, that are not satisfied: the package
    is not installed, or its installed version does not equal (or match the glob of) the one asked for.
  returned: always
  type: list
  elements: str
  sample: [docker-ce-cli=5:27.3*]
held:
  description: The asked names whose dpkg selection is C(hold), installed or not; sorted.
  returned: always
  type: list
  elements: str
  sample: [docker-ce]
"""

import fnmatch
import re

from ansible.module_utils.basic import AnsibleModule

# The Architecture column tells apart libfoo:amd64 and libfoo:i386, which ${Package} prints alike.
FORMAT = "${Package}\t${Architecture}\t${Version}\t${db:Status-Abbrev}\n"
C_LOCALE = {"LANG": "C", "LC_ALL": "C", "LC_MESSAGES": "C"}
# Debian package names, with an optional :arch. No glob characters: a glob would make dpkg-query
# print other names than the one asked, and the answer would be wrong rather than refused.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9+._-]*(:[A-Za-z0-9-]+)?")


def parse_spec(spec: str) -> tuple[str, str | None]:
    """'name', 'name=version' or 'name=version*' -> (name, version or None); ValueError says why."""
    name, equals, version = spec.partition("=")
    if not name:
        raise ValueError(f"{spec!r} has no package name")
    if not NAME.fullmatch(name):
        raise ValueError(f"{spec!r}: {name!r} is not a package name (globs in the name are not supported)")
    if equals and (not version or "=" in version):
        raise ValueError(f"{spec!r} is not name, name=version or name=version-glob")
    return name, version if equals else None


def parse_dpkg_query(text: str) -> dict[str, tuple[str, str]]:
    """dpkg-query -W -f FORMAT output -> {name: (version, status abbrev)}, each package under its bare
    name and under name:arch. Where several architectures share a bare name, an installed one wins."""
    packages: dict[str, tuple[str, str]] = {}
    for line in text.splitlines():
        fields = line.split("\t")
        if len(fields) != 4 or not fields[0]:
            continue
        name, arch, version, status = fields
        if arch:
            packages[f"{name}:{arch}"] = (version, status)
        if name not in packages or not is_installed(packages[name][1]):
            packages[name] = (version, status)
    return packages


def is_installed(status: str) -> bool:
    return status[1:2] == "i"


def is_held(status: str) -> bool:
    return status[:1] == "h"


def satisfied(version: str, wanted: str | None) -> bool:
    if wanted is None:
        return True
    # apt takes name=5:27.3* as "the newest 5:27.3 version"; installed is fine when it matches.
    return version == wanted or ("*" in wanted and fnmatch.fnmatchcase(version, wanted))


def unsatisfied(specs: list[str], packages: dict[str, tuple[str, str]]) -> dict:
    """The module's result for specs (already checked by parse_spec) against parse_dpkg_query's dict."""
    installed, missing, held = {}, [], set()
    for spec in dict.fromkeys(specs):
        name, wanted = parse_spec(spec)
        version, status = packages.get(name, ("", "un "))
        if is_held(status):
            held.add(name)
        if is_installed(status):
            installed[name] = version
        if not (is_installed(status) and satisfied(version, wanted)):
            missing.append(spec)
    return {"installed": installed, "missing": missing, "held": sorted(held)}


def build_module() -> AnsibleModule:
    return AnsibleModule(
        argument_spec={"names": {"type": "list", "elements": "str", "required": True}},
        supports_check_mode=True,
    )


def main() -> None:
    module = build_module()
    specs = module.params["names"]
    problems, names = [], []
    for spec in specs:
        try:
            names.append(parse_spec(spec)[0])
        except ValueError as err:
            problems.append(str(err))
    if problems:
        module.fail_json(msg="deb_packages: " + "; ".join(problems))
    dpkg_query = module.get_bin_path("dpkg-query")
    if dpkg_query is None:
        module.fail_json(msg="deb_packages: dpkg-query not found: this module needs a Debian or Ubuntu node")
    if not names:
        # dpkg-query -W with no names would list every package.
        module.exit_json(changed=False, installed={}, missing=[], held=[])
    # rc 1 only means some names are unknown to dpkg ("no packages found matching X"); the rest are printed.
    rc, out, err = module.run_command([dpkg_query, "-W", "-f", FORMAT, "--", *dict.fromkeys(names)],
                                      environ_update=C_LOCALE)  # fmt: skip
    if rc not in (0, 1):
        module.fail_json(msg=f"deb_packages: dpkg-query failed (rc {rc}): {err.strip()}; this module needs a "
                         "Debian or Ubuntu node", rc=rc, stderr=err)  # fmt: skip
    module.exit_json(changed=False, **unsatisfied(specs, parse_dpkg_query(out)))


if __name__ == "__main__":
    main()
