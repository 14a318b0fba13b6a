# Copyright: budgetgpu maintainers
# Apache License 2.0 (see galaxy.yml)
# ruff: noqa: E402 (Ansible plugins import after DOCUMENTATION)
"""Aggregate callback: one JSON drift report per playbook run (what changed, failed, is pending)."""

from __future__ import annotations

DOCUMENTATION = r"""
name: drift_report
type: aggregate
short_description: Write a JSON drift report of a playbook run, per host
description:
  - Records, for every host, each task that reported C(changed) (task name, role, play, loop items, and
    the module's own C(drift) lines where it returns them),
    each failure that was not ignored (with its message), whether the host was unreachable, and the
    changes that safe mode held back (the fact C(budgetgpu_pending), see CONTRIBUTING.md "Safe mode").
  - Writes the report once, when the playbook ends, to the file named by I(output); nothing when unset.
  - C(scripts/nightly-reprovision) enables it and turns the report into the nightly summary.
version_added: 0.1.0
author: budgetgpu maintainers (!UNKNOWN)
requirements:
  - enable it in callbacks_enabled (ANSIBLE_CALLBACKS_ENABLED=budgetgpu.cluster.drift_report)
options:
  output:
    description: Path of the JSON report; written atomically (temporary file, then rename).
    type: path
    env:
      - name: BUDGETGPU_DRIFT_REPORT
    ini:
      - section: callback_drift_report
        key: output
"""

import json
import os
import tempfile
import time
from datetime import UTC, datetime
from typing import Any

from ansible.plugins.callback import CallbackBase

# Facts that roles set for the report (CONTRIBUTING.md, "Safe mode"); the last value seen wins,
# except for budgetgpu_pending: every playbook's probe resets it to [], so the report keeps every
# entry seen during the run.
REPORTED_FACTS = {
    "budgetgpu_jobs_active": "jobs_active",
    "budgetgpu_disruption_allowed": "disruption_allowed",
    # Role gpu_health: the GPUs out of service, {uuid: {reason, since, by}}.
    "budgetgpu_gpu_quarantine": "gpu_quarantine",
    # The provisioning summary: the GPUs' energy counters, the time and the price (energy.energy_reading);
    # the next nightly run compares its own with it (energy per day).
    "budgetgpu_energy_reading": "energy_reading",
}
PENDING_FACT = "budgetgpu_pending"
REPORT_FORMAT = 1
MESSAGE_LIMIT = 600


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def new_host_record() -> dict[str, Any]:
    return {
        "changed": [],
        "failed": [],
        "unreachable": None,
        "pending": [],
        "jobs_active": [],
        "disruption_allowed": None,
        "gpu_quarantine": {},
        "stats": {},
    }


def role_of(task: Any) -> str | None:
    role = getattr(task, "_role", None)
    return role.get_name(include_role_fqcn=False) if role is not None else None


def item_label(item_result: dict[str, Any]) -> str:
    label = item_result.get("_ansible_item_label", item_result.get("item"))
    return label if isinstance(label, str) else json.dumps(label, sort_keys=True, default=str)


def changed_items(result: dict[str, Any]) -> list[str]:
    """Loop items that changed (a loop task is changed when any item is)."""
    items = result.get("results")
    if not isinstance(items, list):
        return []
    return [item_label(item) for item in items if isinstance(item, dict) and item.get("changed")]


def failure_message(result: dict[str, Any]) -> str:
    """The reason a task failed or a host was unreachable; a loop's own reasons are in its items."""
    items = result.get("results") if isinstance(result.get("results"), list) else []
    bad = [item for item in items if isinstance(item, dict) and (item.get("failed") or item.get("unreachable"))]
    if bad:
        reasons = {failure_message(item) for item in bad}
        message = "; ".join(sorted(reasons)) if len(reasons) > 1 else reasons.pop()
    else:
        message = result.get("msg") or result.get("stderr") or result.get("reason") or ""
    message = " ".join(str(message).split())
    return message if len(message) <= MESSAGE_LIMIT else message[: MESSAGE_LIMIT - 3] + "..."


