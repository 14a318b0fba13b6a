"""Safe mode's view of the node's work: which training job units count as running, and which Slurm
jobs run on the node.

Pure functions of `systemctl list-units --all --no-legend --plain 'budgetgpu-job*'` output and of
`scontrol listpids`' result; no I/O. The probe role turns the answers into ``budgetgpu_jobs_active``
and ``budgetgpu_disruption_allowed`` (CONTRIBUTING.md, "Safe mode").
"""

from __future__ import annotations

from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.module_utils.job_metrics import unit_running

# What `scontrol listpids` says, exiting 1, on a node without a job step.
NO_STEPS = "No job steps exist on this node."


def _unit_row(line: str) -> list[str]:
    """UNIT LOAD ACTIVE SUB, without the marker systemctl puts before failed or not-found units."""
    words = str(line).split()
    while words and "." not in words[0]:
        words = words[1:]
    return words


def probe_running_jobs(lines: list[str] | None) -> list[str]:
    """Return the units of list-units lines (UNIT LOAD ACTIVE SUB ...) that count as a running job."""
    running = []
    for line in lines or []:
        row = _unit_row(line)
        if len(row) >= 4 and unit_running(row[2]):
            running.append(row[0])
    return running


def probe_slurm_jobs(result: dict[str, Any] | None) -> list[str]:
    """Return "slurm job ID" for each Slurm job with a step on the node, from the result of
    `scontrol listpids` (PID JOBID STEPID LOCALID GLOBALID), which reads the node's own slurmstepd
    sockets: it answers while slurmd or slurmctld is down, as the jobs go on. rc 0 and no output: no
    Slurm here; rc 1 with "No job steps exist on this node." (Slurm 22.05 to 24.11): no job. Any other
    failure counts as a running job: nothing may disrupt jobs nobody can see."""
    result = result or {}
    if result.get("rc") == 1 and NO_STEPS in str(result.get("stderr") or ""):
        return []
    if result.get("rc") != 0:
        said = (str(result.get("stderr") or result.get("msg") or "").strip().splitlines() or ["no answer"])[0]
        return [f"slurm jobs unknown (scontrol listpids exited {result.get('rc')}: {said})"]
    jobs = []
    for line in str(result.get("stdout") or "").splitlines()[1:]:
        words = line.split()
        if len(words) >= 2 and words[1].isdigit() and f"slurm job {words[1]}" not in jobs:
            jobs.append(f"slurm job {words[1]}")
    return jobs


class FilterModule:
    """budgetgpu probe filters."""

    def filters(self) -> dict[str, Any]:
        return {"probe_running_jobs": probe_running_jobs, "probe_slurm_jobs": probe_slurm_jobs}
