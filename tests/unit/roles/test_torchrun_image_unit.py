"""An image job's unit (issue 44): the venv job's unit with the image's root filesystem as its root, the
job's directories and what its launcher needs of the host bound in; a venv job's unit has none of it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.jobs import job_image, systemd_exec
from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import REPO, render_job_units

HEX = "ab" * 32
IMAGE = job_image({"name": "main", "image": f"nvcr.io/nvidia/pytorch@sha256:{HEX}"})
LIBCUDA = "/usr/lib/x86_64-linux-gnu/libcuda.so.1"


def service_values(unit: str, key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in unit.splitlines() if line.startswith(f"{key}=")]


@pytest.fixture(scope="module")
def launcher(tmp_path_factory) -> str:
    """The launcher as install.yml installs it (0755): an image unit's ExecStart, a file the host has too."""
    path = tmp_path_factory.mktemp("bin") / "budgetgpu-torchrun"
    shutil.copy(REPO / "roles/torchrun/files/budgetgpu-torchrun", path)
    path.chmod(0o755)
    return str(path)


# Without the sandbox, and with the hardening's ProtectSystem= lifted: an image job's unit and a venv job's each.
LOOSENED = {"nosandbox": {"torchrun_sandbox": False}, "writable": {"torchrun_hardening": {"ProtectSystem": "no"}}}


@pytest.fixture(scope="module")
def units(tmp_path_factory, launcher) -> dict[str, Path]:
    """Every unit these tests read, rendered in one run: the image job's, the venv job's, and both loosened."""
    image = {"test_job": {"image": IMAGE, "exec_start": systemd_exec([launcher])}, "torchrun_launcher": launcher}
    return render_job_units(
        tmp_path_factory.mktemp("units"),
        {
            "image": {
                "test_job": {"image": IMAGE, "exec_start": systemd_exec([launcher, "--nproc-per-node=1"])},
                "torchrun_launcher": launcher,
                "_torchrun_driver_libraries": [LIBCUDA],
            },
            "venv": {},
            **{f"image-{name}": {**image, **settings} for name, settings in LOOSENED.items()},
            **{f"venv-{name}": settings for name, settings in LOOSENED.items()},
        },
    )


@pytest.fixture(scope="module")
def image_unit(units) -> Path:
    return units["image"]


def test_the_image_is_the_units_root_and_its_environment_comes_first(image_unit):
    unit = image_unit.read_text()
    assert service_values(unit, "RootDirectory") == [f"/var/lib/budgetgpu/images/{HEX}/rootfs"]
    assert service_values(unit, "MountAPIVFS") == ["yes"]
    assert service_values(unit, "EnvironmentFile") == [
        f"/var/lib/budgetgpu/images/{HEX}/env",
        "-/etc/budgetgpu/nccl.env",
        "/etc/budgetgpu/jobs/main.env",
    ]


def test_the_jobs_directories_and_what_the_launcher_needs_are_bound_in(image_unit, launcher):
    unit = image_unit.read_text()
    # The state directory alone, its checkpoints in it (test_torchrun_image_trust.py: why).
    assert service_values(unit, "BindPaths") == ["/var/lib/budgetgpu/jobs/main"]
    assert service_values(unit, "ReadWritePaths") == ["-/var/lib/budgetgpu/jobs/main"]
    assert service_values(unit, "BindReadOnlyPaths") == [
        f"{Path(launcher).parent} /opt/budgetgpu/node/packages -/opt/budgetgpu/examples -/var/lib/budgetgpu/gpu-health "
        "-/etc/hosts -/etc/resolv.conf /etc/passwd /etc/group",
        f"{LIBCUDA}:/usr/local/nvidia/lib64/libcuda.so.1",
    ]


def test_the_user_sandbox_and_devices_are_the_venv_jobs(image_unit, units):
    # Apart from its ExecStart (the plan's: the launcher alone), what the image adds, and its ReadWritePaths= (the
    # state directory alone, the test above).
    venv_unit = units["venv"].read_text()
    venv = [line for line in venv_unit.splitlines() if not line.startswith(("#", "ExecStart=", "ReadWritePaths="))]
    added = (
        "RootDirectory=",
        "MountAPIVFS=",
        "BindPaths=",
        "BindReadOnlyPaths=",
        "EnvironmentFile=/var/lib/budgetgpu/images",
    )
    image = image_unit.read_text().splitlines()
    assert [line for line in image if not line.startswith(("#", "ExecStart=", "ReadWritePaths=", *added))] == venv
    assert not [line for line in venv if line.startswith(added)]
    assert service_values(venv_unit, "ReadWritePaths") == [
        "-/var/lib/budgetgpu/jobs/main -/var/lib/budgetgpu/jobs/main/checkpoints"
    ]


@pytest.mark.parametrize("loosened", LOOSENED)
def test_the_image_stays_read_only_without_the_sandbox(units, loosened):
    # Root's tasks work in the image's tree: no job may write it, whatever torchrun_sandbox and torchrun_hardening say.
    unit = units[f"image-{loosened}"].read_text()
    assert (service_values(unit, "ProtectSystem"), service_values(unit, "PrivateTmp")) == (["strict"], ["yes"])
    venv = units[f"venv-{loosened}"].read_text()
    assert service_values(venv, "ProtectSystem") == ([] if "torchrun_sandbox" in LOOSENED[loosened] else ["no"])


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_analyze_verifies_the_image_unit(image_unit):
    # As configure.yml verifies it on a node: systemd-analyze looks for the ExecStart (the launcher) on the host.
    result = subprocess.run(["systemd-analyze", "verify", str(image_unit)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_gpu_smoke_runs_its_cuda_probe_in_the_image_with_the_images_environment(image_unit):
    # gpu-smoke --sandbox --unit budgetgpu-job-<image job>.service: before, the probe ran the venv's python (absent
    # in the image) without the image's env file, which alone gives the image's PATH and LD_LIBRARY_PATH.
    from ansible_collections.budgetgpu.cluster.tests.unit.file_modules import load_file_module

    smoke = load_file_module("gpu_smoke_image", REPO / "roles" / "probe" / "files" / "gpu-smoke")
    settings = smoke.sandbox_settings(smoke.unit_properties(image_unit.read_text()))
    assert ("RootDirectory", f"/var/lib/budgetgpu/images/{HEX}/rootfs") in settings
    assert [value for key, value in settings if key == "EnvironmentFile"] == [
        f"-/var/lib/budgetgpu/images/{HEX}/env",
        "-/etc/budgetgpu/nccl.env",
        "-/etc/budgetgpu/jobs/main.env",
    ]
    python = smoke.python_of(settings)
    assert python == "/usr/bin/env python3"
    assert smoke.sandbox_command(settings, python, "u")[-4:] == ["/usr/bin/env", "python3", "-c", smoke.SANDBOX_PROBE]
