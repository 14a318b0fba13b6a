"""What root learns about a venv (roles/_trusted_venv/files/venv_state.py) without running its code.

A .pth file in a venv's site-packages runs in every interpreter that venv starts, with its
caller's rights: root must never start the venv's python where another user may have written it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ansible_collections.budgetgpu.cluster.tests.unit.file_modules import load_file_module
from ansible_collections.budgetgpu.cluster.tests.unit.planted_venv import VENV_STATE, look, make_venv

REPO = Path(__file__).resolve().parents[3]
state = load_file_module("venv_state", VENV_STATE)
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give files to another uid")


def test_the_look_runs_nothing_the_venv_holds(tmp_path):
    marker = tmp_path / "marker"
    make_venv(tmp_path / "venv", marker=marker)
    # The plant works: the venv's own interpreter runs it at start.
    subprocess.run([str(tmp_path / "venv" / "bin" / "python"), "-c", "pass"], check=True)
    assert marker.exists()
    marker.unlink()
    look(tmp_path / "venv", "demo==1.0")
    assert not marker.exists()


def test_no_venv_yet(tmp_path):
    assert look(tmp_path / "venv", "demo==1.0", "torch") == {
        "exists": False,
        "unsafe_above": state.unsafe_above(str(tmp_path / "venv")),
        "unsafe_inside": None,
        "satisfied": [None, None],
        "site_packages": f"{tmp_path}/venv/lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages",
    }


def test_pins_are_read_from_the_metadata_of_a_venv_root_alone_wrote(tmp_path):
    site = make_venv(tmp_path / "venv", marker=tmp_path / "marker")
    assert [state.satisfied(spec, [str(site)]) for spec in ("demo==1.0", "demo", "demo==2.0", "other", "demo>=1")] == [
        "demo==1.0",
        "demo",
        None,
        None,
        None,
    ]


def test_a_world_writable_folder_above_the_venv_is_named(tmp_path):
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o1777)
    make_venv(tmp_path / "open" / "venv", marker=tmp_path / "marker")
    result = look(tmp_path / "open" / "venv", "demo==1.0")
    assert result["unsafe_above"] == f"{tmp_path / 'open'} is writable by every user (mode 1777)"
    assert result["satisfied"] == [None]  # nothing vouched for in a venv someone else may have written


@as_root
def test_a_file_of_the_training_user_inside_makes_the_venv_unsafe(tmp_path):
    site = make_venv(tmp_path / "venv", marker=tmp_path / "marker")
    assert state.unsafe_inside(str(tmp_path / "venv")) is None
    os.chown(site / "zz-planted.pth", 1234, 1234)
    assert state.unsafe_inside(str(tmp_path / "venv")) == f"{site / 'zz-planted.pth'} is owned by uid 1234"


@as_root
def test_a_group_writable_file_inside_makes_the_venv_unsafe(tmp_path):
    site = make_venv(tmp_path / "venv", marker=tmp_path / "marker")
    os.chown(site, 0, 1234)
    site.chmod(0o775)
    assert state.unsafe_inside(str(tmp_path / "venv")) == f"{site} is writable by group gid 1234 (mode 0775)"


@as_root
def test_a_link_to_a_venv_of_the_training_user_is_followed(tmp_path):
    (tmp_path / "home").mkdir()
    make_venv(tmp_path / "home" / "venv", marker=tmp_path / "marker")
    os.chown(tmp_path / "home", 1234, 1234)
    (tmp_path / "link").symlink_to(tmp_path / "home" / "venv")
    assert state.unsafe_above(str(tmp_path / "link")) == f"{tmp_path / 'home'} is owned by uid 1234"


@as_root
def test_a_pth_line_naming_a_folder_of_the_training_user_makes_the_venv_unsafe(tmp_path):
    site = make_venv(tmp_path / "venv", marker=tmp_path / "marker")
    (tmp_path / "lib").mkdir()
    (site / "sim.pth").write_text(f"# gpu_sim's drop-in\n{tmp_path / 'lib'}\n")
    assert state.unsafe_inside(str(tmp_path / "venv")) is None
    # The folders above it count too (pytest's tmp_path lies in /tmp).
    assert state.unsafe_pth_path(str(tmp_path / "venv")).endswith(": /tmp is writable by every user (mode 1777)")
    os.chown(tmp_path / "lib", 1234, 1234)
    assert state.unsafe_pth_path(str(tmp_path / "venv")) == (
        f"{site / 'sim.pth'} adds {tmp_path / 'lib'}: {tmp_path / 'lib'} is owned by uid 1234"
    )
