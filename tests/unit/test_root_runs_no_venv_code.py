"""No task runs a venv's interpreter (or a venv's program) as root.

The plays run with become: true. The training user can write what it runs (its job's pip, a
compromised training script) and, in an earlier release, could write the venv: a .pth file there
runs in every interpreter the venv starts, as whoever starts it. So a command task whose
program lies in a venv runs as another user (become_user) or drops root itself (setpriv); root
reads a venv with the system python (role _trusted_venv's files/venv_state.py). ansible.builtin.pip is
the one exception: role _trusted_venv runs it as root only in a venv that nobody but root can have written.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
COMMANDS = {"ansible.builtin.command", "ansible.builtin.shell", "ansible.builtin.script", "ansible.builtin.raw"}
# A program path in a venv: python_env_path ~ '/bin/python', {{ nccl_network_venv }}/bin/torchrun,
# cuda_torch_python, /opt/budgetgpu/venv/bin/...
VENV_PROGRAM = re.compile(r"(venv|python_env_path)\W*(~\s*)?['\"]?/bin/|torch_python|_venv\b[^\n]*/bin/")


def tasks(node):
    if isinstance(node, list):
        for item in node:
            yield from tasks(item)
    elif isinstance(node, dict):
        if COMMANDS & node.keys():
            yield node
        for key in ("block", "rescue", "always"):
            yield from tasks(node.get(key, []))


def program(task: dict) -> str:
    """The part of a command task that names the program it starts."""
    args = next(task[key] for key in COMMANDS if key in task)
    if isinstance(args, dict):
        if "argv" in args:
            argv = args["argv"]
            return str(argv[0]) if isinstance(argv, list) else str(argv).split(",", maxsplit=1)[0]
        args = args.get("cmd", "")
    return str(args)


def root_runs_venv_code() -> list[str]:
    found = []
    for path in sorted(REPO.glob("roles/*/tasks/*.yml")) + sorted(REPO.glob("playbooks/*.yml")):
        for task in tasks(yaml.safe_load(path.read_text()) or []):
            if VENV_PROGRAM.search(program(task)) and not task.get("become_user"):
                found.append(f"{path.relative_to(REPO)}: {task.get('name')}")
    return found


def test_no_task_runs_a_venv_program_as_root():
    found = root_runs_venv_code()
    assert not found, "tasks that run a venv's program as root:\n" + "\n".join(found)


def test_the_check_sees_the_ways_a_venv_program_is_named():
    for argv0 in (
        "{{ python_env_path }}/bin/python",
        "{{ [python_env_path ~ '/bin/python', '-c', script] }}",
        "{{ cuda_torch_python }}",
        "exec {{ nccl_network_venv | quote }}/bin/torchrun --nnodes=2",
    ):
        assert VENV_PROGRAM.search(argv0), argv0
    for argv0 in ("setpriv", "{{ [_python_env_python, '-I', '-c', script, python_env_path] }}", "systemctl"):
        assert not VENV_PROGRAM.search(argv0), argv0
