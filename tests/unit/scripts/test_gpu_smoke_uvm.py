"""gpu-smoke --sandbox (roles/probe/files): its line about nvidia-uvm at boot, the device node and modules-load.d."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def smoke():
    from ansible_collections.budgetgpu.cluster.tests.unit.file_modules import load_file_module

    return load_file_module("gpu_smoke_uvm", REPO / "roles" / "probe" / "files" / "gpu-smoke")


def test_uvm_node_and_the_entry_that_loads_it(smoke, tmp_path):
    dev, etc, lib = tmp_path / "dev", tmp_path / "etc", tmp_path / "lib"
    for folder in (dev, etc, lib):
        folder.mkdir()
    (dev / "nvidia-uvm").write_text("")
    (etc / "budgetgpu-nvidia-uvm.conf").write_text("# managed\nnvidia-uvm\n")
    (etc / "other.conf").write_text("# nvidia-uvm named in a comment only\nloop\n")
    (lib / "nvidia.conf").write_text("nvidia-drm\n")
    (etc / "modules.conf").symlink_to(tmp_path / "no-such-file")
    line = smoke.uvm_at_boot(str(dev), (str(etc), str(lib), str(tmp_path / "absent")))
    assert line == (
        f"sandbox  /dev/nvidia-uvm present before the job; nvidia-uvm at boot: {etc / 'budgetgpu-nvidia-uvm.conf'}"
    )


def test_a_node_without_either_says_so(smoke, tmp_path):
    line = smoke.uvm_at_boot(str(tmp_path), (str(tmp_path),))
    assert line == "sandbox  /dev/nvidia-uvm missing before the job; nvidia-uvm at boot: no modules-load.d entry"
