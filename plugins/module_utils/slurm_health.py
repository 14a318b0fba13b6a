"""Slurm's health check on a GPU node (role slurm's HealthCheckProgram, run by slurmd as root): whether to
drain the node, resume it or leave it, from the health watch's state (role gpu_health writes it; the
watch has no network, so Slurm's own program reads it) and the node's state and reason in Slurm.

Plain Python, stdlib only: installed on the nodes beside budgetgpu-slurm-health."""

from __future__ import annotations

import json
import os
import re
import stat
from typing import Any

# Every reason this check sets starts so; it resumes only such nodes: never a person's drain, nor the
# nightly run's ("budgetgpu: pending ...", plugin_utils/disruption.py slurm_drain_action).
REASON_PREFIX = "budgetgpu: GPU "
# The watch's state is a few KiB: a larger file is not the watch's.
MAX_STATE_BYTES = 1 << 20
_XID = re.compile(r"\bXid (\d+)")
# Slurm keeps a reason to what a shell and its log show plainly.
_UNSAFE = re.compile(r"[^A-Za-z0-9 .,:_/()+-]")


def safe_reason(text: str) -> str:
    """Return text without the characters a Slurm reason should not hold (sinfo's | separated output, a shell)."""
    return _UNSAFE.sub("", text)


def read_state(path: str) -> dict[str, Any] | None:
    """Return the watch's state, or None where it cannot be trusted: missing, a link, not a regular file,
    writable by others than its owner, too large, or not a JSON object. The watch's user may write its
    directory: the file is opened without following links and read bounded."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_mode & 0o022 or info.st_size > MAX_STATE_BYTES:
            return None
        data = os.read(fd, MAX_STATE_BYTES + 1)
    finally:
        os.close(fd)
    try:
        state = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def _bus_id(state: dict[str, Any], uuid: str) -> str:
    entry = (state.get("gpus") or {}).get(uuid)
    bus_id = entry.get("bus_id") if isinstance(entry, dict) else None
    return str(bus_id) if bus_id else uuid


def drain_reason(state: dict[str, Any]) -> str | None:
    """Return the reason to drain with ("budgetgpu: GPU 0000:04:00.0 Xid 79", then "+N more" when more GPUs
    are out), or None when the watch holds no GPU out."""
    out = state.get("quarantine")
    if not isinstance(out, dict) or not out:
        return None
    words = []
    for uuid in sorted(out, key=lambda u: _bus_id(state, str(u))):
        why = out[uuid] if isinstance(out[uuid], dict) else {}
        xid = _XID.search(str(why.get("reason") or ""))
        cause = f"Xid {xid.group(1)}" if xid else ("quarantined" if why.get("by") != "inventory" else "listed")
        words.append(f"GPU {_bus_id(state, str(uuid))} {cause}")
    more = f" +{len(words) - 1} more" if len(words) > 1 else ""
    return safe_reason(f"budgetgpu: {words[0]}{more}")


def health_action(state: dict[str, Any] | None, node_state: str, node_reason: str) -> dict[str, str]:
    """Return {action: drain|resume|none, reason}: drain a node with a quarantined GPU (a new reason where
    ours changed), resume a node this check drained once no GPU is out, leave everything else (a person's
    drain, a state that cannot be read: no evidence means no change)."""
    if state is None:
        return {"action": "none", "reason": "the health watch's state is missing or unreadable: no change"}
    drained = "DRAIN" in node_state.upper()
    ours = node_reason.startswith(REASON_PREFIX)
    wanted = drain_reason(state)
    if wanted:
        if drained and not ours:
            return {"action": "none", "reason": f"drained by someone else ({node_reason}): theirs to resume"}
        if drained and node_reason == wanted:
            return {"action": "none", "reason": f"already drained: {wanted}"}
        return {"action": "drain", "reason": wanted}
    if drained and ours:
        return {"action": "resume", "reason": f"no GPU is quarantined any more (was: {node_reason})"}
    return {"action": "none", "reason": "no GPU is quarantined"}
