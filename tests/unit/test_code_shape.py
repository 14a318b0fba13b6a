"""The shape the project's Python keeps: functions of at most 60 lines (the linter holds the
complexity limit: ruff C901 in pyproject.toml), and every filter documented for ansible-doc."""

from __future__ import annotations

import ast
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_FUNCTION_LINES = 60
# Where the project's Python lives: the controller's plugins, the files the roles and playbooks
# install on the nodes, and the scripts of the checkout.
PYTHON_DIRS = ("plugins", "roles", "playbooks", "scripts")


def _is_python_script(path: Path) -> bool:
    """An executable without a .py suffix whose shebang names Python (scripts/gpu-health, the units' helpers)."""
    if path.suffix or not path.is_file():
        return False
    with path.open("rb") as f:
        first = f.readline(200)
    return first.startswith(b"#!") and b"python" in first


def _python_scripts() -> list[Path]:
    return sorted(p for d in PYTHON_DIRS for p in (ROOT / d).rglob("*") if _is_python_script(p))


def _python_files() -> list[Path]:
    return [p for d in PYTHON_DIRS for p in (ROOT / d).rglob("*.py")] + _python_scripts()


def test_ruff_reads_every_python_script() -> None:
    # ruff only reads suffix-less files that pyproject.toml's extend-include names: a script left out
    # of that list is never linted nor formatted.
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["extend-include"])
    found = {str(p.relative_to(ROOT)) for p in _python_scripts()}
    assert found - listed == set(), f"add to [tool.ruff] extend-include: {sorted(found - listed)}"
    assert listed - found == set(), f"no such Python script, remove from extend-include: {sorted(listed - found)}"


def test_no_function_is_longer_than_60_lines() -> None:
    long = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "split these functions:\n" + "\n".join(long)


def _filter_names() -> list[str]:
    package = importlib.import_module("ansible_collections.budgetgpu.cluster.plugins.filter")
    names = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        names += list(module.FilterModule().filters())
    return sorted(names)


def test_every_filter_has_a_doc_file() -> None:
    missing = [n for n in _filter_names() if not (ROOT / "plugins" / "filter" / f"{n}.yml").exists()]
    assert not missing, f"plugins/filter/<name>.yml missing for: {', '.join(missing)}"


def test_every_filter_is_used() -> None:
    # A filter nothing calls is code to keep in step for nobody: the roles, playbooks and other plugins
    # must name it (the filter's own module and doc file do not count, nor the tests).
    users = [p for d in ("roles", "playbooks", "plugins") for p in (ROOT / d).rglob("*") if p.is_file()]
    users = [p for p in users if "filter" not in p.relative_to(ROOT).parts[:2] and p.suffix != ".pyc"]
    text = "\n".join(p.read_text(errors="replace") for p in users) + (ROOT / "site.yml").read_text()
    unused = [n for n in _filter_names() if not re.search(rf"\b{n}\b", text)]
    assert not unused, f"filters nothing uses (remove them, or use them): {', '.join(unused)}"


@pytest.mark.skipif(not (Path(sys.executable).parent / "ansible-doc").exists(), reason="ansible-doc not beside python")
def test_ansible_doc_shows_every_filter() -> None:
    names = [f"budgetgpu.cluster.{n}" for n in _filter_names()]
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"))
    out = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-doc"), "-t", "filter", "--json", *names],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env=env,
    )
    docs = json.loads(out.stdout)
    undocumented = [n for n in names if not (docs.get(n) or {}).get("doc", {}).get("short_description")]
    assert not undocumented, f"ansible-doc has no short_description for: {', '.join(undocumented)}"
    # A description line like "- Pure: C(x)" is a mapping to YAML: --json shows it, the text page
    # (and ansible-test sanity's ansible-doc test) fails on it.
    not_text = [n for n in names if not all(isinstance(line, str) for line in docs[n]["doc"].get("description", []))]
    assert not not_text, f"description lines that are not strings (quote them) in: {', '.join(not_text)}"


def _tasks(node: object) -> list[dict]:
    """Every task mapping in a task file's YAML, blocks' own tasks included."""
    if isinstance(node, list):
        return [task for item in node for task in _tasks(item)]
    if not isinstance(node, dict):
        return []
    inner = [task for key in ("block", "rescue", "always") for task in _tasks(node.get(key, []))]
    return [node, *inner]


