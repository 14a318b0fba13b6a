"""A Slurm job's GPU energy without slurmdbd (role slurm's Prolog and Epilog, run by slurmd as root):
the NVML energy counters of the job's GPUs at its start and end, and the joules between them.

Plain Python, stdlib only: installed on the nodes beside budgetgpu-slurm-energy."""

from __future__ import annotations

import json
import os
import re
from typing import Any

# slurmd's SLURM_JOB_GPUS: the job's GPU indices on this node ("0,2"); nothing else is read from the job.
_INDICES = re.compile(r"^\d+(,\d+)*$")
_JOB_ID = re.compile(r"^\d+$")
_USER = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def job_identity(env: dict[str, str]) -> dict[str, Any] | None:
    """Return {job, user, gpus [index]} from slurmd's Prolog/Epilog environment, or None where the job id
    or user is not what slurmd gives (nothing is recorded then)."""
    job, user = env.get("SLURM_JOB_ID", ""), env.get("SLURM_JOB_USER", "")
    if not _JOB_ID.match(job) or not _USER.match(user):
        return None
    gpus = env.get("SLURM_JOB_GPUS", "")
    return {"job": job, "user": user, "gpus": [int(i) for i in gpus.split(",")] if _INDICES.match(gpus) else []}


def job_counters(counters: dict[str, float], gpus: list[int]) -> dict[str, float]:
    """Return {uuid: joules} of the job's GPUs: counters holds every GPU's, in NVML index order
    (nvml_probe.energy_counters), and Slurm's indices are the same order (gres.conf lists /dev/nvidiaN)."""
    ordered = list(counters.items())
    return {uuid: joules for index, (uuid, joules) in enumerate(ordered) if index in gpus}


def job_energy(start: dict[str, Any], end_counters: dict[str, float], end_time: float) -> dict[str, Any]:
    """Return the job's record at its end: {job, user, gpus, start, end, seconds, joules {uuid}, kwh}. A GPU
    whose counter went back (a driver reload) or is missing at one end counts for nothing."""
    before = start.get("counters") or {}
    joules = {
        uuid: round(end_counters[uuid] - before[uuid], 3)
        for uuid in before
        if uuid in end_counters and end_counters[uuid] >= before[uuid]
    }
    return {
        **{key: start.get(key) for key in ("job", "user", "gpus")},
        "start": start.get("time"),
        "end": end_time,
        "seconds": round(end_time - float(start.get("time") or end_time), 3),
        "joules": joules,
        "kwh": round(sum(joules.values()) / 3.6e6, 6),
    }


# Where the Prolog and Epilog keep each job's record (root's, 0755; each record 0644).
JOBS_DIR = "/var/lib/budgetgpu/slurm-jobs"
# A record is a few hundred bytes; anything larger is not the epilog's.
MAX_RECORD_BYTES = 64 * 1024
_RECORD_NAME = re.compile(r"^\d+\.json$")


def read_records(directory: str, since: float) -> list[dict[str, Any]]:
    """Return the end records (with kwh) of the jobs that ended at or after since, from the epilog's
    directory: root's, but read as if it were not (no links followed, each file bounded)."""
    records = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    for name in (n for n in names if _RECORD_NAME.match(n)):
        try:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        with os.fdopen(fd, "rb") as handle:
            data = handle.read(MAX_RECORD_BYTES + 1)
        try:
            record = json.loads(data) if len(data) <= MAX_RECORD_BYTES else None
        except ValueError:
            record = None
        if isinstance(record, dict) and "kwh" in record and float(record.get("end") or 0) >= since:
            records.append(record)
    return records


if __name__ == "__main__":
    # playbooks/slurm_report.yml runs this file on each Slurm node: argv SINCE; prints the records.
    import sys

    sys.stdout.write(json.dumps(read_records(JOBS_DIR, float(sys.argv[1]))) + "\n")
