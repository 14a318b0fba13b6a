"""An image job (issue 44 item 4, docs/job-images.md) on node1, whose Docker engine is Debian's real docker.io:
the image is built here from the wheelhouse (scripts/build-job-image: the node image's python3 and the CPU torch
wheel, one layer), saved as a tarball on the control node, loaded and unpacked by train.yml, and the example
trainer runs in it on one node with 2 ranks (gloo). node2's engine is a dummy, so a second node would need a
second real engine and a second load and unpack of a 1 GB image: the rendezvous across nodes is the cluster
scenario's (a venv job), the image job's unit is the same unit with RootDirectory=. A killed rank resumes
from its checkpoint; the job user finds no engine, cannot read the unpacked image on the host, and cannot
write /etc or /usr in its unit; a tarball whose image is not the digest named is refused from its manifest,
neither copied nor loaded, with no unit changed; the job stops on request; once no job names the image, its
directory and Docker's copy go.

The tests run in file order, each leaving the job as the next expects."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

NODE = "container_runtime-node1"
JOB = "imagejob"
UNIT = f"budgetgpu-job-{JOB}.service"
JOB_DIR = f"/var/lib/budgetgpu/jobs/{JOB}"
CKPT_DIR = f"{JOB_DIR}/checkpoints"
CKPT_EVERY = 10
IMAGES = "/var/lib/budgetgpu/images"
REPO = Path(os.environ.get("MOLECULE_PROJECT_DIRECTORY", Path(__file__).resolve().parents[3]))
STEP = re.compile(r"^step=(\d+) loss=[\d.]+ world=(\d+) ")
RESUMED = re.compile(r"^resumed from step (\d+) ")
STOPPED = re.compile(r"^stopped at step (\d+)")


def sh(command: str, check: bool = True, user: str = "root") -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["docker", "exec", "-u", user, NODE, "bash", "-c", command],
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    if check:
        assert proc.returncode == 0, f"`{command}` as {user} failed ({proc.returncode}): {proc.stderr.strip()}"
    return proc


def journal() -> list[str]:
    return sh(f"journalctl -u {UNIT} -o cat --no-pager -q").stdout.splitlines()


def matches(pattern: re.Pattern[str], lines: list[str]) -> list[int]:
    return [int(m[1]) for line in lines if (m := pattern.match(line))]


def checkpoints() -> list[str]:
    return [name for name in sh(f"ls {CKPT_DIR}", check=False).stdout.split() if name.startswith("step-")]


def show(prop: str) -> str:
    return sh(f"systemctl show -p {prop} --value {UNIT}").stdout.strip()


def wait_for(what: str, predicate: Callable[[], object], timeout: float = 180.0) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := predicate():
            return result
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; journal tail: {journal()[-15:]}")


def ranks() -> list[int]:
    """The pids of the job's 2 workers (children of the launcher, which runs torchrun in its process)."""
    out = sh(f"ps -o pid=,args= --ppid {show('MainPID')}").stdout
    return [int(line.split()[0]) for line in out.splitlines() if "train_ddp.py" in line]


def unit_mounts() -> dict[str, tuple[str, str]]:
    """{mount point: (root of the mount in its file system, per-mount options)} as a rank sees its file system
    (/proc/PID/mountinfo, which root reads without entering the unit: the node container has no CAP_SYS_PTRACE
    for nsenter)."""
    fields = (line.split() for line in sh(f"cat /proc/{ranks()[0]}/mountinfo").stdout.splitlines())
    return {f[4]: (f[3], f[5]) for f in fields}


def job(image: dict, **keys) -> str:
    """train.yml's extra vars: the one image job on node1 (2 ranks, a checkpoint every CKPT_EVERY steps)."""
    spec = {
        "name": JOB,
        "script": "/opt/budgetgpu/examples/train_ddp.py",
        "nodes": "distribution_engine",
        "nproc_per_node": 2,
        "image": image,
        "args": ["--max-steps", "1000000", "--log-every", "5", "--step-sleep", "0.1", "--batch-size", "32"],
        "checkpoint_every_steps": CKPT_EVERY,
        "checkpoint_every_minutes": 0,
        # Rank 0 writes status.json at each report.
        "straggler_every_steps": CKPT_EVERY,
        **keys,
    }
    return json.dumps({"torchrun_jobs": [spec], "train_hosts": NODE})


