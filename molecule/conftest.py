"""What the scenarios' tests share: a playbook of the checkout run against the scenario's nodes (pytest loads
this file for every scenario's tests: the rootdir is the checkout, where pyproject.toml is)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_playbook(name: str, *args: str, **env_extra: str) -> subprocess.CompletedProcess:
    """Run playbooks/<name> as a user (or the nightly run) would. The result's stdout holds the words of
    both streams, whitespace made single spaces: failures go to stderr (molecule's ansible.cfg, which
    the verifier's environment names, sets display_failed_stderr), and the callback wraps long
    messages (a literal \\n in their quoted form)."""
    repo = Path(os.environ["MOLECULE_PROJECT_DIRECTORY"])
    env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_FORCE_COLOR": "0", **env_extra}
    argv = [str(Path(sys.executable).parent / "ansible-playbook"), "-i", os.environ["MOLECULE_INVENTORY_FILE"]]
    argv += [str(repo / "playbooks" / name), *args]
    done = subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True, timeout=300, check=False)
    words = " ".join((done.stdout + done.stderr).replace("\\n", " ").split())
    return subprocess.CompletedProcess(argv, done.returncode, words, done.stderr)


@pytest.fixture(name="playbook")
def fixture_playbook():
    """run_playbook, for the tests."""
    return run_playbook
