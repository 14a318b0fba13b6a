"""The safety decisions: restart, reboot, job actions, and the one pending-item format."""

from __future__ import annotations

import pytest
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.disruption import (
    REASON_JOB_RUNS,
    REASON_NO_FACT,
    disruption_allowed,
    job_action,
    may_disrupt,
    pending_add,
    pending_extend,
    reboot_decision,
    restart_decision,
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
