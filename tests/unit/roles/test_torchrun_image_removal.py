"""Old images removed (issue 44, docs/job-images.md): roles/torchrun/tasks/old_images.yml's command, rendered as
the role renders it and run on a fake node (its unit files, /proc and Docker in a temporary directory), removes
an image's directory and Docker's copy once nothing names it, and never an image this run's jobs, a unit file or
a running unit's mounts still name."""

from __future__ import annotations

import subprocess
from pathlib import Path

import jinja2
import pytest
import yaml
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.jobs import IMAGE_ROOT, job_image
from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import REPO

PLANNED, UNIT_NAMES, MOUNTED, PULLED, LOADED, SLURM = ("a" * 63 + str(n) for n in range(6))
UNITS = "/etc/systemd/system"
PROC = "/proc/"
# What stays whatever the plan says: what a unit file names or a process has mounted, and what is no image.
KEPT = sorted([PLANNED, UNIT_NAMES, MOUNTED, SLURM, "not-an-image"])
# Docker's answers: `docker image inspect --format {{.Id}} sha256:<hex>` finds the loaded image, `docker image ls
# --digests` lists the pulled one by its registry digest; every call is logged.
FAKE_DOCKER = f"""#!/bin/bash
echo "$*" >>"$(dirname "$0")/calls"
case "$1 $2" in
  "image inspect") [ "${{@: -1}}" = "sha256:{LOADED}" ] && echo "sha256:{LOADED}" || exit 1 ;;
  "image ls") echo "registry.lan/team/train@sha256:{PULLED}"; echo "budgetgpu-job-image@<none>" ;;
esac
"""


def removal_script(tmp_path: Path, planned: list[str]) -> str:
    """The task's command as the role renders it (for this run's images), its unit files' and /proc's paths moved
    under tmp_path."""
    (task,) = yaml.safe_load((REPO / "roles/torchrun/tasks/old_images.yml").read_text())
    command = jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(task["ansible.builtin.shell"]["cmd"])
    script = command.render(
        _torchrun_image_root=str(tmp_path / "images"),
        _torchrun_images=[job_image({"name": "main", "image": f"team/train@sha256:{hex_}"}) for hex_ in planned],
    )
    assert UNITS in script and PROC in script
    return script.replace(UNITS, f"{tmp_path}/units").replace(PROC, f"{tmp_path}/proc/")


@pytest.fixture
def node(tmp_path) -> Path:
    """Six unpacked images: one this run plans, one a (stopped) unit file names, one a running unit has mounted
    (its file already names another: restart pending), one role slurm's mount unit names (not mounted now), one
    pulled and one loaded that nothing names. Plus a directory that is no image's and a link out of an image to a
    file of the host."""
    images = tmp_path / "images"
    for hex_ in (PLANNED, UNIT_NAMES, MOUNTED, SLURM, PULLED, LOADED):
        (images / hex_ / "rootfs/etc").mkdir(parents=True)
        (images / hex_ / "env").write_text("PATH=/usr/bin\n")
    (images / "not-an-image").mkdir()
    (tmp_path / "host-file").write_text("the host's\n")
    (images / LOADED / "rootfs/etc/passwd").symlink_to(tmp_path / "host-file")
    (tmp_path / "units").mkdir()
    (tmp_path / "units/budgetgpu-job-old.service").write_text(
        f"[Service]\nEnvironmentFile={images}/{UNIT_NAMES}/env\nRootDirectory={images}/{UNIT_NAMES}/rootfs\n"
    )
    (tmp_path / "units/budgetgpu-job-main.service").write_text(f"[Service]\nRootDirectory={images}/{PLANNED}/rootfs\n")
    (tmp_path / "units/opt-budgetgpu-slurm-images-x.mount").write_text(f"[Mount]\nWhat={images}/{SLURM}/rootfs\n")
    (tmp_path / "proc/1").mkdir(parents=True)
    (tmp_path / "proc/1/mountinfo").write_text("25 1 0:23 / / rw,relatime - overlay overlay rw\n")
    (tmp_path / "proc/4242").mkdir()
    (tmp_path / "proc/4242/mountinfo").write_text(
        f"310 250 0:23 {images}/{MOUNTED}/rootfs / ro,nosuid,relatime - overlay overlay rw\n"
    )
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin/docker").write_text(FAKE_DOCKER)
    (tmp_path / "bin/docker").chmod(0o755)
    return tmp_path


def run(node: Path, script: str) -> str:
    proc = subprocess.run(
        ["bash", "-c", script],
        env={"PATH": f"{node}/bin:/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_the_role_looks_where_the_plan_unpacks():
    variables = yaml.safe_load((REPO / "roles/torchrun/vars/main.yml").read_text())
    assert variables["_torchrun_image_root"] == IMAGE_ROOT
    assert job_image({"name": "main", "image": f"team/train@sha256:{PLANNED}"})["root"].startswith(f"{IMAGE_ROOT}/")


def test_an_image_nothing_names_goes_whole_with_dockers_copy(node):
    out = run(node, removal_script(node, [PLANNED]))
    images = node / "images"
    assert sorted(p.name for p in images.iterdir()) == KEPT
    # rm -rf removed the link, not the host's file it pointed at.
    assert (node / "host-file").read_text() == "the host's\n"
    calls = (node / "bin/calls").read_text().splitlines()
    assert f"image rm registry.lan/team/train@sha256:{PULLED}" in calls
    assert f"image rm sha256:{LOADED}" in calls
    assert [call for call in calls if call.startswith("image rm")] == [
        f"image rm registry.lan/team/train@sha256:{PULLED}",
        f"image rm sha256:{LOADED}",
    ]
    assert f"removed {images}/{PULLED}" in out and f"removed {images}/{LOADED}" in out
    # A second run finds nothing more to remove: the task reports no change.
    (node / "bin/calls").unlink()
    assert run(node, removal_script(node, [PLANNED])) == ""
    assert not (node / "bin/calls").exists()


def test_an_image_a_running_unit_or_a_unit_file_names_stays_when_the_plan_drops_it(node):
    # The last image job removed: this run plans no image; the pending unit's file still names PLANNED.
    run(node, removal_script(node, []))
    assert sorted(p.name for p in (node / "images").iterdir()) == KEPT


def test_a_node_without_images_runs_nothing(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin/docker").write_text(FAKE_DOCKER)
    (tmp_path / "bin/docker").chmod(0o755)
    assert run(tmp_path, removal_script(tmp_path, [])) == ""
    assert not (tmp_path / "bin/calls").exists()
