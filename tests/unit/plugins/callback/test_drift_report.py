"""drift_report callback: per-host changed/failed/unreachable/pending, from a real playbook run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ansible_collections.budgetgpu.cluster.plugins.callback import drift_report

REPO = Path(__file__).resolve().parents[4]

PLAYBOOK = """\
- name: Drift on three hosts
  hosts: all
  gather_facts: false
  tasks:
    - name: Hold back a Docker restart where a job runs
      ansible.builtin.set_fact:
        budgetgpu_jobs_active: [budgetgpu-job-main.service]
        budgetgpu_disruption_allowed: false
        budgetgpu_pending: ["container_runtime: restart docker.service to apply daemon.json"]
        budgetgpu_energy_reading: {time: 1000.0, gpus: {GPU-a: 5000000}, price_per_kwh: 0.12, currency: $}
      when: inventory_hostname == 'busy'
    - name: Reset the pending list as every playbook's probe does
      ansible.builtin.set_fact:
        budgetgpu_pending: []
    - name: Add a second pending change
      ansible.builtin.set_fact:
        budgetgpu_pending: "{{ budgetgpu_pending + ['torchrun: restart pending for budgetgpu-job-main.service'] }}"
      when: inventory_hostname == 'busy'
    - name: Write the drifted files
      ansible.builtin.copy:
        content: "{{ item }}\\n"
        dest: "{{ out }}/{{ inventory_hostname }}-{{ item }}"
        mode: "0644"
      loop: [one, two]
      notify: Restart the thing
    - name: Leave the clean host unchanged
      ansible.builtin.command: "true"
      changed_when: false
    - name: Fail where it is broken
      ansible.builtin.fail:
        msg: broken is broken
      when: inventory_hostname == 'broken'
    - name: Ignore this failure
      ansible.builtin.fail:
        msg: ignored
      ignore_errors: true  # noqa: ignore-errors - the report must not count it
  handlers:
    - name: Restart the thing
      ansible.builtin.command: "true"
      changed_when: true
"""


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """Run a small playbook on local 'hosts' (and one that cannot be reached) with the callback on."""
    tmp = tmp_path_factory.mktemp("drift")
    out = tmp / "out"
    out.mkdir()
    (out / "clean-one").write_text("one\n")
    (out / "clean-two").write_text("two\n")
    local = f"ansible_connection: local, ansible_python_interpreter: {sys.executable}, out: {out}"
    (tmp / "hosts.yml").write_text(
        "all:\n  hosts:\n"
        + "".join(f"    {name}: {{{local}}}\n" for name in ("busy", "broken"))
        + f"    clean: {{{local}}}\n"
        + "    down: {ansible_host: 127.0.0.1, ansible_port: 1, ansible_connection: ssh,"
        + f" out: {out}, ansible_ssh_common_args: '-o ConnectTimeout=2 -o StrictHostKeyChecking=no'}}\n"
    )
    (tmp / "play.yml").write_text(PLAYBOOK)
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_CALLBACKS_ENABLED": "budgetgpu.cluster.drift_report",
        "BUDGETGPU_DRIFT_REPORT": str(tmp / "drift.json"),
        "ANSIBLE_HOST_KEY_CHECKING": "false",
    }
    playbook = Path(sys.executable).parent / "ansible-playbook"
    done = subprocess.run(
        [str(playbook), "-i", str(tmp / "hosts.yml"), str(tmp / "play.yml")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode in (2, 4), done.stdout + done.stderr
    return json.loads((tmp / "drift.json").read_text())


def test_report_has_every_host_with_its_status(report):
    assert report["format"] == 1
    assert report["playbook"] == "play.yml"
    assert {name: host["status"] for name, host in report["hosts"].items()} == {
        "broken": "failed",
        "busy": "pending",
        "clean": "ok",
        "down": "unreachable",
    }


def test_changed_tasks_carry_their_items_and_handlers(report):
    busy = report["hosts"]["busy"]
    assert [(c["task"], c["handler"], c.get("items")) for c in busy["changed"]] == [
        ("Write the drifted files", False, ["one", "two"]),
        ("Restart the thing", True, None),
    ]
    assert busy["stats"]["changed"] == 2
    assert report["hosts"]["clean"]["changed"] == []


def test_pending_and_jobs_come_from_the_safe_mode_facts(report):
    busy = report["hosts"]["busy"]
    assert busy["pending"] == [
        "container_runtime: restart docker.service to apply daemon.json",
        "torchrun: restart pending for budgetgpu-job-main.service",
    ]
    assert busy["jobs_active"] == ["budgetgpu-job-main.service"]
    assert busy["disruption_allowed"] is False
    # The provisioning summary's energy counters, for the next nightly run's energy per day.
    reading = {"time": 1000.0, "gpus": {"GPU-a": 5000000}, "price_per_kwh": 0.12, "currency": "$"}
    assert busy["energy_reading"] == reading
    assert "energy_reading" not in report["hosts"]["clean"]


def test_failures_are_reported_with_their_message_and_ignored_ones_are_not(report):
    assert [(f["task"], f["msg"]) for f in report["hosts"]["broken"]["failed"]] == [
        ("Fail where it is broken", "broken is broken")
    ]
    assert report["hosts"]["busy"]["failed"] == []


def test_an_unreachable_host_is_reported_with_the_reason(report):
    down = report["hosts"]["down"]
    assert down["unreachable"]["task"] == "Write the drifted files"
    assert "Failed to connect to the host via ssh" in down["unreachable"]["msg"]


def test_failure_message_reads_loop_items_and_shortens():
    result = {
        "msg": "All items completed",
        "results": [
            {"failed": True, "msg": "a\n  b"},
            {"failed": False, "msg": "fine"},
            {"failed": True, "msg": "a b"},
        ],
    }
    assert drift_report.failure_message(result) == "a b"
    assert drift_report.failure_message({"msg": "x" * 1000}).endswith("...")
    assert len(drift_report.failure_message({"msg": "x" * 1000})) == drift_report.MESSAGE_LIMIT


@pytest.mark.parametrize(
    ("record", "status"),
    [
        ({}, "ok"),
        ({"changed": [1]}, "drift_fixed"),
        ({"changed": [1], "pending": ["p"]}, "pending"),
        ({"changed": [1], "failed": [1], "pending": ["p"]}, "failed"),
        ({"failed": [1], "unreachable": {"msg": "x"}}, "unreachable"),
    ],
)
def test_host_status_takes_the_worst(record, status):
    assert drift_report.host_status({**drift_report.new_host_record(), **record}) == status


def test_a_modules_own_drift_lines_are_kept_with_its_changed_task():
    """gpu_power_limits returns a line per GPU whose limit it corrected: the report keeps them."""
    from types import SimpleNamespace

    callback = drift_report.CallbackModule()
    line = "GPU 3 (GPU-3090..., 0000:04:00.0, NVIDIA GeForce RTX 3090): power limit 400 W -> 280 W"
    task = SimpleNamespace(_role=None, action="budgetgpu.cluster.gpu_power_limits")
    for data in (
        {"changed": True, "drift": [line]},
        {"changed": True, "drift": []},
        {"changed": False, "drift": [line]},
    ):
        result = SimpleNamespace(host=SimpleNamespace(get_name=lambda: "node1"), task=task, result=data)
        result.task_name = "Set every GPU's power limit to its cap"
        callback.v2_runner_on_ok(result)
    changed = callback.hosts["node1"]["changed"]
    assert [entry.get("drift") for entry in changed] == [[line], None]
