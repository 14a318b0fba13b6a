"""Unit tests for the probe filter that tells safe mode which job units count as running."""

from __future__ import annotations

import pytest
from ansible_collections.budgetgpu.cluster.plugins.filter import probe

# `systemctl list-units --all --no-legend --plain 'budgetgpu-job*'` on systemd 252 (Debian 12).
LISTING = [
    "budgetgpu-job-pretrain.service loaded active running budgetgpu-job-pretrain.service",
    "budgetgpu-job-flaky.service loaded activating auto-restart budgetgpu-job-flaky.service",
    "budgetgpu-job-done.service loaded inactive dead budgetgpu-job-done.service",
    "● budgetgpu-job-broken.service loaded failed failed budgetgpu-job-broken.service",
    "budgetgpu-job-gone.service not-found inactive dead budgetgpu-job-gone.service",
]


def test_a_unit_between_restarts_counts_as_running() -> None:
    assert probe.probe_running_jobs(LISTING) == ["budgetgpu-job-pretrain.service", "budgetgpu-job-flaky.service"]


@pytest.mark.parametrize(
    ("active", "sub"),
    [
        ("active", "running"),
        ("reloading", "reload"),
        ("activating", "start"),
        ("activating", "auto-restart"),
        ("activating", "auto-restart-queued"),
        ("deactivating", "stop-sigterm"),
    ],
)
def test_states_that_count_as_a_running_job(active: str, sub: str) -> None:
    assert probe.probe_running_jobs([f"budgetgpu-job-a.service loaded {active} {sub} a job"]) == [
        "budgetgpu-job-a.service"
    ]


@pytest.mark.parametrize(("active", "sub"), [("inactive", "dead"), ("failed", "failed"), ("maintenance", "x")])
def test_states_that_do_not(active: str, sub: str) -> None:
    assert probe.probe_running_jobs([f"budgetgpu-job-a.service loaded {active} {sub} a job"]) == []


def test_nothing_listed_is_no_job() -> None:
    assert probe.probe_running_jobs([]) == []
    assert probe.probe_running_jobs(None) == []


# `scontrol listpids` on a node of Slurm 22.05 (Debian 12): job 42's batch step and its first srun
# step, and job 43's batch step.
LISTPIDS = """PID      JOBID    STEPID   LOCALID GLOBALID
4180     42       batch    0       0
4203     42       0        0       0
4220     43       batch    0       0
"""


def test_each_slurm_job_on_the_node_counts_once() -> None:
    result = {"rc": 0, "stdout": LISTPIDS, "stderr": ""}
    assert probe.probe_slurm_jobs(result) == ["slurm job 42", "slurm job 43"]


def test_no_slurm_and_no_slurm_job_are_no_job() -> None:
    assert probe.probe_slurm_jobs({"rc": 0, "stdout": "", "stderr": ""}) == []
    # Slurm 22.05 on a node without a job step: the header, and exit 1 (found in the slurm scenario).
    idle = {"rc": 1, "stdout": LISTPIDS.splitlines()[0] + "\n", "stderr": "No job steps exist on this node.\n"}
    assert probe.probe_slurm_jobs(idle) == []


def test_a_failed_listing_counts_as_a_job_nobody_may_disrupt() -> None:
    result = {"rc": 1, "stdout": "", "stderr": "slurm_load_slurmd_status: Connection refused\nmore\n"}
    assert probe.probe_slurm_jobs(result) == [
        "slurm jobs unknown (scontrol listpids exited 1: slurm_load_slurmd_status: Connection refused)"
    ]
