"""slurm_health: Slurm's health check drains a node whose GPU the watch holds out, with the GPU's bus id
and Xid in a reason of its own, resumes only nodes it drained, and changes nothing on a state it cannot
trust (missing, a link, writable by others, too large, not JSON)."""

from __future__ import annotations

import json
import os

import pytest
from ansible_collections.budgetgpu.cluster.plugins.module_utils.slurm_health import (
    MAX_STATE_BYTES,
    drain_reason,
    health_action,
    read_state,
)

OUT = {
    "gpus": {"GPU-a": {"bus_id": "0000:04:00.0"}, "GPU-b": {"bus_id": "0000:03:00.0"}},
    "quarantine": {
        "GPU-a": {
            "reason": "GPU 2 (0000:04:00.0): Xid 79, GPU has fallen off the bus: NVRM: Xid (PCI:0000:04:00): 79",
            "since": "2026-12-01T10:00:00Z",
            "by": "watch",
        }
    },
}
RELEASED = {**OUT, "quarantine": {}}
REASON = "budgetgpu: GPU 0000:04:00.0 Xid 79"


def test_the_reason_names_the_bus_id_and_the_xid():
    assert drain_reason(OUT) == REASON


def test_more_gpus_out_are_counted_and_a_listed_gpu_says_so():
    state = {
        **OUT,
        "quarantine": {**OUT["quarantine"], "GPU-b": {"reason": "listed in gpu_health_quarantine", "by": "inventory"}},
    }
    assert drain_reason(state) == "budgetgpu: GPU 0000:03:00.0 listed +1 more"
    assert drain_reason(RELEASED) is None
    assert drain_reason({"quarantine": "garbage"}) is None


def test_a_node_with_a_quarantined_gpu_is_drained():
    assert health_action(OUT, "idle", "") == {"action": "drain", "reason": REASON}
    assert health_action(OUT, "mixed", "")["action"] == "drain"


def test_a_node_already_drained_for_the_same_gpu_is_left():
    assert health_action(OUT, "drained", REASON)["action"] == "none"


def test_our_drain_for_another_gpu_gets_the_new_reason():
    assert health_action(OUT, "draining", "budgetgpu: GPU 0000:03:00.0 Xid 48") == {"action": "drain", "reason": REASON}


def test_a_persons_drain_is_never_touched():
    assert health_action(OUT, "drained", "disk replacement")["action"] == "none"
    assert health_action(RELEASED, "drained", "disk replacement")["action"] == "none"


def test_our_drain_is_resumed_once_the_gpu_is_released():
    assert health_action(RELEASED, "drained", REASON)["action"] == "resume"
    assert health_action(RELEASED, "idle", "")["action"] == "none"


def test_no_state_means_no_change():
    assert health_action(None, "drained", REASON)["action"] == "none"
    assert health_action(None, "idle", "")["action"] == "none"


def test_read_state_reads_the_watchs_file(tmp_path):
    path = tmp_path / "state.json"
    path.write_text(json.dumps(OUT))
    path.chmod(0o644)
    assert read_state(str(path)) == OUT


@pytest.mark.parametrize("kind", ["missing", "link", "others_write", "large", "not_json", "not_object", "directory"])
def test_read_state_refuses_what_it_cannot_trust(tmp_path, kind):
    path = tmp_path / "state.json"
    if kind == "link":
        target = tmp_path / "elsewhere.json"
        target.write_text(json.dumps(OUT))
        os.symlink(target, path)
    elif kind == "directory":
        path.mkdir()
    elif kind != "missing":
        text = {"large": " " * (MAX_STATE_BYTES + 1) + "{}", "not_json": "{", "not_object": "[1]"}.get(
            kind, json.dumps(OUT)
        )
        path.write_text(text)
        path.chmod(0o666 if kind == "others_write" else 0o644)
    assert read_state(str(path)) is None


def test_the_nightly_runs_drain_is_not_resumed_by_the_health_check():
    # plugin_utils/disruption.py's drain_reason (slurm_drain_for_changes): not the health check's to resume.
    nightly = "budgetgpu: pending nvidia_driver: reboot pending"
    assert health_action(RELEASED, "drained", nightly)["action"] == "none"
    assert health_action(OUT, "drained", nightly)["action"] == "none"
