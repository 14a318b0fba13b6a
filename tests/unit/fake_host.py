"""Run a playbook on a fake host: local connection, this Python, no fact cache, no Docker.

The role and module tests use it: bad input refused before any change, a module run for real, in a
second or two.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_playbook(
    tmp_path: Path, playbook: str, extra_vars: dict, *, host: str = "node7", options: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """ansible-playbook PLAYBOOK on `host` with extra_vars; options such as --check, --tags X."""
    path = tmp_path / "play.yml"
    path.write_text(playbook)
    variables = {"ansible_python_interpreter": sys.executable, **extra_vars}
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_COLLECTIONS_PATH": str(REPO / ".collections"),
        "ANSIBLE_CACHE_PLUGIN": "memory",
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp"),
    }
    return subprocess.run(
        [
            str(Path(sys.executable).with_name("ansible-playbook")),
            *("-i", f"{host},", "-c", "local", *options, "-e", json.dumps(variables), str(path)),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )


def output_of(result: subprocess.CompletedProcess[str]) -> str:
    """stdout and stderr with white space folded, for substring assertions."""
    return " ".join((result.stdout + result.stderr).split())
