"""Slurm's health check (run by slurmd itself, every 5 s here): a GPU the health watch holds out drains
its node with the GPU's bus id and Xid, release resumes it, and a person's drain is never resumed. The
watch's state file is written here in the watch's format (role gpu_health is not part of this scenario)."""

from __future__ import annotations

import json
import time

import testinfra

CONTROLLER, NODE = "slurm-controller", "slurm-node1"
STATE = "/var/lib/budgetgpu/gpu-health/state.json"
GPU = {"GPU-30900000-5a1e-4c0d-9b7e-000000000002": {"bus_id": "0000:03:00.0", "label": "GPU 2 (0000:03:00.0)"}}
XID = "GPU 2 (0000:03:00.0): Xid 79, GPU has fallen off the bus: NVRM: Xid (PCI:0000:03:00): 79, pid=1234"


def host(name: str) -> testinfra.host.Host:
    return testinfra.get_host(f"docker://{name}")


def write_state(quarantine: dict) -> None:
    state = json.dumps({"gpus": GPU, "quarantine": quarantine, "updated": "2026-12-01T12:00:00Z"})
    host(NODE).check_output(
        f"install -d -m 0755 /var/lib/budgetgpu/gpu-health && printf %s {state!r} > {STATE}.new "
        f"&& chmod 0644 {STATE}.new && mv {STATE}.new {STATE}"
    )


def node_state() -> tuple[str, str]:
    state, reason = host(CONTROLLER).check_output(f"sinfo --noheader --Node --nodes={NODE} --format='%T|%E'").split("|")
    return state, reason


def wait_for(state_word: str, reason: str | None, deadline_s: float = 120) -> tuple[str, str]:
    end = time.monotonic() + deadline_s
    while True:
        found = node_state()
        if state_word in found[0] and (reason is None or found[1] == reason):
            return found
        assert time.monotonic() < end, f"{NODE}: expected {state_word} ({reason}), found {found}"
        time.sleep(2)


def test_a_quarantined_gpu_drains_its_node_and_release_resumes_it() -> None:
    uuid = next(iter(GPU))
    try:
        write_state({uuid: {"reason": XID, "since": "2026-12-01T12:00:00Z", "by": "watch"}})
        wait_for("drain", "budgetgpu: GPU 0000:03:00.0 Xid 79")
        # A job may not start there while it is drained.
        refused = host(CONTROLLER).run(f"runuser -u nobody -- srun -w {NODE} --immediate=5 true")
        assert refused.rc != 0
        write_state({})
        # Idle, whatever the reason: Slurm 24.11 (Debian 13) keeps a resumed node's last reason, 22.05 clears it.
        wait_for("idle", None)
    finally:
        write_state({})


def test_a_persons_drain_is_never_resumed() -> None:
    ctl = host(CONTROLLER)
    try:
        ctl.check_output(f"scontrol update NodeName={NODE} State=DRAIN Reason='disk replacement'")
        write_state({})
        # Three health checks later the person's drain is still there.
        time.sleep(16)
        assert node_state() == ("drained", "disk replacement")
    finally:
        ctl.run(f"scontrol update NodeName={NODE} State=RESUME")
        wait_for("idle", None)
