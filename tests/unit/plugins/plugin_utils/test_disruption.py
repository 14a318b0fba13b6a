"""The safety decisions: restart, reboot, job actions, and the one pending-item format."""

from __future__ import annotations

import pytest
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.disruption import (
    REASON_JOB_RUNS,
    REASON_NO_FACT,
    SLURM_NIGHTLY_REASON,
    disruption_allowed,
    job_action,
    may_disrupt,
    pending_add,
    pending_extend,
    reboot_decision,
    restart_decision,
    slurm_node_action,
)


@pytest.mark.parametrize(
    ("safe_mode", "force", "jobs", "expected"),
    [
        (False, False, ["budgetgpu-job-a.service"], True),
        (True, False, [], True),
        (True, False, ["budgetgpu-job-a.service"], False),
        (True, True, ["budgetgpu-job-a.service"], True),
        ("True", "False", ["j"], False),
        (None, False, ["j"], False),  # an unreadable safe mode counts as on
    ],
)
def test_disruption_allowed(safe_mode, force, jobs, expected):
    assert disruption_allowed(safe_mode, force, jobs) is expected


@pytest.mark.parametrize("absent", [None, "", "undefined", {}])
def test_a_missing_fact_never_allows_disruption(absent):
    assert may_disrupt(absent) == {"allowed": False, "reason": REASON_NO_FACT}


def test_restart_decision_every_branch():
    assert restart_decision(False, True)["action"] == "none"
    assert restart_decision(True, True)["action"] == "restart"
    assert restart_decision(True, "true")["action"] == "restart"
    assert restart_decision(True, False) == {"action": "defer", "reason": REASON_JOB_RUNS}
    assert restart_decision(True, None) == {"action": "defer", "reason": REASON_NO_FACT}


def test_reboot_decision_every_branch():
    assert reboot_decision(False, True, True) == {"action": "none", "reason": "none"}
    assert reboot_decision(True, True, True)["action"] == "reboot"
    assert reboot_decision(True, True, True, control_node=True) == {
        "action": "defer",
        "reason": "never rebooted: the control node",
    }
    assert reboot_decision(True, True, True, in_container=True)["reason"] == "a container runs its host kernel"
    assert reboot_decision(True, True, False) == {"action": "defer", "reason": REASON_JOB_RUNS}
    assert reboot_decision(True, True, None) == {"action": "defer", "reason": REASON_NO_FACT}
    assert reboot_decision(True, True, True, check_mode=True)["reason"] == "check mode"
    assert reboot_decision(True, False, True) == {"action": "defer", "reason": "nvidia_driver_reboot is false"}


def test_reboot_reasons_keep_their_order():
    # The reason users see names the first thing that holds the reboot back, as before.
    assert reboot_decision(True, False, False, control_node=True)["reason"] == "never rebooted: the control node"
    assert reboot_decision(True, False, False)["reason"] == REASON_JOB_RUNS


@pytest.mark.parametrize(
    ("want", "running", "changed", "finished", "on_change", "allowed", "action"),
    [
        ("stopped", True, True, False, True, True, "stopped"),
        ("absent", True, False, False, False, None, "absent"),
        ("restarted", True, False, False, False, False, "restart"),
        ("started", False, False, True, False, True, "completed"),
        ("started", True, False, False, True, True, "start"),
        ("started", False, True, False, True, True, "start"),
        ("started", True, True, False, False, True, "pending"),
        ("started", True, True, False, True, False, "pending"),
        ("started", True, True, False, True, None, "pending"),  # no fact: pending, not a restart
        ("started", True, True, False, True, True, "restart"),
    ],
)
def test_job_action_every_branch(want, running, changed, finished, on_change, allowed, action):
    assert job_action(want, running, changed, finished, on_change, allowed)["action"] == action


def test_a_job_pending_without_the_fact_says_why():
    assert REASON_NO_FACT in job_action("started", True, True, False, True, None)["reason"]


def test_pending_add_writes_one_format_once():
    items = pending_add(None, "container_runtime", "Docker daemon restart pending", "daemon.json changed")
    assert items == ["container_runtime: Docker daemon restart pending (daemon.json changed)"]
    assert pending_add(items, "container_runtime", "Docker daemon restart pending", "daemon.json changed") == items
    assert pending_add(items, "nvidia_driver", "reboot pending")[-1] == "nvidia_driver: reboot pending"


def test_pending_extend_adds_each_entry_in_the_same_format():
    items = pending_extend(["nvidia_driver: reboot pending"], "torchrun", [["restart pending: job a", "why a"], "x"])
    assert items == ["nvidia_driver: reboot pending", "torchrun: restart pending: job a (why a)", "torchrun: x"]


# --- Slurm jobs count as running jobs (slurm_node_action) --------------------------------------------


def test_slurm_nothing_to_apply_is_none():
    assert slurm_node_action(False, 3, True)["action"] == "none"


def test_slurm_jobs_running_defer_the_change_or_drain_first_when_asked():
    assert slurm_node_action(True, 2, True) == {"action": "defer", "reason": "2 Slurm job(s) run"}
    assert slurm_node_action(True, 2, True, drain_first=True)["action"] == "drain"


def test_slurm_jobs_unknown_count_as_running():
    assert slurm_node_action(True, None, True)["action"] == "defer"
    assert slurm_node_action(True, "?", True, drain_first=True)["action"] == "defer"


def test_slurm_idle_node_applies_unless_a_systemd_job_or_no_fact_forbids():
    assert slurm_node_action(True, 0, True)["action"] == "apply"
    assert slurm_node_action(True, "0", False)["action"] == "defer"
    assert slurm_node_action(True, 0, None)["action"] == "defer"


def test_slurm_node_the_nightly_run_drained_is_resumed_after_the_change():
    assert slurm_node_action(True, 0, True, True, SLURM_NIGHTLY_REASON)["action"] == "apply_and_resume"
    # A person's drain is theirs: the change applies, the node stays drained.
    assert slurm_node_action(True, 0, True, True, "disk replacement")["action"] == "apply"
