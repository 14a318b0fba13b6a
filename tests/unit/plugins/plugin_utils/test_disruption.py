"""The safety decisions: restart, reboot, job actions, and the one pending-item format."""

from __future__ import annotations

import pytest
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.disruption import (
    DRAIN_PREFIX,
    REASON_JOB_RUNS,
    REASON_NO_FACT,
    disruption_allowed,
    drain_reason,
    job_action,
    may_disrupt,
    pending_add,
    pending_extend,
    reboot_decision,
    restart_decision,
    slurm_drain_action,
    waiting_for_jobs,
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


# slurm_drain_action: a node's pending items as the roles write them (pending_add), the probe's jobs.
REBOOT = f"nvidia_driver: reboot pending (installed 550.1, loaded 535.2 (loaded); {REASON_JOB_RUNS})"
SLURMD = f"slurm: slurmd restart pending: gres.conf changed ({REASON_JOB_RUNS})"
NOT_ALLOWED = "nvidia_driver: reboot pending (installed 550.1, loaded 535.2 (loaded); nvidia_driver_reboot is false)"
SLURM_JOBS = ["slurm job 41"]
OURS = "budgetgpu: pending nvidia_driver: reboot pending"


def test_only_changes_deferred_for_running_jobs_wait_for_them():
    assert waiting_for_jobs([REBOOT, NOT_ALLOWED, SLURMD]) == [REBOOT, SLURMD]
    assert waiting_for_jobs(None) == []


def test_the_drain_reason_names_the_first_change_and_counts_the_rest():
    assert drain_reason([REBOOT]) == OURS
    assert drain_reason([REBOOT, SLURMD]) == OURS + " +1 more"
    # What a Slurm reason should not hold (sinfo's | separator, a shell's quotes) is left out.
    assert drain_reason([f"nvidia_driver: branch 535|550 'x' pending ({REASON_JOB_RUNS})"]) == (
        "budgetgpu: pending nvidia_driver: branch 535550 x pending"
    )


def test_a_node_with_slurm_jobs_and_a_waiting_change_is_drained_in_the_opt_in_mode():
    decision = slurm_drain_action(True, [REBOOT], SLURM_JOBS, "mixed", "none")
    assert decision == {"action": "drain", "reason": OURS}
    assert decision["reason"].startswith(DRAIN_PREFIX)


def test_without_the_opt_in_the_change_waits_and_nothing_is_drained():
    decision = slurm_drain_action(False, [REBOOT], SLURM_JOBS, "allocated", "none")
    assert decision["action"] == "defer" and "slurm_drain_for_changes is off" in decision["reason"]


@pytest.mark.parametrize("state", ["draining", "drained", "drained*"])
def test_a_persons_drain_is_never_touched(state):
    decision = slurm_drain_action(True, [REBOOT], SLURM_JOBS, state, "disk replacement")
    assert decision["action"] == "defer" and "disk replacement" in decision["reason"]
    # Nor resumed once nothing waits.
    assert slurm_drain_action(True, [], [], state, "disk replacement")["action"] == "none"
    # Nor the health check's.
    assert slurm_drain_action(True, [], [], state, "budgetgpu: GPU 0000:03:00.0 Xid 79")["action"] == "none"


def test_our_drain_waits_while_the_nodes_jobs_run():
    decision = slurm_drain_action(True, [REBOOT], SLURM_JOBS, "draining", OURS)
    assert decision["action"] == "defer" and "slurm job 41" in decision["reason"]


def test_our_drain_names_the_changes_anew_when_they_changed():
    assert slurm_drain_action(True, [SLURMD, REBOOT], SLURM_JOBS, "draining", OURS) == {
        "action": "drain",
        "reason": "budgetgpu: pending slurm: slurmd restart pending: gres.conf changed +1 more",
    }


def test_a_node_idle_under_our_drain_lets_the_next_run_apply():
    # The jobs ended during this run (after the probe): the drain holds new jobs off until the next run.
    assert slurm_drain_action(True, [REBOOT], SLURM_JOBS, "drained", OURS)["action"] == "apply"


def test_an_idle_node_with_waiting_changes_is_drained_for_the_next_run():
    assert slurm_drain_action(True, [REBOOT], [], "idle", "none") == {"action": "drain", "reason": OURS}


@pytest.mark.parametrize("state", ["drained", "draining", "idle+drain"])
def test_our_drain_is_resumed_once_nothing_waits(state):
    # The run found the node idle, so the driver, reboot or slurmd restart applied: nothing is pending.
    decision = slurm_drain_action(True, [NOT_ALLOWED], [], state, OURS)
    assert decision["action"] == "resume" and OURS in decision["reason"]


def test_our_drain_is_lifted_when_the_mode_is_turned_off():
    decision = slurm_drain_action(False, [REBOOT], SLURM_JOBS, "draining", OURS)
    assert decision["action"] == "resume" and "slurm_drain_for_changes is off" in decision["reason"]


def test_job_units_outside_slurm_keep_the_node_undrained():
    jobs = ["budgetgpu-job-a.service", *SLURM_JOBS]
    decision = slurm_drain_action(True, [REBOOT], jobs, "mixed", "none")
    assert decision["action"] == "defer" and "budgetgpu-job-a.service" in decision["reason"]
    assert slurm_drain_action(True, [REBOOT], jobs, "draining", OURS)["action"] == "resume"


def test_unknown_slurm_jobs_count_as_slurms():
    jobs = ["slurm jobs unknown (scontrol listpids exited 2: error)"]
    assert slurm_drain_action(True, [REBOOT], jobs, "mixed", "none")["action"] == "drain"


def test_nothing_waits_nothing_happens():
    assert slurm_drain_action(True, [NOT_ALLOWED], SLURM_JOBS, "mixed", "none")["action"] == "none"
    assert slurm_drain_action(True, None, None, "idle", "")["action"] == "none"


@pytest.mark.parametrize("state", ["", None])
def test_no_answer_from_slurmctld_changes_nothing(state):
    assert slurm_drain_action(True, [REBOOT], SLURM_JOBS, state, "")["action"] == "defer"
    assert slurm_drain_action(True, [], [], state, OURS)["action"] == "defer"