def facts_in(result: dict[str, Any]) -> list[dict[str, Any]]:
    """ansible_facts of a result and of its loop items, in order."""
    found = [result.get("ansible_facts")]
    if isinstance(result.get("results"), list):
        found += [item.get("ansible_facts") for item in result["results"] if isinstance(item, dict)]
    return [facts for facts in found if isinstance(facts, dict)]


def host_status(record: dict[str, Any]) -> str:
    if record["unreachable"]:
        return "unreachable"
    if record["failed"]:
        return "failed"
    if record["pending"]:
        return "pending"
    if record["changed"]:
        return "drift_fixed"
    return "ok"


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "budgetgpu.cluster.drift_report"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hosts: dict[str, dict[str, Any]] = {}
        self.playbook: str | None = None
        self.play: str | None = None
        self.started = now_iso()
        self.start_time = time.monotonic()

    def host(self, name: str) -> dict[str, Any]:
        return self.hosts.setdefault(name, new_host_record())

    def v2_playbook_on_start(self, playbook: Any) -> None:
        self.playbook = os.path.basename(getattr(playbook, "_file_name", "") or "")
        self.started = now_iso()
        self.start_time = time.monotonic()

    def v2_playbook_on_play_start(self, play: Any) -> None:
        self.play = play.get_name().strip()

    def record_facts(self, host: str, result: dict[str, Any]) -> None:
        record = self.host(host)
        for facts in facts_in(result):
            for fact, key in REPORTED_FACTS.items():
                if fact in facts:
                    record[key] = facts[fact]
            pending = facts.get(PENDING_FACT)
            if isinstance(pending, list):
                record["pending"] += [str(entry) for entry in pending if str(entry) not in record["pending"]]

    def v2_runner_on_ok(self, result: Any) -> None:
        host, task, data = result.host.get_name(), result.task, result.result
        self.record_facts(host, data)
        if not data.get("changed"):
            return
        entry = {
            "task": result.task_name,
            "role": role_of(task),
            "play": self.play,
            "action": task.action,
            "handler": type(task).__name__ == "Handler",
        }
        items = changed_items(data)
        if items:
            entry["items"] = items
        # What a module corrected, in its own words (gpu_power_limits: a line per GPU whose limit drifted).
        if isinstance(data.get("drift"), list) and data["drift"]:
            entry["drift"] = [str(line) for line in data["drift"]]
        self.host(host)["changed"].append(entry)

    def v2_runner_on_failed(self, result: Any, ignore_errors: bool = False) -> None:
        if ignore_errors:
            return
        self.host(result.host.get_name())["failed"].append(
            {
                "task": result.task_name,
                "role": role_of(result.task),
                "play": self.play,
                "action": result.task.action,
                "msg": failure_message(result.result),
            }
        )

    def v2_runner_on_unreachable(self, result: Any) -> None:
        self.host(result.host.get_name())["unreachable"] = {
            "task": result.task_name,
            "msg": failure_message(result.result),
        }

    def v2_playbook_on_stats(self, stats: Any) -> None:
        for name in sorted(stats.processed):
            record = self.host(name)
            record["stats"] = stats.summarize(name)
        for record in self.hosts.values():
            record["status"] = host_status(record)
        path = self.get_option("output")
        if not path:
            return
        report = {
            "format": REPORT_FORMAT,
            "playbook": self.playbook,
            "started": self.started,
            "finished": now_iso(),
            "duration_s": round(time.monotonic() - self.start_time, 1),
            "hosts": dict(sorted(self.hosts.items())),
        }
        write_atomically(path, json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")


def write_atomically(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=".drift-report.")
    try:
        with os.fdopen(handle, "w") as stream:
            stream.write(text)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
