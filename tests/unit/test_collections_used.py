"""site.yml needs no collection beyond ansible-core's and this one.

ansible.cfg does not scan site-packages for collections (collections_scan_sys_path = false:
mitogen lists every installed collection again for each task of a collection's module). A
role or playbook that names, say, community.general.dict would then fail on a user's control
node and in `make demo`; this test fails first.
"""

from __future__ import annotations

import configparser
import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# What site.yml runs: the playbooks and every role they reach (gpu_sim included).
SOURCES = [REPO / "site.yml", *sorted((REPO / "playbooks").glob("*.yml")), *sorted((REPO / "roles").rglob("*.yml"))]
SOURCES += sorted((REPO / "roles").rglob("*.j2"))
ALLOWED = {"ansible.builtin", "ansible.legacy", "budgetgpu.cluster"}
FQCN = re.compile(r"(?<![\w.])([a-z][a-z0-9_]*)\.([a-z][a-z0-9_]*)\.[a-z][a-z0-9_]*")


def installed_namespaces() -> set[str]:
    """Collection namespaces the venv's PyPI `ansible` package installs (amazon, ansible, community...)."""
    spec = importlib.util.find_spec("ansible_collections")
    assert spec is not None and spec.submodule_search_locations, "no ansible_collections package in this venv"
    return {
        entry.name
        for location in spec.submodule_search_locations
        for entry in Path(location).iterdir()
        if entry.is_dir() and not entry.name.startswith("_")
    }


def test_ansible_cfg_does_not_scan_site_packages():
    config = configparser.ConfigParser()
    config.read(REPO / "ansible.cfg")
    assert config.getboolean("defaults", "collections_scan_sys_path") is False


def test_site_yml_names_only_builtin_and_budgetgpu_collections():
    namespaces = installed_namespaces() - {"budgetgpu"}
    found = []
    for path in SOURCES:
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if line.lstrip().startswith("#"):
                continue
            for namespace, name in FQCN.findall(line):
                collection = f"{namespace}.{name}"
                if namespace in namespaces and collection not in ALLOWED:
                    found.append(f"{path.relative_to(REPO)}:{number}: {collection}")
    assert not found, "collections that site.yml cannot find without a site-packages scan:\n" + "\n".join(found)


def test_the_check_finds_a_collection_name():
    # The pattern itself, on the line that this test replaced.
    line = "| map('zip', ['src', 'dst']) | map('map', 'reverse') | map('community.general.dict') | list }}"
    assert ("community", "general") in FQCN.findall(line)
