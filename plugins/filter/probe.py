"""Safe mode's view of the node's work: which training job units count as running.

Pure functions of `systemctl list-units --all --no-legend --plain 'budgetgpu-job*'` output; no I/O.
The probe role turns the answer into ``budgetgpu_jobs_active`` and ``budgetgpu_disruption_allowed``
(CONTRIBUTING.md, "Safe mode").
"""

from __future__ import annotations

from typing import Any

# ActiveState values of a unit whose job is alive or about to be. "activating" covers a unit that
# systemd restarts after a failure (SubState auto-restart, auto-restart-queued): between two
# restarts it has no process, but it is a job that a Docker or driver restart would disrupt when it
# comes back. "deactivating" is a job saving its checkpoint on the way out. Only inactive, failed
# and maintenance units are not running.
RUNNING_STATES = ("active", "reloading", "refreshing", "activating", "deactivating")


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
        if len(row) >= 4 and row[2] in RUNNING_STATES:
            running.append(row[0])
    return running


class FilterModule:
    """budgetgpu probe filters."""

    def filters(self) -> dict[str, Any]:
        return {"probe_running_jobs": probe_running_jobs}
