"""slurm_energy: a Slurm job's identity from slurmd's environment (refused where it is not slurmd's form),
its GPUs' counters by Slurm's indices, and the joules and kWh between start and end."""

from __future__ import annotations

import json
import os

from ansible_collections.budgetgpu.cluster.plugins.module_utils.slurm_energy import (
    MAX_RECORD_BYTES,
    job_counters,
    job_energy,
    job_identity,
    read_records,
)

COUNTERS = {"GPU-a": 1000.0, "GPU-b": 2000.0, "GPU-c": 3000.0}


def test_the_job_comes_from_slurmds_environment():
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_USER": "alice", "SLURM_JOB_GPUS": "0,2"}
    assert job_identity(env) == {"job": "42", "user": "alice", "gpus": [0, 2]}
    assert job_identity({**env, "SLURM_JOB_GPUS": ""})["gpus"] == []


def test_a_job_id_or_user_not_in_slurmds_form_records_nothing():
    assert job_identity({"SLURM_JOB_ID": "../../etc/passwd", "SLURM_JOB_USER": "alice"}) is None
    assert job_identity({"SLURM_JOB_ID": "42", "SLURM_JOB_USER": "a b"}) is None
    assert job_identity({"SLURM_JOB_ID": "42", "SLURM_JOB_USER": "alice", "SLURM_JOB_GPUS": "0;rm"})["gpus"] == []


def test_the_jobs_gpus_are_taken_by_index():
    assert job_counters(COUNTERS, [0, 2]) == {"GPU-a": 1000.0, "GPU-c": 3000.0}
    assert job_counters(COUNTERS, []) == {}


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
