"""The nightly run on the container cluster, driven from the molecule host as cron would drive it.

In order: the no-change run (0 changed, and its time against the first provisioning run's); drift
made by hand while the job trains (restored, reported, the job's PID unchanged, the disruptive part
pending); the pending part applied once no job runs; overlapping runs; a node that is down.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(os.environ["MOLECULE_PROJECT_DIRECTORY"])
EPHEMERAL = Path(os.environ["MOLECULE_EPHEMERAL_DIRECTORY"])
INVENTORY = Path(os.environ["MOLECULE_INVENTORY_FILE"]).parent
LOGS = EPHEMERAL / "nightly-logs"
NODES = ("nightly-node1", "nightly-node2")
JOB_UNIT = "budgetgpu-job-nightly.service"
NCCL_ENV = "/etc/budgetgpu/nccl.env"
DAEMON_JSON = "/etc/docker/daemon.json"
PLAYBOOK = str(REPO / "site.yml")


def nightly_command(*args: str) -> list[str]:
    command = [str(REPO / "scripts" / "nightly-reprovision"), "--inventory", str(INVENTORY), "--log-dir", str(LOGS)]
    return [*command, "--keep", "20", "--playbook", PLAYBOOK, *args]


def nightly_env() -> dict[str, str]:
    return {
        **os.environ,
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(EPHEMERAL / "facts"),
    }


def nightly(*args: str) -> tuple[int, dict, str, float]:
    """Run the script once: (exit status, drift report, summary, wall seconds)."""
    start = time.monotonic()
    done = subprocess.run(nightly_command(*args), env=nightly_env(), capture_output=True, text=True, timeout=1200)
    wall = time.monotonic() - start
    report = json.loads((LOGS / "latest" / "drift.json").read_text())
    summary = (LOGS / "latest" / "summary.txt").read_text()
    print(summary)
    return done.returncode, report, summary, wall


def on(node: str, command: str, check: bool = True) -> str:
    done = subprocess.run(["docker", "exec", node, "sh", "-c", command], capture_output=True, text=True, timeout=120)
    if check:
        assert done.returncode == 0, f"{node}: {command}: {done.stderr}"
    return done.stdout.strip()


def main_pid(node: str, unit: str) -> int:
    return int(on(node, f"systemctl show -p MainPID --value {unit}"))


def started_at(node: str, unit: str) -> str:
    return on(node, f"systemctl show -p ActiveEnterTimestampMonotonic --value {unit}")


def roles_changed(report: dict, node: str) -> set[str]:
    return {entry.get("role") for entry in report["hosts"][node]["changed"]}


def wait_for_job(node: str, seconds: int = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if on(node, f"systemctl is-active {JOB_UNIT}", check=False) == "active" and main_pid(node, JOB_UNIT):
            return
        time.sleep(1)
    pytest.fail(f"{node}: {JOB_UNIT} is not active after {seconds} s")


def test_the_no_change_run_changes_nothing_and_records_its_time():
    first = json.loads((EPHEMERAL / "first-run.json").read_text())
    rc, report, summary, wall = nightly()
    stats = {node: report["hosts"][node]["stats"] for node in NODES}
    assert rc == 0, summary
    assert all(s["changed"] == 0 and s["failures"] == 0 for s in stats.values()), stats
    benchmark = {
        "first_run_s": first["nightly"]["wall_s"],
        "first_run_changed": {node: first["hosts"][node]["stats"]["changed"] for node in NODES},
        "no_change_run_s": round(wall, 1),
        "no_change_playbook_s": report["duration_s"],
        "no_change_changed": {node: stats[node]["changed"] for node in NODES},
        "strategy": report["nightly"]["strategy"],
        "ratio": round(wall / first["nightly"]["wall_s"], 3),
    }
    # The speed goals (under 25% of the first run, under 60 s) are a benchmark, not a pass/fail
    # test: docs/benchmarks/nightly.md keeps the figures and the command that makes them.
    (EPHEMERAL / "benchmark.json").write_text(json.dumps(benchmark, indent=2) + "\n")
    # Kept past molecule's clean-up, for docs/benchmarks/nightly.md.
    kept = REPO / ".cache" / "benchmarks" / "nightly.json"
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_text(json.dumps(benchmark, indent=2) + "\n")
    print(json.dumps(benchmark, indent=2))


@pytest.fixture(scope="module")
def drift_run():
    """Break four things by hand while the job trains, then run the nightly script once."""
    for node in NODES:
        wait_for_job(node)
    before = {
        "pids": {node: main_pid(node, JOB_UNIT) for node in NODES},
        "docker": {node: started_at(node, "docker.service") for node in NODES},
    }
    on(NODES[0], f"rm {NCCL_ENV}")
    on(
        NODES[0],
        # storage-driver is a key Docker cannot reload: putting it back needs a daemon restart.
        f"python3 -c \"import json; p='{DAEMON_JSON}'; d=json.load(open(p)); d.pop('storage-driver'); "
        f"json.dump(d, open(p, 'w'))\"",
    )
    on(NODES[1], "systemctl stop docker.socket docker.service")
    on(NODES[1], f"systemctl disable {JOB_UNIT}")
    # The fallback that must always work, on the run that has the most to do.
    rc, report, summary, _ = nightly("--strategy", "linear")
    after = {"pids": {node: main_pid(node, JOB_UNIT) for node in NODES}}
    after["docker"] = {node: started_at(node, "docker.service") for node in NODES}
    return {"rc": rc, "report": report, "summary": summary, "before": before, "after": after}


def test_drift_run_exits_with_drift_pending(drift_run):
    assert drift_run["rc"] == 11, drift_run["summary"]
    assert drift_run["report"]["nightly"]["strategy"] == "linear"


def test_the_removed_nccl_env_file_is_restored_and_reported(drift_run):
    assert on(NODES[0], f"test -s {NCCL_ENV} && grep -c NCCL_SOCKET_IFNAME {NCCL_ENV}") != "0"
    assert "nccl_network" in roles_changed(drift_run["report"], NODES[0]), drift_run["summary"]


def test_the_removed_daemon_json_key_is_restored_and_reported(drift_run):
    assert json.loads(on(NODES[0], f"cat {DAEMON_JSON}")).get("storage-driver") == "vfs"
    assert "container_runtime" in roles_changed(drift_run["report"], NODES[0]), drift_run["summary"]


def test_the_stopped_docker_runs_again_and_is_reported(drift_run):
    assert on(NODES[1], "systemctl is-active docker.service") == "active"
    assert "container_runtime" in roles_changed(drift_run["report"], NODES[1]), drift_run["summary"]


def test_the_disabled_job_unit_is_enabled_again_and_reported(drift_run):
    assert on(NODES[1], f"systemctl is-enabled {JOB_UNIT}") == "enabled"
    assert "torchrun" in roles_changed(drift_run["report"], NODES[1]), drift_run["summary"]


def test_nothing_else_is_reported_as_drift(drift_run):
    report = drift_run["report"]
    assert roles_changed(report, NODES[0]) <= {"nccl_network", "container_runtime", "torchrun"}, drift_run["summary"]
    assert roles_changed(report, NODES[1]) <= {"container_runtime", "torchrun"}, drift_run["summary"]
    assert all(not report["hosts"][node]["failed"] for node in NODES), drift_run["summary"]


def test_the_training_job_keeps_running_with_the_same_pid(drift_run):
    assert drift_run["after"]["pids"] == drift_run["before"]["pids"]
    for node in NODES:
        assert on(node, f"systemctl is-active {JOB_UNIT}") == "active"


def test_the_docker_restart_is_pending_not_done_while_the_job_runs(drift_run):
    assert drift_run["after"]["docker"][NODES[0]] == drift_run["before"]["docker"][NODES[0]]
    pending = drift_run["report"]["hosts"][NODES[0]]["pending"]
    assert any("docker" in entry.lower() for entry in pending), drift_run["summary"]
    assert drift_run["report"]["hosts"][NODES[0]]["jobs_active"] == [JOB_UNIT]
    assert "pending  " in drift_run["summary"]


def test_the_pending_change_is_applied_on_the_first_run_without_a_job(drift_run):
    for node in NODES:
        on(node, f"systemctl stop {JOB_UNIT}")
    docker_before = started_at(NODES[0], "docker.service")
    rc, report, summary, _ = nightly()
    assert rc == 10, summary
    assert started_at(NODES[0], "docker.service") != docker_before, "docker.service was not restarted"
    assert not report["hosts"][NODES[0]]["pending"], summary
    for node in NODES:
        wait_for_job(node)


def test_a_second_run_is_refused_while_the_first_holds_the_lock():
    first = subprocess.Popen(nightly_command(), env=nightly_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        lock = LOGS / "nightly.lock"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (lock.exists() and lock.read_text().strip()):
            time.sleep(0.1)
        second = subprocess.run(nightly_command(), env=nightly_env(), capture_output=True, text=True, timeout=60)
        assert second.returncode == 75, second.stderr
        assert f"holds the lock {lock}: PID {first.pid} on " in second.stderr
    finally:
        first.communicate(timeout=1200)
    assert first.returncode == 0


def test_a_node_that_is_down_is_reported_and_the_others_are_reprovisioned():
    subprocess.run(["docker", "stop", NODES[1]], check=True, capture_output=True, timeout=120)
    try:
        on(NODES[0], f"rm {NCCL_ENV}")
        rc, report, summary, _ = nightly()
        assert rc == 20, summary
        # Over SSH a stopped node is unreachable; through the docker connection of these tests
        # its first module fails instead. Either way it is named in the report.
        assert report["hosts"][NODES[1]]["unreachable"] or report["hosts"][NODES[1]]["failed"], summary
        assert f"{NODES[1]}: " in summary
        assert "nccl_network" in roles_changed(report, NODES[0]), summary
        assert on(NODES[0], f"test -s {NCCL_ENV} && echo yes") == "yes"
    finally:
        subprocess.run(["docker", "start", NODES[1]], check=False, capture_output=True, timeout=120)