def test_a_task_delegated_to_the_control_node_does_not_become_root_there() -> None:
    """The plays run with become: a task delegated to localhost would run sudo on the control node
    (a password prompt, or root on the user's laptop) unless it says become: false."""
    import yaml

    missing = [
        f"{path.relative_to(ROOT)}: {task.get('name')}"
        for path in sorted((ROOT / "roles").glob("*/tasks/*.yml"))
        for task in _tasks(yaml.safe_load(path.read_text()))
        if task.get("delegate_to") in ("localhost", "127.0.0.1") and task.get("become") is not False
    ]
    assert not missing, missing


# The node model (plugins/plugin_utils/nodes.py) is the one reader of a host out of hostvars. Modules
# return facts and the callback reads task results as they come: neither reads hostvars.
NODE_MODEL = "plugins/plugin_utils/nodes.py"
HOST_READERS_EXEMPT = ("plugins/modules/", "plugins/callback/")
HOST_KEYS = ("ansible_facts", "ansible_host", "ansible_local", "group_names")


def _is_hostvars(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "hostvars"


def _host_reads(tree: ast.AST) -> list[int]:
    """Lines that read a host out of hostvars (hostvars[...], hostvars.get(...), .raw_get(...)) or read a
    host's facts, address or groups by their keys ("ansible_facts", ...: docstrings and comments aside)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # a docstring
        subscript = isinstance(node, ast.Subscript) and _is_hostvars(node.value)
        method = isinstance(node, ast.Attribute) and (
            node.attr == "raw_get" or node.attr == "get" and _is_hostvars(node.value)
        )
        if subscript or method:
            lines.append(node.lineno)
        lines += [c.lineno for c in ast.iter_child_nodes(node) if isinstance(c, ast.Constant) and c.value in HOST_KEYS]
    return lines


def _host_readers(sources: dict[str, str]) -> list[str]:
    return [
        f"{path}:{line}"
        for path, text in sources.items()
        if path != NODE_MODEL and not path.startswith(HOST_READERS_EXEMPT)
        for line in sorted(set(_host_reads(ast.parse(text, path))))
    ]


def test_only_the_node_model_reads_a_host_out_of_hostvars() -> None:
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "plugins").rglob("*.py"))}
    found = _host_readers(sources)
    assert not found, "read the host through plugins/plugin_utils/nodes.py instead:\n" + "\n".join(found)


def test_the_host_reads_check_finds_the_old_readers() -> None:
    old = {
        "plugins/plugin_utils/x.py": 'def f(hostvars, host):\n    """ansible_facts"""\n    return hostvars[host]\n',
        "plugins/plugin_utils/y.py": "def f(hostvars, h):\n    return (hostvars.get(h) or {}).get('ansible_host')\n",
        "plugins/action/z.py": "def f(task_vars, h):\n    return task_vars['hostvars'].raw_get(h)\n",
        NODE_MODEL: "def f(hostvars, h):\n    return hostvars[h]['ansible_facts']\n",
        "plugins/modules/m.py": "def f(m):\n    m.exit_json(ansible_facts={'ansible_local': 1})\n",
    }
    assert _host_readers(old) == [
        "plugins/plugin_utils/x.py:3",
        "plugins/plugin_utils/y.py:2",
        "plugins/action/z.py:2",
    ]


# Where a role reads ansible_host without deciding an address: the control node check compares names.
ANSIBLE_HOST_READERS = {"roles/nvidia_driver/tasks/run.yml": "whether the host is the control node, by its names"}


def test_no_role_decides_an_address_itself() -> None:
    """A host's address (its cluster address, else ansible_host, else its name) is nodes.node_address's:
    the roles read it from a filter (cluster_nodes' address, the plans' addresses), not from a Jinja chain."""
    found = [
        str(path.relative_to(ROOT))
        for d in ("roles", "playbooks")
        for path in sorted((ROOT / d).rglob("*"))
        if path.suffix in (".yml", ".yaml", ".j2")
        and "meta" not in path.relative_to(ROOT).parts
        and "ansible_host" in path.read_text()
        and str(path.relative_to(ROOT)) not in ANSIBLE_HOST_READERS
    ]
    assert not found, found