@pytest.fixture(scope="module")
def image() -> dict:
    """The job's image: its tarball on this (the control) node, built once per machine, and its id."""
    build = [str(REPO / "scripts/build-job-image")]
    proc = subprocess.run(build, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    tarball, digest = proc.stdout.split()
    return {"tarball": tarball, "digest": digest}


@pytest.fixture(scope="module")
def hex_(image) -> str:
    return image["digest"].partition(":")[2]


def test_the_job_runs_in_its_image_loaded_from_the_tarball(playbook, image, hex_):
    # The job's user, as python_env creates it (a system user with a home; this scenario provisions no venv).
    sh("id budgetgpu || useradd --system --create-home budgetgpu")
    done = playbook("train.yml", "-e", job(image))
    assert done.returncode == 0, done.stdout[-3000:]
    assert show("RootDirectory") == f"{IMAGES}/{hex_}/rootfs"
    assert sh(f"docker image inspect --format '{{{{.Id}}}}' {image['digest']}").stdout.strip() == image["digest"]
    # Root's unpacked image, 0700, and no tarball left beside it.
    assert sh(f"stat -c '%U %a' {IMAGES}/{hex_}").stdout.split() == ["root", "700"]
    assert sh(f"ls {IMAGES}/{hex_}").stdout.split() == ["env", "rootfs"]
    wait_for("2 ranks training", lambda: [line for line in journal() if (m := STEP.match(line)) and m[2] == "2"])
    pids = ranks()
    assert len(pids) == 2, pids
    users = sh(f"ps -o user= --pid {show('MainPID')} --ppid {show('MainPID')}").stdout.split()
    assert users == ["budgetgpu"] * 3, users
    # The ranks' root is the unpacked image, read-only: the host's root is not theirs.
    root, options = unit_mounts()["/"]
    assert root.endswith(f"/images/{hex_}/rootfs") and "ro" in options.split(","), (root, options)


def test_a_killed_rank_resumes_from_its_checkpoint():
    wait_for("a checkpoint", checkpoints)
    before = len(journal())
    sh(f"kill -9 {ranks()[1]}")
    resumed = wait_for("the resume after the kill", lambda: matches(RESUMED, journal()[before:]))
    assert min(resumed) > 0, journal()[before:]
    wait_for("steps after the resume", lambda: [s for s in matches(STEP, journal()[before:]) if s > min(resumed)])
    # Rank 0's status says so too (the job's file, read as root), at its next report.
    wait_for("a status after the resume", lambda: sh(f"cat {JOB_DIR}/status.json", check=False).stdout)
    status = json.loads(sh(f"cat {JOB_DIR}/status.json").stdout)
    assert status["step"] > 0, status
    assert show("ActiveState") == "active"


def test_the_job_user_has_no_engine_no_image_on_the_host_and_a_read_only_image(hex_):
    assert "docker" not in sh("id -nG budgetgpu").stdout.split()
    engine = sh("docker ps", check=False, user="budgetgpu")
    assert engine.returncode != 0 and "permission denied" in engine.stderr.lower(), engine.stderr
    for path in (f"{IMAGES}/{hex_}", f"{IMAGES}/{hex_}/rootfs/etc/os-release"):
        read = sh(f"ls {path} || cat {path}", check=False, user="budgetgpu")
        assert read.returncode != 0 and "Permission denied" in read.stderr, (path, read.stderr)
    # In its unit: the image's root is mounted read-only and nothing writable is mounted at or under /etc or /usr,
    # so no one there (root included) writes them; its state directory is bound in writable.
    mounts = unit_mounts()
    assert "ro" in mounts["/"][1].split(","), mounts["/"]
    writable = [point for point, (_root, options) in mounts.items() if "rw" in options.split(",")]
    assert not [point for point in writable if point.split("/")[1] in ("etc", "usr")], writable
    assert JOB_DIR in writable, writable


def test_a_tarball_of_another_image_is_refused_with_no_unit_changed(playbook, tmp_path):
    # Another image (one empty layer) in a tarball, named with a digest that is not its id.
    other = tmp_path / "other.tar"
    subprocess.run("tar -cf - --files-from /dev/null | docker import - budgetgpu-job-image-other:test >/dev/null"
                   f" && docker save -o {other} budgetgpu-job-image-other:test"
                   " && docker image rm budgetgpu-job-image-other:test >/dev/null",
                   shell=True, check=True, timeout=60)  # fmt: skip
    wrong = "sha256:" + "e" * 64
    unit_before = sh(f"sha256sum /etc/systemd/system/{UNIT} /etc/budgetgpu/jobs/{JOB}.env").stdout
    pid = show("MainPID")
    other_id = json.loads(
        subprocess.run(
            ["tar", "--extract", "--to-stdout", "--file", str(other), "manifest.json"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
    )[0]["Config"]
    other_id = "sha256:" + other_id.rsplit("/", 1)[-1].removesuffix(".json")
    done = playbook("train.yml", "-e", job({"tarball": str(other), "digest": wrong}))
    assert done.returncode != 0
    # Refused from the tarball's manifest on the control node: neither copied nor loaded, so not left in Docker.
    assert "image jobs refused: no image was loaded, no unit was changed" in done.stdout, done.stdout[-3000:]
    assert f"holds image {other_id}, not the job's {wrong}: docker load would give no image" in done.stdout
    assert sh(f"docker image inspect {other_id}", check=False).returncode != 0
    assert sh(f"ls -A {IMAGES}/{wrong.partition(':')[2]}", check=False).stdout.split() == []
    assert sh(f"sha256sum /etc/systemd/system/{UNIT} /etc/budgetgpu/jobs/{JOB}.env").stdout == unit_before
    assert show("MainPID") == pid


def test_the_job_stops_on_request_and_its_image_goes_once_no_job_names_it(playbook, image, hex_):
    before = len(journal())
    done = playbook("train.yml", "-e", job(image), "-e", "job_state=stopped")
    assert done.returncode == 0, done.stdout[-3000:]
    assert show("ActiveState") == "inactive"
    (stopped,) = set(matches(STOPPED, journal()[before:]))  # every rank stops at the same step
    assert sh(f"test -f {CKPT_DIR}/step-{stopped:08d}.pt", check=False).returncode == 0, stopped
    # A stopped job's unit still names its image: it stays.
    assert sh(f"test -d {IMAGES}/{hex_}/rootfs", check=False).returncode == 0
    done = playbook("train.yml", "-e", job(image, state="absent"))
    assert done.returncode == 0, done.stdout[-3000:]
    assert sh(f"test -e /etc/systemd/system/{UNIT}", check=False).returncode != 0
    # The refused digest's directory (made before the load) and the job's image: both gone, and Docker's copy.
    assert sh(f"ls -A {IMAGES}").stdout.split() == []
    assert sh(f"docker image inspect {image['digest']}", check=False).returncode != 0
    # The checkpoints stay (an absent job keeps them).
    assert checkpoints()
