"""gpu_sim's simulated driver makes the GPUs' device nodes as the NVIDIA driver does when it loads: with the
owner, group and mode of the nvidia module's options in modprobe.d (role nvidia_driver's), 0666 root's without."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from ansible_collections.budgetgpu.cluster.tests.unit.file_modules import load_file_module

ROLE = Path(__file__).resolve().parents[3] / "roles" / "gpu_sim"


@pytest.fixture(scope="module")
def sim():
    return load_file_module("sim_nvidia_devices", ROLE / "files" / "sim_nvidia_devices.py")


def profile(name: str) -> dict:
    return json.loads((ROLE / "files" / "profiles" / f"{name}.json").read_text())


def test_the_options_are_read_as_modprobe_reads_them(sim, tmp_path):
    etc, lib = tmp_path / "etc", tmp_path / "lib"
    etc.mkdir()
    lib.mkdir()
    (lib / "nvidia.conf").write_text("options nvidia NVreg_DeviceFileMode=0666 NVreg_DeviceFileGID=44\n")
    # A file of the same name in the first directory replaces the later one's.
    (etc / "nvidia.conf").write_text("# options nvidia NVreg_DeviceFileMode=0600\n")
    (etc / "budgetgpu-nvidia-devices.conf").write_text(
        "options nvidia NVreg_DeviceFileUID=0 NVreg_DeviceFileGID=997 NVreg_DeviceFileMode=0660\n"
        "options nvidia-current NVreg_DeviceFileMode=0600\noptions nvidia_uvm NVreg_DeviceFileMode=0\n"
    )
    assert sim.module_options((str(etc), str(lib))) == {
        "NVreg_DeviceFileUID": 0,
        "NVreg_DeviceFileGID": 997,
        "NVreg_DeviceFileMode": 0o660,
        "NVreg_ModifyDeviceFiles": 1,
    }
    # The driver's own defaults where nothing is set.
    assert sim.module_options((str(tmp_path / "none"),))["NVreg_DeviceFileMode"] == 0o666
    assert [sim.c_integer(text) for text in ("0660", "0x1b6", "438", "0")] == [0o660, 0o666, 438, 0]


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod of a character device needs root (the build machines run as root)")
def test_the_nodes_get_the_options_owner_group_and_mode_and_are_set_again(sim, tmp_path):
    gid = os.getgid() + 1
    options = {**sim.DRIVER_DEFAULTS, "NVreg_DeviceFileGID": gid, "NVreg_DeviceFileMode": 0o660}
    assert sim.driver_gpus(profile("mixed-3090-4090")) == 4 and sim.driver_gpus(profile("no-driver")) == 0
    assert sim.make_nodes(2, options, str(tmp_path)) == [f"created {tmp_path}/nvidia0", f"created {tmp_path}/nvidia1"]
    info = os.lstat(tmp_path / "nvidia1")
    assert stat.S_ISCHR(info.st_mode) and (os.major(info.st_rdev), os.minor(info.st_rdev)) == (195, 1)
    assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (0, gid, 0o660)
    os.chmod(tmp_path / "nvidia0", 0o666)
    assert sim.make_nodes(2, options, str(tmp_path)) == [f"set {tmp_path}/nvidia0"]
    # NVreg_ModifyDeviceFiles=0: the driver leaves a node that exists as it is.
    os.chmod(tmp_path / "nvidia0", 0o666)
    assert sim.make_nodes(2, {**options, "NVreg_ModifyDeviceFiles": 0}, str(tmp_path)) == []
