"""slurm_energy: a Slurm job's identity from slurmd's environment (refused where it is not slurmd's form),
its GPUs' counters by device minor and UUID, the joules and kWh between start and end, and what root writes
for a job: only through directories of its own, by descriptor."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import pytest
from ansible_collections.budgetgpu.cluster.plugins.module_utils.slurm_energy import (
    MAX_RECORD_BYTES,
    Refused,
    gpu_energy,
    job_counters,
    job_energy,
    job_identity,
    make_user_dir,
    open_root_dir,
    read_records,
    write_file,
)
from ansible_collections.budgetgpu.cluster.tests.unit.scripts.test_job_record import RACER

GPUS = [
    {"index": 0, "minor": 0, "uuid": "GPU-a", "joules": 1000.0},
    {"index": 1, "minor": 1, "uuid": "GPU-b", "joules": 2000.0},
    {"index": 2, "minor": 2, "uuid": "GPU-c", "joules": 3000.0},
]
COUNTERS = {"GPU-a": 1000.0, "GPU-b": 2000.0, "GPU-c": 3000.0}


def test_the_job_comes_from_slurmds_environment():
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_USER": "alice", "SLURM_JOB_UID": "2001", "SLURM_JOB_GPUS": "0,2"}
    assert job_identity(env) == {"job": "42", "user": "alice", "uid": 2001, "gpus": [0, 2]}
    assert job_identity({**env, "SLURM_JOB_GPUS": ""})["gpus"] == []
    assert job_identity({**env, "SLURM_JOB_UID": "x"})["uid"] is None


def test_a_job_id_or_user_not_in_slurmds_form_records_nothing():
    assert job_identity({"SLURM_JOB_ID": "../../etc/passwd", "SLURM_JOB_USER": "alice"}) is None
    assert job_identity({"SLURM_JOB_ID": "42", "SLURM_JOB_USER": "a b"}) is None
    # The user names a directory under the checkpoint root.
    assert job_identity({"SLURM_JOB_ID": "42", "SLURM_JOB_USER": ".."}) is None
    assert job_identity({"SLURM_JOB_ID": "42", "SLURM_JOB_USER": "alice", "SLURM_JOB_GPUS": "0;rm"})["gpus"] == []


def test_the_jobs_gpus_are_taken_by_device_minor_and_kept_by_uuid():
    assert job_counters(GPUS, [0, 2]) == {"GPU-a": 1000.0, "GPU-c": 3000.0}
    assert job_counters(GPUS, []) == {}
    # Minors in another order than NVML's indices: Slurm's numbers are the minors (File=/dev/nvidiaN).
    swapped = [{**gpu, "minor": 2 - gpu["index"]} for gpu in GPUS]
    assert job_counters(swapped, [0]) == {"GPU-c": 3000.0}
    # No minor from NVML: the index stands in, as gres.conf's File= does.
    assert job_counters([{**gpu, "minor": None} for gpu in GPUS], [1]) == {"GPU-b": 2000.0}


def test_a_gpu_without_a_counter_bills_nobody_for_its_neighbour():
    """GPU 1 has no energy counter: the job on GPU 2 is billed for GPU 2, not for the GPU after it (the
    earlier code took the job's GPUs by position among the GPUs that had a counter)."""
    gpus = [*GPUS, {"index": 3, "minor": 3, "uuid": "GPU-d", "joules": 4000.0}]
    gpus[1] = {**gpus[1], "joules": None}
    assert job_counters(gpus, [2]) == {"GPU-c": 3000.0}
    assert job_counters(gpus, [1]) == {}


def test_gpu_energy_reads_each_gpus_minor_and_counter(fake_pynvml):
    found = gpu_energy(fake_pynvml("rtx3090x4-risers"))
    assert [(gpu["index"], gpu["minor"]) for gpu in found] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert all(gpu["uuid"].startswith("GPU-") and gpu["joules"] > 0 for gpu in found)
    assert gpu_energy(fake_pynvml(None)) == []


def test_energy_between_start_and_end_and_a_counter_that_went_back_counts_nothing():
    start = {
        "job": "42",
        "user": "alice",
        "gpus": [0, 1],
        "time": 100.0,
        "counters": {"GPU-a": 1000.0, "GPU-b": 2000.0},
    }
    record = job_energy(start, {"GPU-a": 3.6e6 + 1000.0, "GPU-b": 10.0}, 160.0)
    assert record == {
        "job": "42",
        "user": "alice",
        "gpus": [0, 1],
        "start": 100.0,
        "end": 160.0,
        "seconds": 60.0,
        "joules": {"GPU-a": 3.6e6},
        "kwh": 1.0,
    }


def test_an_end_without_a_start_records_no_energy():
    record = job_energy({"job": "42", "user": "alice", "gpus": [0], "time": None, "counters": {}}, COUNTERS, 160.0)
    assert record["joules"] == {} and record["seconds"] == 0.0 and record["kwh"] == 0.0


def test_the_report_reads_the_ended_jobs_of_its_window_and_follows_no_link(tmp_path):
    ended = {"job": "41", "user": "ana", "end": 2000.0, "kwh": 0.5, "joules": {"GPU-a": 1.8e6}}
    (tmp_path / "41.json").write_text(json.dumps(ended))
    (tmp_path / "40.json").write_text(json.dumps({**ended, "job": "40", "end": 500.0}))  # before the window
    (tmp_path / "42.json").write_text(json.dumps({"job": "42", "user": "bo", "time": 2100.0}))  # still running
    (tmp_path / "43.json").write_text("not json")
    (tmp_path / "44.json").write_text(json.dumps({**ended, "job": "44", "pad": "x" * MAX_RECORD_BYTES}))
    (tmp_path / "secret").write_text(json.dumps({**ended, "job": "45"}))
    os.symlink(tmp_path / "secret", tmp_path / "45.json")
    (tmp_path / ".job.tmp").write_text(json.dumps(ended))  # the epilog's file being written
    assert read_records(str(tmp_path), since=1000.0) == [ended]
    assert read_records(str(tmp_path / "missing"), since=0.0) == []


def _roots_dir(path):
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o755)
    return path


