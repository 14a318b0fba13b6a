#!/usr/bin/python
# Copyright: budgetgpu maintainers
# Apache License 2.0 (see galaxy.yml)
# ruff: noqa: E402 (Ansible modules import after DOCUMENTATION, EXAMPLES and RETURN)
"""Ansible module: install a set of small files (scripts, helpers) in one task."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: install_files
short_description: Install a set of small files in one task
version_added: "0.1.0"
description:
  - Puts each file at its destination with its mode and owner, creating missing parent directories,
    and changes nothing where the content and attributes already match.
  - One remote call for the whole set, where a loop of M(ansible.builtin.copy) makes two per file
    (a stat, then the attributes). The nightly run checks every helper script on every node.
  - Each file is written to a temporary file beside it and renamed into place, so a reader never sees
    half a file.
  - C(src) is read on the control node (the role's C(files/) directory, or a path) by the action plugin
    of the same name; use C(content) for text made in the task (a template lookup).
  - For small text and script files (sent through the module's arguments); wheels and other large files
    belong to M(ansible.builtin.copy).
author:
  - budgetgpu maintainers (!UNKNOWN)
options:
  files:
    description: The files to install.
    type: list
    elements: dict
    required: true
    suboptions:
      dest:
        description: Absolute path on the node.
        type: path
        required: true
      src:
        description: File on the control node (a role's C(files/) or a path); exclusive with C(content).
        type: str
      content:
        description: The file's text; exclusive with C(src).
        type: str
      content_b64:
        description: Set by the action plugin from C(src); not for playbooks.
        type: str
      mode:
        description: Octal mode as a string.
        type: str
        default: "0644"
      interpreter:
        description:
          - A script's interpreter and its options (C(/opt/budgetgpu/node/bin/python3 -I)); its first line, a
            C(#!) line, becomes C(#!<interpreter>), as pip writes the first line of a venv's scripts.
          - A file without a C(#!) line is refused.
        type: str
  owner:
    description: Owner of the files and of the directories created.
    type: str
    default: root
  group:
    description: Group of the files and of the directories created.
    type: str
    default: root
  directory_mode:
    description: Mode of the parent directories this task creates (existing ones are left as they are).
    type: str
    default: "0755"
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
  diff_mode:
    support: full
  platform:
    platforms: posix
seealso:
  - module: ansible.builtin.copy
"""

EXAMPLES = r"""
- name: Install the probe command and the code it runs
  budgetgpu.cluster.install_files:
    files:
      - {src: gpu-probe, dest: /opt/budgetgpu/gpu-probe/scripts/gpu-probe, mode: "0755"}
      - {src: pcie.py, dest: /opt/budgetgpu/gpu-probe/plugins/module_utils/pcie.py}
      - {content: "{{ lookup('ansible.builtin.template', 'job.env.j2') }}", dest: /etc/budgetgpu/job.env}
"""

RETURN = r"""
changed_files:
  description: Destinations whose content or attributes changed (or would, in check mode).
  returned: always
  type: list
  elements: str
  sample: [/opt/budgetgpu/gpu-probe/scripts/gpu-probe]
created_directories:
  description: Parent directories that were missing and were created (or would be).
  returned: always
  type: list
  elements: str
"""

import base64
import hashlib
import os
import tempfile

from ansible.module_utils.basic import AnsibleModule

DIFF_LIMIT = 64 * 1024


def wanted_bytes(spec: dict) -> bytes:
    if spec.get("content_b64") is not None:
        data = base64.b64decode(spec["content_b64"])
    else:
        data = spec["content"].encode("utf-8")
    if spec.get("interpreter") is None:
        return data
    if not data.startswith(b"#!"):
        raise ValueError(f"{spec['dest']}: interpreter {spec['interpreter']} given, but the file has no #! line")
    return b"#!" + spec["interpreter"].encode("utf-8") + b"\n" + data.partition(b"\n")[2]


def current_bytes(path: str) -> bytes | None:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except FileNotFoundError:
        return None


def text_for_diff(data: bytes | None) -> str:
    if data is None:
        return ""
    if len(data) > DIFF_LIMIT:
        return f"({len(data)} bytes, not shown)\n"
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return f"(binary, sha256 {hashlib.sha256(data).hexdigest()})\n"


def attributes(module: AnsibleModule, path: str, mode: str) -> dict:
    """The file arguments AnsibleModule.set_fs_attributes_if_different reads (SELinux left as is)."""
    return {"path": path, "mode": mode, "owner": module.params["owner"], "group": module.params["group"],
            "secontext": None, "attributes": None}  # fmt: skip


def create_parents(module: AnsibleModule, directory: str, created: list[str]) -> None:
    missing = []
    while directory and not os.path.isdir(directory):
        missing.append(directory)
        directory = os.path.dirname(directory)
    for path in reversed(missing):
        if path in created:
            continue
        created.append(path)
        if module.check_mode:
            continue
        os.mkdir(path)
        module.set_fs_attributes_if_different(attributes(module, path, module.params["directory_mode"]), False)


def install(module: AnsibleModule, spec: dict, created: list[str]) -> tuple[bool, dict | None]:
    dest = spec["dest"]
    data = wanted_bytes(spec)
    before = current_bytes(dest)
    content_changed = before != data
    parent = os.path.dirname(dest)
    if content_changed:
        create_parents(module, parent, created)
        if not module.check_mode:
            fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{os.path.basename(dest)}.")
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            module.atomic_move(tmp, dest)
    # In check mode a file that does not exist yet has no attributes to compare.
    attributes_changed = False
    if os.path.exists(dest):
        attributes_changed = module.set_fs_attributes_if_different(attributes(module, dest, spec["mode"]), False)
    diff = None
    if content_changed:
        diff = {
            "before_header": dest if before is not None else "(absent)",
            "after_header": dest,
            "before": text_for_diff(before),
            "after": text_for_diff(data),
        }
    return content_changed or attributes_changed, diff


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "files": {
                "type": "list",
                "elements": "dict",
                "required": True,
                "options": {
                    "dest": {"type": "path", "required": True},
                    "src": {"type": "str"},
                    "content": {"type": "str"},
                    "content_b64": {"type": "str"},
                    "mode": {"type": "str", "default": "0644"},
                    "interpreter": {"type": "str"},
                },
            },
            "owner": {"type": "str", "default": "root"},
            "group": {"type": "str", "default": "root"},
            "directory_mode": {"type": "str", "default": "0755"},
        },
        supports_check_mode=True,
    )
    problems = []
    for spec in module.params["files"]:
        if not os.path.isabs(spec["dest"]):
            problems.append(f"dest {spec['dest']!r} is not an absolute path")
        if (spec.get("content") is None) == (spec.get("content_b64") is None):
            problems.append(f"{spec['dest']}: give exactly one of src and content")
        elif spec.get("interpreter") is not None:
            try:
                wanted_bytes(spec)
            except ValueError as err:
                problems.append(str(err))
    if problems:
        module.fail_json(msg="install_files: " + "; ".join(problems))

    changed_files, diffs, created = [], [], []
    for spec in module.params["files"]:
        try:
            changed, diff = install(module, spec, created)
        except OSError as err:
            module.fail_json(msg=f"install_files: {spec['dest']}: {err}", changed_files=changed_files)
        if changed:
            changed_files.append(spec["dest"])
        if diff:
            diffs.append(diff)
    result = {"changed": bool(changed_files or created), "changed_files": changed_files,
              "created_directories": created}  # fmt: skip
    if module._diff and diffs:
        result["diff"] = diffs
    module.exit_json(**result)


if __name__ == "__main__":
    main()
