"""Root runs pip in the inference venv only when the job venv's trust check passes it (issue 24): the
inference role looks at its workers' venv through role _trusted_venv, the look python_env's venv passes
(roles/_trusted_venv/files/venv_state.py), and reads nothing from a venv that another user may change;
its one look at the rest of the node (roles/inference/files/inference_state.py) reads the users."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ansible_collections.budgetgpu.cluster.tests.unit.planted_venv import look as venv_state
from ansible_collections.budgetgpu.cluster.tests.unit.planted_venv import make_venv

REPO = Path(__file__).resolve().parents[3]
LOOK = REPO / "roles" / "inference" / "files" / "inference_state.py"
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give files to another uid")


def look(path: Path, *requirements: str) -> dict:
    """The role's look at its workers' venv (role _trusted_venv's), with `missing`: the requirements it does
    not vouch for."""
    found = venv_state(path, *requirements)
    return found | {
        "missing": [req for req, have in zip(requirements, found["satisfied"], strict=True) if have is None]
    }


def test_the_role_passes_its_venv_through_the_trusted_venv_look_before_pip():
    tasks = yaml.safe_load((REPO / "roles" / "inference" / "tasks" / "install.yml").read_text())
    names = [task["name"] for task in tasks]
    includes = {
        task["name"]: task["ansible.builtin.include_role"] for task in tasks if "ansible.builtin.include_role" in task
    }
    refusal = includes["Refuse to run pip in a venv that others may change"]
    assert refusal == {"name": "budgetgpu.cluster._trusted_venv", "tasks_from": "look"}
    assert includes["Install the worker's pinned packages into the venv"]["tasks_from"] == "install"
    # The look (and its refusal) comes before pip, and both look at inference_venv.
    assert names.index("Refuse to run pip in a venv that others may change") < names.index(
        "Install the worker's pinned packages into the venv"
    )
    looked = next(task for task in tasks if task["name"] == "Refuse to run pip in a venv that others may change")
    assert looked["vars"]["_trusted_venv_path"] == "{{ inference_venv }}"
    assert "venv_state.py" not in (REPO / "roles" / "inference" / "tasks" / "install.yml").read_text()


def test_a_venv_root_alone_wrote_is_trusted_and_read(tmp_path):
    make_venv(tmp_path / "venv", marker=tmp_path / "marker")
    got = look(tmp_path / "venv", "demo==1.0", "other==2.0")
    assert got["unsafe_inside"] is None
    assert got["unsafe_above"] == venv_state(tmp_path / "venv")["unsafe_above"]
    if got["unsafe_above"] is None:
        assert got["missing"] == ["other==2.0"]
    assert not (tmp_path / "marker").exists()


@as_root
def test_a_venv_the_training_user_owns_is_refused_and_not_read(tmp_path):
    site = make_venv(tmp_path / "venv", marker=tmp_path / "marker")
    os.chown(site / "zz-planted.pth", 1234, 1234)
    got = look(tmp_path / "venv", "demo==1.0")
    assert got["unsafe_inside"] == f"{site / 'zz-planted.pth'} is owned by uid 1234"
    assert got["missing"] == ["demo==1.0"]  # nothing vouched for from a venv another user may have written
    assert not (tmp_path / "marker").exists()  # and nothing of it ran


@as_root
def test_a_user_owned_venv_directory_is_refused(tmp_path):
    make_venv(tmp_path / "venv", marker=tmp_path / "marker")
    os.chown(tmp_path / "venv", 1234, 1234)
    got = look(tmp_path / "venv", "demo==1.0")
    assert got["unsafe_inside"] == f"{tmp_path / 'venv'} is owned by uid 1234"
    assert not (tmp_path / "marker").exists()


def test_the_look_reports_the_service_users_accounts_and_uid_min(tmp_path):
    # The role refuses a service user that is an existing system account it did not create (issue 40):
    # the look reads each user's uid and passwd comment, and the node's UID_MIN.
    args = {"users": ["root", "no-such-user-budgetgpu"], "wheelhouse": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-I", "-c", LOOK.read_text(), json.dumps(args)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    got = json.loads(out)
    assert got["users"]["root"]["uid"] == 0 and got["users"]["no-such-user-budgetgpu"] is None
    assert isinstance(got["uid_min"], int) and got["uid_min"] >= 100
    assert got["wheelhouse"] is False