def test_root_writes_through_a_directory_it_made_and_checked(tmp_path):
    fd = open_root_dir(str(tmp_path / "var" / "slurm-jobs"), str(tmp_path))
    try:
        write_file(fd, "42.json", b"{}")
    finally:
        os.close(fd)
    assert (tmp_path / "var" / "slurm-jobs" / "42.json").read_bytes() == b"{}"
    assert (tmp_path / "var").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "var" / "slurm-jobs" / "42.json").stat().st_mode & 0o777 == 0o644
    assert [p.name for p in (tmp_path / "var" / "slurm-jobs").iterdir()] == ["42.json"]


@pytest.mark.parametrize("kind", ["link on the way", "others may write", "group may write", "not a directory"])
def test_a_directory_others_may_write_or_a_link_is_refused(tmp_path, kind):
    base = _roots_dir(tmp_path / "base")
    elsewhere = _roots_dir(tmp_path / "elsewhere")
    if kind == "link on the way":
        (base / "var").symlink_to(elsewhere)
    elif kind == "not a directory":
        (base / "var").write_text("")
    else:
        _roots_dir(base / "var").chmod(0o1777 if kind == "others may write" else 0o775)
    with pytest.raises(Refused, match=str(base / "var")):
        open_root_dir(str(base / "var" / "slurm-jobs"), str(base))
    assert list(elsewhere.iterdir()) == []
    assert not (base / "var" / "slurm-jobs").exists()


def test_write_file_never_chmods_a_racers_link(tmp_path):
    """A racer swapping every temporary file for a link to a root-only file: the mode is set through the
    descriptor of the file write_file made, so the secret's mode never changes (the Prolog before chmodded its
    mkstemp file by path: a Slurm user made a root-only file world-readable in 8 of 300 runs)."""
    directory = tmp_path / "racy"
    directory.mkdir(mode=0o777)
    directory.chmod(0o777)
    secret = tmp_path / "shadow"
    secret.write_text("root:secret\n")
    secret.chmod(0o600)
    racer = subprocess.Popen([sys.executable, "-c", RACER, str(directory), str(secret)])
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    runs, deadline = 0, time.monotonic() + 4
    try:
        while runs < 300 or (runs < 3000 and time.monotonic() < deadline):
            # The racer may take the name away: a failed record, never a chmod.
            with contextlib.suppress(OSError):
                write_file(fd, "42.json", b"{}")
            runs += 1
            assert secret.stat().st_mode & 0o777 == 0o600, f"the secret was chmodded in run {runs}"
    finally:
        racer.kill()
        racer.wait()
        os.close(fd)
    assert secret.read_text() == "root:secret\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a directory to another user")
def test_root_makes_each_users_checkpoint_directory_so_no_one_takes_it_first(tmp_path):
    root = _roots_dir(tmp_path / "slurm-checkpoints")
    fd = open_root_dir(str(root), str(tmp_path), create=False)
    try:
        assert make_user_dir(fd, "ana", 2001, 2001) == "made ana (2001:2001, 0700)"
        info = (root / "ana").stat()
        assert (info.st_uid, info.st_gid, info.st_mode & 0o777) == (2001, 2001, 0o700)
        assert make_user_dir(fd, "ana", 2001, 2001) == "ana is there"
        # ben's name taken by someone else (left by an earlier 1777 root): refused and left as it is.
        (root / "ben").mkdir()
        os.chown(root / "ben", 2001, 2001)
        with pytest.raises(Refused, match="ben: owned by uid 2001, expected 2002"):
            make_user_dir(fd, "ben", 2002, 2002)
        assert (root / "ben").stat().st_uid == 2001
        # A link where a user's directory goes is never followed, never chowned.
        target = _roots_dir(tmp_path / "etc")
        (root / "cy").symlink_to(target)
        with pytest.raises(Refused, match="cy: cannot open it as a directory"):
            make_user_dir(fd, "cy", 2003, 2003)
        assert target.stat().st_uid == 0
    finally:
        os.close(fd)
