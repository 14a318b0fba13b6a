"""Whether a node's clock is in step with the control node's: munge's credentials die at 300 s of skew,
Slurm and TLS refuse sooner or later, and logs and alerts of different nodes stop lining up. Preflight
refuses more than SKEW_LIMIT_S. Controller side, pure."""

from __future__ import annotations

from typing import Any

# Preflight's limit (roles/preflight/tasks/clock.yml): well inside munge's 300 s.
SKEW_LIMIT_S = 60.0


def _seconds(value: Any, what: str, host: str) -> float:
    try:
        return float(str(value).strip())
    except ValueError:
        raise ValueError(f"{host}: {what}: found {value!r}, expected seconds since the epoch") from None


def clock_skew(node: Any, before: Any, after: Any, host: str = "node") -> float:
    """Return how many seconds the node's clock (`node`, read between the control node's `before` and
    `after`, all seconds since the epoch) is ahead (positive) or behind (negative) the control node's;
    0 when it lies inside that window (the read's own delay is never counted as skew)."""
    read, start, end = (_seconds(v, w, host) for v, w in ((node, "node clock"), (before, "before"), (after, "after")))
    if end < start:
        raise ValueError(f"{host}: the control node's clock went back during the read ({start} then {end})")
    if read > end:
        return read - end
    if read < start:
        return read - start
    return 0.0


def clock_skew_problems(host: str, node: Any, before: Any, after: Any, limit: float = SKEW_LIMIT_S) -> list[str]:
    """Return [] when the node's clock is within `limit` seconds of the control node's, else the one
    problem, naming the host, the skew and what to do."""
    skew = clock_skew(node, before, after, host)
    if abs(skew) <= float(limit):
        return []
    side = "ahead of" if skew > 0 else "behind"
    return [
        f"{host}: clock is {abs(skew):.0f} s {side} the control node's, expected at most {float(limit):.0f} s of "
        "skew (munge refuses at 300 s): set budgetgpu_ntp_servers and run playbooks/provision.yml --tags clock, "
        "or set the clock (timedatectl set-time / chronyc makestep), then run again"
    ]
