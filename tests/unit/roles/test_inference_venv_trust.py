"""Root runs pip in the inference venv only when python_env's trust check passes it (issue 24): the
inference role's one look at a node (roles/inference/files/inference_state.py) runs that check,
python_env's own venv_state.py, and reads nothing from a venv that another user may change."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
LOOK = REPO / "roles" / "inference" / "files" / "inference_state.py"
TRUST = REPO / "roles" / "python_env" / "files" / "venv_state.py"
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give files to another uid")


def make_venv(root: Path, marker: Path) -> Path:
    """A venv holding demo==1.0 and a planted .pth that writes `marker` when the venv's python starts."""
    path = root / "venv"
    venv.create(path, with_pip=False, symlinks=True)
    site = next(path.glob("lib/python3*/site-packages"))
    (site / "demo-1.0.dist-info").mkdir()
    (site / "demo-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n")
    (site / "zz-planted.pth").write_text(f"import os; open({str(marker)!r}, 'w').write(str(os.getuid()))\n")
    return site


def look(path: Path, *requirements: str) -> dict:
    args = {"venv": str(path), "requirements": list(requirements)}
    out = subprocess.run(
        [sys.executable, "-I", "-c", LOOK.read_text(), json.dumps(args), TRUST.read_text()],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out)


def test_the_role_passes_python_envs_own_trust_check_to_the_look():
    install = (REPO / "roles" / "inference" / "tasks" / "install.yml").read_text()
    assert "role_path ~ '/../python_env/files/venv_state.py'" in install
    assert "Refuse to run pip in a venv that others may change" in install
    # The assert comes before pip.
    assert install.index("Refuse to run pip") < install.index("Install the worker's pinned packages")


def test_a_venv_root_alone_wrote_is_trusted_and_read(tmp_path):
    make_venv(tmp_path, tmp_path / "marker")
    got = look(tmp_path / "venv", "demo==1.0", "other==2.0")
    expected_above = subprocess.run(
        [sys.executable, "-I", "-c", TRUST.read_text(), str(tmp_path / "venv")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert got["trust"]["unsafe_inside"] is None
    assert got["trust"]["unsafe_above"] == json.loads(expected_above.stdout)["unsafe_above"]
    if got["trust"]["unsafe_above"] is None:
        assert got["missing"] == ["other==2.0"]
    assert not (tmp_path / "marker").exists()


@as_root
def test_a_venv_the_training_user_owns_is_refused_and_not_read(tmp_path):
    site = make_venv(tmp_path, tmp_path / "marker")
    os.chown(site / "zz-planted.pth", 1234, 1234)
    got = look(tmp_path / "venv", "demo==1.0")
    assert got["trust"]["unsafe_inside"] == f"{site / 'zz-planted.pth'} is owned by uid 1234"
    assert got["missing"] == ["demo==1.0"]  # nothing vouched for from a venv another user may have written
    assert not (tmp_path / "marker").exists()  # and nothing of it ran


@as_root
def test_a_user_owned_venv_directory_is_refused(tmp_path):
    make_venv(tmp_path, tmp_path / "marker")
    os.chown(tmp_path / "venv", 1234, 1234)
    got = look(tmp_path / "venv", "demo==1.0")
    assert got["trust"]["unsafe_inside"] == f"{tmp_path / 'venv'} is owned by uid 1234"
    assert not (tmp_path / "marker").exists()


def test_the_look_reports_the_service_users_accounts_and_uid_min(tmp_path):
    # The role refuses a service user that is an existing system account it did not create (issue 40):
    # the look reads each user's uid and passwd comment, and the node's UID_MIN.
    args = {"venv": str(tmp_path / "none"), "users": ["root", "no-such-user-budgetgpu"]}
    out = subprocess.run(
        [sys.executable, "-I", "-c", LOOK.read_text(), json.dumps(args), TRUST.read_text()],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    got = json.loads(out)
    assert got["users"]["root"]["uid"] == 0 and got["users"]["no-such-user-budgetgpu"] is None
    assert isinstance(got["uid_min"], int) and got["uid_min"] >= 100
