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
