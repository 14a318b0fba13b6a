"""The safety decisions: may this run interrupt a node's work (restart Docker or a job, rebuild
the venv, change or reboot into a driver), and how deferred work is recorded.

The probe role sets budgetgpu_disruption_allowed (CONTRIBUTING.md, "Safe mode"). Every decision
here treats a missing or unreadable fact as "do not disrupt": a role run without the probe
defers, it never goes ahead blindly. Each decision returns {"action": ..., "reason": ...} so that
the role can act on the action and print the reason.

Pending items (the budgetgpu_pending list the provision summary and the drift report print) all
have one form, written by pending_add: "<role>: <what> (<why>)".
"""

from __future__ import annotations

from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.module_utils.slurm_health import safe_reason

REASON_NO_FACT = (
    "budgetgpu_disruption_allowed is not set (the probe role did not run): nothing is interrupted without it"
)
REASON_JOB_RUNS = "a job runs and safe mode is on"
REASON_ALLOWED = "no job runs, or safe mode is off"


def _flag(value: Any) -> bool | None:
    """Return a fact's truth (bools, Ansible's "true"/"yes"/"1" strings); None when absent or unreadable."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower() if value is not None else ""
    if text in ("true", "yes", "on", "1"):
        return True
    if text in ("false", "no", "off", "0"):
        return False
    return None


def disruption_allowed(safe_mode: Any, force: Any, jobs_active: Any) -> bool:
    """Return the probe's budgetgpu_disruption_allowed: False only in safe mode, unforced, with a job running.
    An unreadable safe_mode counts as on."""
    if _flag(force):
        return True
    if _flag(safe_mode) is False:
        return True
    return not jobs_active


def may_disrupt(allowed: Any) -> dict[str, Any]:
    """Return {"allowed": bool, "reason"} for the budgetgpu_disruption_allowed fact; absent means not allowed."""
    flag = _flag(allowed)
    if flag is None:
        return {"allowed": False, "reason": REASON_NO_FACT}
    return {"allowed": flag, "reason": REASON_ALLOWED if flag else REASON_JOB_RUNS}


def restart_decision(needed: Any, allowed: Any) -> dict[str, str]:
    """Whether to do a disruptive change now (Docker restart, venv rebuild, driver branch change).

    Returns action "none" (nothing to do), "restart" (do it now) or "defer" (record it as pending)."""
    if not _flag(needed):
        return {"action": "none", "reason": "nothing to apply"}
    verdict = may_disrupt(allowed)
    return {"action": "restart" if verdict["allowed"] else "defer", "reason": verdict["reason"]}


def reboot_decision(
    pending: Any,
    enabled: Any,
    allowed: Any,
    control_node: Any = False,
    in_container: Any = False,
    check_mode: Any = False,
) -> dict[str, str]:
    """Whether to reboot a node into its installed driver: action "none", "reboot" or "defer"."""
    if not _flag(pending):
        return {"action": "none", "reason": "none"}
    verdict = may_disrupt(allowed)
    reasons = (
        (_flag(control_node), "never rebooted: the control node"),
        (_flag(in_container), "a container runs its host kernel"),
        (not verdict["allowed"], verdict["reason"]),
        (_flag(check_mode), "check mode"),
        (not _flag(enabled), "nvidia_driver_reboot is false"),
    )
    for applies, reason in reasons:
        if applies:
            return {"action": "defer", "reason": reason}
    return {"action": "reboot", "reason": "the installed driver is not the loaded one"}


def job_action(
    want: str, running: Any, changed: Any, finished: Any, restart_on_change: Any, allowed: Any
) -> dict[str, str]:
    """What to do with one training job: "stopped", "absent", "restart", "completed", "pending" or "start".

    want is the job's wanted state (started, stopped, absent, restarted). A running job whose
    inputs changed restarts only when torchrun_restart_on_change is on and disruption is allowed;
    else its restart is pending."""
    if want in ("stopped", "absent"):
        return {"action": want, "reason": f"the job's state is {want}"}
    if want == "restarted":
        return {"action": "restart", "reason": "a restart was asked for"}
    if _flag(finished):
        return {"action": "completed", "reason": "torchrun ended 0: the job is not started again"}
    if not (_flag(running) and _flag(changed)):
        return {"action": "start", "reason": "the job runs on, or starts"}
    if not _flag(restart_on_change):
        return {"action": "pending", "reason": "inputs changed and torchrun_restart_on_change is false"}
    verdict = may_disrupt(allowed)
    if not verdict["allowed"]:
        return {"action": "pending", "reason": f"inputs changed; {verdict['reason']}"}
    return {"action": "restart", "reason": "inputs changed"}


# The reason the nightly run drains a Slurm node under (slurm_drain_for_changes); it resumes only nodes
# drained so. The health check (module_utils/slurm_health.py) resumes only its "budgetgpu: GPU ..." drains.
DRAIN_PREFIX = "budgetgpu: pending "
# How probe_slurm_jobs names a Slurm job in budgetgpu_jobs_active ("slurm job 41", "slurm jobs unknown (...)").
SLURM_JOB_PREFIX = "slurm job"


def waiting_for_jobs(pending: Any) -> list[str]:
    """Return the budgetgpu_pending items deferred because a job runs (their why holds REASON_JOB_RUNS):
    the changes a drained, idle node would let apply."""
    return [str(item) for item in (pending or []) if REASON_JOB_RUNS in str(item)]


def drain_reason(waiting: list[str]) -> str:
    """Return the Slurm reason naming the first waiting change ("budgetgpu: pending nvidia_driver: reboot
    pending +1 more"): "<role>: <what>" of its pending item, without the why."""
    more = f" +{len(waiting) - 1} more" if len(waiting) > 1 else ""
    return safe_reason(f"{DRAIN_PREFIX}{waiting[0].split(' (')[0]}{more}")


def _held_by_others(jobs_active: Any) -> list[str]:
    """The running work Slurm does not schedule (job units): a drain would not free the node of it."""
    return [str(job) for job in (jobs_active or []) if not str(job).startswith(SLURM_JOB_PREFIX)]


def slurm_drain_action(
    enabled: Any, pending: Any, jobs_active: Any, node_state: Any, node_reason: Any
) -> dict[str, str]:
    """What the run does with a Slurm node whose changes wait for its jobs: action "none", "defer" (they
    wait, reported pending), "drain" (opt-in: no new job lands there; the changes apply on a run that
    finds it idle), "apply" (drained by us and idle: the next run applies them) or "resume" (drained by us
    and nothing waits any more: the changes applied, or the mode is off).

    enabled is slurm_drain_for_changes; pending is budgetgpu_pending of this run; jobs_active is the
    probe's budgetgpu_jobs_active; node_state and node_reason are sinfo's %T and %E for the node (empty
    when slurmctld did not answer). Only a drain whose reason starts with DRAIN_PREFIX is ours to resume
    or replace: a person's drain is never touched."""
    state, reason = str(node_state or "").lower(), str(node_reason or "")
    if not state:
        return {"action": "defer", "reason": "slurmctld did not say the node's state: no change"}
    ours = "drain" in state and reason.startswith(DRAIN_PREFIX)
    waiting = waiting_for_jobs(pending)
    others = _held_by_others(jobs_active)
    if ours and not waiting:
        return {"action": "resume", "reason": f"no change waits for the node's jobs any more (was: {reason})"}
    if ours and not _flag(enabled):
        return {"action": "resume", "reason": "slurm_drain_for_changes is off: budgetgpu's drain is lifted"}
    if ours and others:
        return {"action": "resume", "reason": f"{', '.join(others)} run outside Slurm: a drain would not free the node"}
    if not waiting:
        return {"action": "none", "reason": "no change waits for the node's jobs"}
    if not _flag(enabled):
        return {"action": "defer", "reason": "changes wait for the node's jobs; slurm_drain_for_changes is off"}
    if "drain" in state and not ours:
        return {"action": "defer", "reason": f"drained by someone else ({reason}): theirs to resume; changes wait"}
    if others:
        return {"action": "defer", "reason": f"{', '.join(others)} run outside Slurm: a drain would not free the node"}
    return _drain_or_wait(state, reason, drain_reason(waiting), jobs_active)


def _drain_or_wait(state: str, reason: str, wanted: str, jobs_active: Any) -> dict[str, str]:
    """A node with waiting changes, the mode on, no person's drain and only Slurm's jobs: drain it (or name
    the changes anew), wait while its jobs end, and once idle under our drain let the next run apply."""
    if state.startswith("drained"):
        return {"action": "apply", "reason": f"drained and idle ({reason}): the next run applies the changes"}
    if "drain" in state and reason == wanted:
        jobs = ", ".join(str(job) for job in jobs_active or []) or "its jobs"
        return {"action": "defer", "reason": f"draining ({reason}): the changes apply once {jobs} end"}
    return {"action": "drain", "reason": wanted}


def pending_add(pending: Any, role: str, what: str, why: str = "") -> list[str]:
    """Return the budgetgpu_pending list with one item "<role>: <what> (<why>)" added once."""
    items = [str(item) for item in (pending or [])]
    item = f"{role}: {what}" + (f" ({why})" if why else "")
    return items if item in items else [*items, item]


def pending_extend(pending: Any, role: str, entries: Any) -> list[str]:
    """Return the budgetgpu_pending list with pending_add applied to each [what, why] of entries."""
    items = [str(item) for item in (pending or [])]
    for entry in entries or []:
        what, why = (entry, "") if isinstance(entry, str) else (entry[0], entry[1] if len(entry) > 1 else "")
        items = pending_add(items, role, what, why)
    return items
