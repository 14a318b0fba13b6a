"""A venv with a planted .pth file, and root's look at it (role _trusted_venv's venv_state.py), for the tests of
the trusted-venv step and of its callers: a .pth runs in every interpreter its venv starts, with the caller's
rights, so a look that started the venv's python would write the marker."""

from __future__ import annotations

import json
import subprocess
import sys
import venv
from pathlib import Path

VENV_STATE = Path(__file__).resolve().parents[2] / "roles" / "_trusted_venv" / "files" / "venv_state.py"
PLANT = "import os; open({marker!r}, 'w').write(str(os.getuid()))\n"


def make_venv(path: Path, *, marker: Path) -> Path:
    """A venv at path without pip, a dist-info for demo==1.0, and a planted .pth file that writes `marker`;
    returns its site-packages."""
    venv.create(path, with_pip=False, symlinks=True)
    site = next(path.glob("lib/python3*/site-packages"))
    (site / "demo-1.0.dist-info").mkdir()
    (site / "demo-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n")
    (site / "zz-planted.pth").write_text(PLANT.format(marker=str(marker)))
    return site


def look(venv_path: Path, *specs: str) -> dict:
    """What venv_state.py, run as the role runs it (the system python, -I), reports of the venv and the specs."""
    out = subprocess.run(
        [sys.executable, "-I", "-c", VENV_STATE.read_text(), str(venv_path), *specs],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out)
