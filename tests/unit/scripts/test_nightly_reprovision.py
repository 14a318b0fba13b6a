"""scripts/nightly-reprovision: exit codes, report text, lock, rotation, hook (a fake ansible-playbook)."""

from __future__ import annotations

import copy
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from datetime import datetime
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "nightly-reprovision"


def load_script():
    loader = importlib.machinery.SourceFileLoader("nightly_reprovision", str(SCRIPT))
    spec = importlib.util.spec_from_loader("nightly_reprovision", loader)
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up in sys.modules.
    sys.modules["nightly_reprovision"] = module
    loader.exec_module(module)
    return module


nightly = load_script()

# What the drift_report callback wrote for a 3-node run (recorded, then trimmed): node1 drifted
# and has a pending Docker restart because a job runs there, node2 is clean, node3 is down.
RECORDED = {
    "format": 1,
    "playbook": "site.yml",
    "started": "2026-11-29T03:17:00+00:00",
    "finished": "2026-11-29T03:18:40+00:00",
    "duration_s": 100.0,
    "hosts": {
        "node1": {
            "changed": [
                {
                    "action": "ansible.builtin.template",
                    "handler": False,
                    "play": "Network",
                    "role": "nccl_network",
                    "task": "Write the NCCL environment file",
                },
                {
                    "action": "ansible.builtin.systemd_service",
                    "handler": False,
                    "items": ["budgetgpu-job-main.service"],
                    "play": "Train",
                    "role": "torchrun",
                    "task": "Enable the job units",
                },
            ],
            "disruption_allowed": False,
            "failed": [],
            "jobs_active": ["budgetgpu-job-main.service"],
            "pending": ["container_runtime: restart docker.service to apply /etc/docker/daemon.json"],
            "stats": {"changed": 2, "failures": 0, "ok": 40, "skipped": 5, "unreachable": 0},
            "status": "pending",
            "unreachable": None,
        },
        "node2": {
            "changed": [],
            "disruption_allowed": True,
            "failed": [],
            "jobs_active": [],
            "pending": [],
            "stats": {"changed": 0, "failures": 0, "ok": 40, "skipped": 5, "unreachable": 0},
            "status": "ok",
            "unreachable": None,
        },
        "node3": {
            "changed": [],
            "disruption_allowed": None,
            "failed": [],
            "jobs_active": [],
            "pending": [],
            "stats": {"changed": 0, "failures": 0, "ok": 0, "skipped": 0, "unreachable": 1},
            "status": "unreachable",
            "unreachable": {
                "task": "Gathering Facts",
                "msg": "Failed to connect to the host via ssh: No route to host",
            },
        },
    },
}


def report_with(**hosts):
    report = copy.deepcopy(RECORDED)
    report["hosts"] = {name: {**RECORDED["hosts"]["node2"], **fields} for name, fields in hosts.items()}
    return report


CONTEXT = {
    "started": "2026-11-29T03:17:00+00:00",
    "control_host": "control",
    "playbook": "site.yml",
    "inventory": "inventory/mycluster",
    "strategy": "linear",
    "force": False,
    "wall_s": 100.4,
    "ansible_rc": 4,
    "log": "/var/log/budgetgpu/20261129T031700Z/ansible.log",
}


# --- exit status ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hosts", "rc", "expected"),
    [
        ({"a": {}, "b": {}}, 0, 0),
        ({"a": {"changed": [{"task": "t"}]}, "b": {}}, 0, 10),
        ({"a": {"changed": [{"task": "t"}], "pending": ["restart docker"]}}, 0, 11),
        ({"a": {"pending": ["restart docker"]}}, 0, 11),
        ({"a": {"changed": [{"task": "t"}], "failed": [{"task": "f", "msg": "m"}]}}, 2, 20),
        ({"a": {"unreachable": {"msg": "down"}}, "b": {"changed": [{"task": "t"}]}}, 4, 20),
        # ansible-playbook failed although the report shows nothing (e.g. a failure in a strategy)
        ({"a": {}}, 1, 20),
    ],
)
def test_exit_status_maps_the_report_to_one_code(hosts, rc, expected):
    assert nightly.exit_status(report_with(**hosts), rc) == expected


def test_exit_status_without_a_report_is_a_failure():
    assert nightly.exit_status(None, 0) == nightly.EXIT_FAILED


def test_exit_codes_are_distinct_and_documented():
    codes = [nightly.EXIT_CLEAN, nightly.EXIT_DRIFT_FIXED, nightly.EXIT_DRIFT_PENDING, nightly.EXIT_FAILED]
    codes.append(nightly.EXIT_LOCKED)
    assert len(set(codes)) == 5
    for code in codes:
        assert f"  {code:>2}  " in nightly.__doc__


# --- summary -------------------------------------------------------------------------------------


def test_summary_names_each_host_its_changes_pending_and_the_unreachable():
    text = nightly.summary_text(RECORDED, 20, CONTEXT)
    lines = text.splitlines()
    assert lines[0] == "budgetgpu nightly reprovision 2026-11-29T03:17:00+00:00 on control: FAILED (exit 20)"
    assert "3 hosts: 1 drifted, 1 with pending changes, 0 failed, 1 unreachable (node3)" in lines
    assert "node1: 2 changed, 0 failed, 1 pending" in lines
    assert "  changed  nccl_network: Write the NCCL environment file" in lines
    assert "  changed  torchrun: Enable the job units [budgetgpu-job-main.service]" in lines
    assert any(
        line.startswith("  pending  container_runtime: restart docker.service")
        and "budgetgpu-job-main.service running" in line
        for line in lines
    )
    assert "node2: no drift" in lines
    assert "node3: UNREACHABLE, not reprovisioned: Failed to connect to the host via ssh: No route to host" in lines
    assert lines[-1] == f"log {CONTEXT['log']}"


def test_summary_shows_the_drift_a_module_corrected_under_its_task():
    line = "GPU 3 (GPU-3090..., 0000:04:00.0, NVIDIA GeForce RTX 3090): power limit 400 W -> 280 W"
    entry = {"task": "Set every GPU's power limit to its cap", "role": "gpu_power", "drift": [line]}
    lines = nightly.summary_text(report_with(a={"changed": [entry]}), 10, CONTEXT).splitlines()
    at = lines.index("  changed  gpu_power: Set every GPU's power limit to its cap")
    assert lines[at + 1] == f"           {line}"


def test_summary_lists_failures_with_their_message():
    report = report_with(a={"failed": [{"task": "Start Docker", "role": "container_runtime", "msg": "unit masked"}]})
    assert "  FAILED   container_runtime: Start Docker: unit masked" in nightly.summary_text(report, 20, CONTEXT)


def test_summary_without_a_report_shows_the_log_tail():
    text = nightly.summary_text(
        None, 20, {**CONTEXT, "ansible_rc": 4, "log_tail": ["ERROR! the playbook could not be found"]}
    )
    assert "ansible-playbook exited 4 without a drift report: see the log" in text
    assert "  | ERROR! the playbook could not be found" in text


# --- command line and strategy -------------------------------------------------------------------


def test_playbook_command_sets_safe_mode_as_a_boolean_and_force_on_request():
    args = nightly.parse_args(["-i", "inventory/x", "--force", "--", "--limit", "node1"])
    command = nightly.playbook_command(args, "/venv/bin/ansible-playbook")
    # site.yml in a checkout, budgetgpu.cluster.site installed (ansible-test runs this from a collection tree).
    assert command[:4] == ["/venv/bin/ansible-playbook", "--inventory", "inventory/x", nightly.DEFAULT_PLAYBOOK]
    assert json.loads(command[command.index("--extra-vars") + 1]) == {
        "budgetgpu_safe_mode": True,
        "reprovision_force": True,
    }
    assert command[-2:] == ["--limit", "node1"]


def test_playbook_environment_enables_the_callback_and_keeps_others(tmp_path, monkeypatch):
    monkeypatch.setenv("ANSIBLE_CALLBACKS_ENABLED", "ansible.posix.profile_tasks")
    env = nightly.playbook_environment(tmp_path / "drift.json", "mitogen_linear", "/m/plugins/strategy")
    assert env["ANSIBLE_CALLBACKS_ENABLED"] == "ansible.posix.profile_tasks,budgetgpu.cluster.drift_report"
    assert env["BUDGETGPU_DRIFT_REPORT"] == str(tmp_path / "drift.json")
    assert env["ANSIBLE_STRATEGY"] == "mitogen_linear"
    assert env["ANSIBLE_STRATEGY_PLUGINS"].split(os.pathsep)[0] == "/m/plugins/strategy"


def test_interpreter_of_reads_the_shebang(tmp_path):
    program = tmp_path / "ansible-playbook"
    program.write_text("#!/opt/venv/bin/python3.11\nprint()\n")
    assert nightly.interpreter_of(str(program)) == "/opt/venv/bin/python3.11"
    program.write_text("#!/usr/bin/env python3\n")
    assert nightly.interpreter_of(str(program)) == "python3"
    program.write_text("#!/bin/sh\n")
    assert nightly.interpreter_of(str(program)) == sys.executable


def test_strategy_falls_back_to_linear_without_mitogen(tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexit 1\n")
    python.chmod(0o755)
    program = tmp_path / "ansible-playbook"
    program.write_text(f"#!{python}\n")
    strategy, directory, why = nightly.choose_strategy("auto", str(program))
    assert (strategy, directory) == ("linear", None)
    assert "mitogen" in why
    assert nightly.choose_strategy("linear", str(program))[0] == "linear"


def test_keep_must_be_positive(capsys):
    with pytest.raises(SystemExit) as exited:
        nightly.parse_args(["--keep", "0"])
    assert exited.value.code == 2
    assert "--keep 0" in capsys.readouterr().err


# --- rotation ------------------------------------------------------------------------------------


def test_rotate_keeps_the_newest_runs_and_nothing_else_is_touched(tmp_path):
    names = ["20261101T031700Z", "20261103T031700Z", "20261103T031700Z-2", "20261103T031700Z-10", "20261104T031700Z"]
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "ansible.log").write_text("x")
    (tmp_path / "nightly.lock").write_text("")
    (tmp_path / "notes").mkdir()
    removed = nightly.rotate(tmp_path, keep=2)
    assert [p.name for p in removed] == names[:3]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "20261103T031700Z-10",
        "20261104T031700Z",
        "nightly.lock",
        "notes",
    ]


def test_runs_in_the_same_second_sort_after_the_ones_before(tmp_path):
    from datetime import UTC, datetime

    started = datetime(2026, 11, 29, 3, 17, tzinfo=UTC)
    made = [nightly.new_run_dir(tmp_path, started).name for _unused in range(3)]
    nightly.rotate(tmp_path, keep=1)
    made.append(nightly.new_run_dir(tmp_path, started).name)
    assert made == ["20261129T031700Z", "20261129T031700Z-1", "20261129T031700Z-2", "20261129T031700Z-3"]
    assert [p.name for p in nightly.run_dirs(tmp_path)] == made[2:]


# --- the script as cron runs it, with a fake ansible-playbook --------------------------------------

FAKE_PLAYBOOK = """\
#!/bin/sh
# A stand-in for ansible-playbook: records its arguments, waits, writes the report it was given.
printf '%s\\n' "$@" > "$(dirname "$BUDGETGPU_DRIFT_REPORT")/args.txt"
echo "strategy=$ANSIBLE_STRATEGY callbacks=$ANSIBLE_CALLBACKS_ENABLED"
[ -n "$FAKE_SLEEP" ] && sleep "$FAKE_SLEEP"
[ -n "$FAKE_REPORT" ] && cp "$FAKE_REPORT" "$BUDGETGPU_DRIFT_REPORT"
exit "${FAKE_RC:-0}"
"""


@pytest.fixture
def fake(tmp_path):
    program = tmp_path / "fake-ansible-playbook"
    program.write_text(FAKE_PLAYBOOK)
    program.chmod(0o755)
    recorded = tmp_path / "recorded.json"
    recorded.write_text(json.dumps(RECORDED))
    clean = tmp_path / "clean.json"
    clean.write_text(json.dumps(report_with(node1={}, node2={})))
    drifted = tmp_path / "drifted.json"
    drifted.write_text(json.dumps(report_with(node1={"changed": RECORDED["hosts"]["node1"]["changed"]}, node2={})))
    return {"program": program, "recorded": recorded, "clean": clean, "drifted": drifted, "logs": tmp_path / "logs"}


def run_script(fake, *args, env=None, **popen):
    command = [sys.executable, str(SCRIPT), "--ansible-playbook", str(fake["program"]), "--log-dir", str(fake["logs"])]
    command += ["--strategy", "linear", *args]
    full_env = {**os.environ, **(env or {})}
    if popen:
        return subprocess.Popen(command, env=full_env, text=True, **popen)
    return subprocess.run(command, env=full_env, text=True, capture_output=True, check=False, timeout=60)


def test_a_clean_run_exits_0_and_writes_log_report_and_summary(fake):
    done = run_script(fake, env={"FAKE_REPORT": str(fake["clean"])})
    assert done.returncode == 0, done.stderr
    latest = fake["logs"] / "latest"
    assert (latest / "summary.txt").read_text() == done.stdout
    assert "no drift (exit 0)" in done.stdout
    assert "strategy=linear callbacks=budgetgpu.cluster.drift_report" in (latest / "ansible.log").read_text()
    report = json.loads((latest / "drift.json").read_text())
    assert report["nightly"]["status"] == 0
    args = (latest / "args.txt").read_text().splitlines()
    assert json.loads(args[args.index("--extra-vars") + 1]) == {"budgetgpu_safe_mode": True}


def test_quiet_prints_nothing_when_nothing_drifted(fake):
    done = run_script(fake, "--quiet", env={"FAKE_REPORT": str(fake["clean"])})
    assert (done.returncode, done.stdout) == (0, "")


def test_drift_fixed_exits_10_and_calls_the_hook_with_the_summary(fake, tmp_path):
    seen = tmp_path / "hook.txt"
    hook = f'{{ echo "args $1 $3 $BUDGETGPU_NIGHTLY_STATUS"; cat; }} > {seen}'
    done = run_script(fake, "--hook", hook, env={"FAKE_REPORT": str(fake["drifted"])})
    assert done.returncode == 10, done.stderr
    summary = fake["logs"] / "latest" / "summary.txt"
    assert seen.read_text() == f"args {summary.resolve()} 10 10\n" + summary.read_text()
    assert "  changed  nccl_network: Write the NCCL environment file" in done.stdout


def test_the_hook_is_not_called_when_nothing_drifted_unless_asked(fake, tmp_path):
    seen = tmp_path / "hook.txt"
    run_script(fake, "--hook", f"touch {seen}", env={"FAKE_REPORT": str(fake["clean"])})
    assert not seen.exists()
    run_script(fake, "--hook", f"touch {seen}", "--hook-when", "always", env={"FAKE_REPORT": str(fake["clean"])})
    assert seen.exists()


def test_unreachable_and_pending_exit_20_with_the_report(fake):
    done = run_script(fake, env={"FAKE_REPORT": str(fake["recorded"]), "FAKE_RC": "4"})
    assert done.returncode == 20
    assert "node3: UNREACHABLE" in done.stdout


def test_no_report_exits_20_and_shows_why(fake):
    done = run_script(fake, env={"FAKE_RC": "1"})
    assert done.returncode == 20
    assert "ansible-playbook exited 1 without a drift report" in done.stdout


def test_force_passes_reprovision_force(fake):
    run_script(fake, "--force", env={"FAKE_REPORT": str(fake["clean"])})
    args = (fake["logs"] / "latest" / "args.txt").read_text().splitlines()
    assert json.loads(args[args.index("--extra-vars") + 1])["reprovision_force"] is True


def test_runs_rotate_to_keep_n(fake):
    for _unused in range(4):
        run_script(fake, "--keep", "2", env={"FAKE_REPORT": str(fake["clean"])})
        time.sleep(0.01)
    assert len(nightly.run_dirs(fake["logs"])) == 2
    assert (fake["logs"] / "latest" / "summary.txt").exists()


def test_a_second_run_is_refused_while_the_first_holds_the_lock(fake):
    first = run_script(
        fake,
        env={"FAKE_REPORT": str(fake["clean"]), "FAKE_SLEEP": "5"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        lock = fake["logs"] / "nightly.lock"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (lock.exists() and lock.read_text().strip()):
            time.sleep(0.05)
        second = run_script(fake, env={"FAKE_REPORT": str(fake["clean"])})
        assert second.returncode == 75
        assert f"another nightly run holds the lock {lock}: PID {first.pid} on " in second.stderr
        assert "not starting a second one" in second.stderr
        assert len(nightly.run_dirs(fake["logs"])) == 1, "the refused run leaves no run directory"
    finally:
        first.wait(timeout=30)
    assert first.returncode == 0
    assert lock.read_text() == "", "the lock file is emptied when the run ends"
    assert run_script(fake, env={"FAKE_REPORT": str(fake["clean"])}).returncode == 0


def test_lock_holder_text_survives_a_refused_attempt(tmp_path):
    holder = {"pid": 4242, "host": "control", "started": "2026-11-29T03:17:00+00:00", "log": "/x/ansible.log"}
    lock = nightly.acquire_lock(tmp_path / "nightly.lock", holder)
    code = textwrap.dedent(
        f"""
        import importlib.machinery, importlib.util, sys
        loader = importlib.machinery.SourceFileLoader("n", {str(SCRIPT)!r})
        spec = importlib.util.spec_from_loader("n", loader)
        n = sys.modules["n"] = importlib.util.module_from_spec(spec)
        loader.exec_module(n)
        try:
            n.acquire_lock(n.Path({str(tmp_path / "nightly.lock")!r}), {{"pid": 1}})
        except n.LockHeld as held:
            print(held)
        """
    )
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        assert "PID 4242 on control, started 2026-11-29T03:17:00+00:00 (log /x/ansible.log)" in out
        assert json.loads((tmp_path / "nightly.lock").read_text())["pid"] == 4242
    finally:
        nightly.release_lock(lock)


def test_summary_reports_each_quarantined_gpu_with_reason_and_time():
    out = {
        "GPU-2": {"reason": "GPU 2: fan 0% (target 80%) at 88 C: fan dead?", "since": "2026-12-01T02:00:00Z"},
        "GPU-1": {"reason": "listed in gpu_health_quarantine", "since": None},
    }
    assert nightly.host_lines("node1", {"gpu_quarantine": out}) == [
        "node1: no drift",
        "  QUARANTINED GPU GPU-1 since (inventory): listed in gpu_health_quarantine",
        "  QUARANTINED GPU GPU-2 since 2026-12-01T02:00:00Z: GPU 2: fan 0% (target 80%) at 88 C: fan dead?",
    ]


def test_the_second_nightly_run_shows_each_nodes_energy_per_day(fake, tmp_path):
    def reading(time_s: float, joules: float, cpu_j: float) -> dict:
        return {
            "time": time_s,
            "gpus": {f"GPU-{n}": joules for n in "abcd"},
            "cpu": {"time": time_s - 20, "joules": cpu_j},
            "base_watts": 200,
            "price_per_kwh": 0.12,
            "currency": "$",
        }

    first, second = tmp_path / "first.json", tmp_path / "second.json"
    first.write_text(json.dumps(report_with(node1={"energy_reading": reading(1000, 1e6, 5e5)}, node2={})))
    # 24 h later: the guide's node at full load, four GPUs at 350 W, the CPU at 40 W of the node's 200 W.
    day_j, cpu_j = 350 * 24 * 3600, 40 * 24 * 3600
    second.write_text(
        json.dumps(report_with(node1={"energy_reading": reading(1000 + 86400, 1e6 + day_j, 5e5 + cpu_j)}, node2={}))
    )
    done = run_script(fake, env={"FAKE_REPORT": str(first)})
    assert "  energy: no reading of an earlier nightly run yet (the next one shows kWh a day)" in done.stdout
    done = run_script(fake, env={"FAKE_REPORT": str(second)})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[lines.index("node1: no drift") + 1] == (
        "  energy: 38.40 kWh a day = $4.61 a day at $0.12/kWh (GPUs 33.60 kWh: 33.60 kWh measured on 4 GPUs"
        " over 24.0 h since the last nightly run; CPU 0.96 kWh measured by RAPL; rest of the node estimated at"
        " budgetgpu_node_base_watts 200 W less the CPU's 40 W: 3.84 kWh)"
    )
    assert "node2: no drift" in lines and not any(
        line.startswith("  energy") for line in lines[lines.index("node2: no drift") :]
    )


# --- a run that hangs: killed at the time limit, with its whole process group -----------------------

HANGING_PLAYBOOK = """\
#!/bin/sh
# A stand-in for an ansible-playbook whose NVML task never returns on node2: the default callback's
# lines, then ssh-like children (one ignores SIGTERM) that would outlive a kill of the leader alone.
echo "PLAY [Probe] ****"
echo "TASK [Gathering Facts] ****"
echo "ok: [node1]"
echo "ok: [node2]"
echo "TASK [probe : Read the GPUs through NVML] ****"
echo "ok: [node1]"
sleep 600 &
echo $! > "$FAKE_PIDS"
sh -c 'trap "" TERM; while :; do sleep 1; done' &
echo $! >> "$FAKE_PIDS"
wait
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie of an already-killed process counts as gone.
    state = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].split()[0] if Path(f"/proc/{pid}").exists() else "X"
    return state not in ("Z", "X")


def test_running_task_names_the_task_and_the_hosts_without_a_result():
    log = "\n".join(
        [
            "PLAY [Network] ****",
            "TASK [Gathering Facts] ****",
            "ok: [node1]",
            "fatal: [node3]: UNREACHABLE! => {}",
            "ok: [node2]",
            "TASK [nccl_network : Write the NCCL environment file] ****",
            "changed: [node2]",
            "ok: [node1 -> localhost]",
            "TASK [probe : Read the GPUs through NVML] ****",
            "ok: [node2]",
        ]
    )
    assert nightly.running_task(log) == {
        "play": "Network",
        "task": "probe : Read the GPUs through NVML",
        "waiting": ["node1"],
    }
    assert nightly.running_task("PLAY [x] ****\nPLAY RECAP ****\n")["task"] is None


def test_a_hung_run_is_killed_at_the_limit_with_its_children_and_the_next_run_succeeds(fake, tmp_path):
    hanging = tmp_path / "hanging-ansible-playbook"
    hanging.write_text(HANGING_PLAYBOOK)
    hanging.chmod(0o755)
    pids = tmp_path / "pids"
    started = time.monotonic()
    done = run_script(
        {**fake, "program": hanging},
        "--timeout",
        "3",
        "--kill-grace",
        "1",
        "--hook",
        f"cat > {tmp_path}/hook.txt",
        env={"FAKE_PIDS": str(pids)},
    )
    assert done.returncode == nightly.EXIT_TIMED_OUT, done.stdout + done.stderr
    assert time.monotonic() - started < 30
    lines = done.stdout.splitlines()
    assert lines[0].endswith(": TIMED OUT (exit 21)")
    assert any(line.startswith("TIMED OUT after 3 s (--timeout)") for line in lines), lines
    assert "  the task running: probe : Read the GPUs through NVML (play Probe); no result from: node2" in lines
    assert (fake["logs"] / "latest" / "summary.txt").read_text() == done.stdout
    assert (tmp_path / "hook.txt").read_text() == done.stdout, "a timeout is a failure: the hook hears of it"
    children = [int(pid) for pid in pids.read_text().split()]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(alive(pid) for pid in children):
        time.sleep(0.1)
    assert not any(alive(pid) for pid in children), "a child of ansible-playbook outlived the time limit"
    assert (fake["logs"] / "nightly.lock").read_text() == ""
    after = run_script(fake, env={"FAKE_REPORT": str(fake["clean"])})
    assert after.returncode == 0, after.stdout + after.stderr


def test_timeout_and_free_space_must_not_be_negative(capsys):
    with pytest.raises(SystemExit):
        nightly.parse_args(["--timeout", "-1"])
    assert "--timeout -1: expected 0 or more" in capsys.readouterr().err


# --- a full disk, before the run and after it ---------------------------------------------------------


def test_too_little_free_space_exits_22_before_the_run_and_tells(fake, tmp_path):
    seen = tmp_path / "hook.txt"
    done = run_script(
        fake, "--min-free-mb", str(10**12), "--hook", f"cat > {seen}", env={"FAKE_REPORT": str(fake["clean"])}
    )
    assert done.returncode == nightly.EXIT_NO_WRITE, done.stderr
    assert "FAILED to write its results (exit 22)" in done.stdout.splitlines()[0]
    assert "MB free under" in done.stdout and "--min-free-mb" in done.stdout
    assert seen.read_text() == done.stdout
    assert nightly.run_dirs(fake["logs"]) == [], "nothing ran"
    assert run_script(fake, env={"FAKE_REPORT": str(fake["clean"])}).returncode == 0


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MB tmpfs with 40 inodes: a disk that fills (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m,nr_inodes=40,mode=0755", "budgetgpu-test", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill_inodes(directory: Path) -> list[Path]:
    made = []
    while True:
        path = directory / f"inode-{len(made)}"
        try:
            path.touch()
        except OSError:
            return made
        made.append(path)


FILLING_PLAYBOOK = """\
#!/bin/sh
# A stand-in ansible-playbook that writes its report, then fills the disk the logs are on.
cp "$FAKE_REPORT" "$BUDGETGPU_DRIFT_REPORT"
dd if=/dev/zero of="$FAKE_FILLER" bs=4096 2>/dev/null
exit 0
"""


def test_a_full_disk_on_both_paths_exits_22_with_a_summary_and_no_traceback(fake, small_disk, tmp_path):
    disk_fake = {**fake, "logs": small_disk / "nightly"}
    clean = {"FAKE_REPORT": str(fake["clean"])}

    def run(*args, program=None, env=None):
        done = run_script(
            {**disk_fake, "program": program or fake["program"]}, "--min-free-mb", "1", *args, env=env or clean
        )
        assert "Traceback" not in done.stdout + done.stderr
        return done

    assert run().returncode == 0
    # 1. No inode left: the run directory cannot be made.
    fillers = fill_inodes(small_disk)
    done = run()
    assert done.returncode == nightly.EXIT_NO_WRITE, done.stdout + done.stderr
    assert "cannot create the run directory under" in done.stdout
    for path in fillers:
        path.unlink()
    assert run().returncode == 0
    # 2. The disk fills during the run: the summary cannot be written.
    filling = tmp_path / "filling-ansible-playbook"
    filling.write_text(FILLING_PLAYBOOK)
    filling.chmod(0o755)
    filler = small_disk / "filler"
    seen = tmp_path / "hook.txt"
    hook = ["--hook", f"cat > {seen}", "--hook-when", "failure"]
    done = run(*hook, program=filling, env={**clean, "FAKE_FILLER": str(filler)})
    assert done.returncode == nightly.EXIT_NO_WRITE, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].endswith("FAILED to write its results (exit 22)")
    assert any(line.startswith("WRITE FAILED: cannot write ") and "No space left on device" in line for line in lines)
    assert seen.read_text() == done.stdout, "the hook gets the summary on stdin although its file is missing"
    assert not (disk_fake["logs"] / "latest" / "summary.txt").exists()
    assert (disk_fake["logs"] / "nightly.lock").read_text() == ""
    # 3. The disk is still full at the next night: the free-space check stops it before the run.
    done = run(*hook)
    assert done.returncode == nightly.EXIT_NO_WRITE
    assert "MB free under" in done.stdout and seen.read_text() == done.stdout
    filler.unlink()
    assert run().returncode == 0


# --- Alertmanager ------------------------------------------------------------------------------------


@pytest.fixture
def receiver():
    """A stand-in Alertmanager on loopback: records every POST to /api/v2/alerts."""
    import http.server
    import threading

    posts: list[tuple[str, list]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            posts.append((self.path, json.loads(body)))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", posts
    finally:
        server.shutdown()


def by_name(alerts: list) -> dict:
    return {alert["labels"]["alertname"]: alert for alert in alerts}


def test_drift_and_failure_are_posted_to_alertmanager_and_a_clean_run_resolves_them(fake, receiver):
    url, posts = receiver
    done = run_script(fake, "--alertmanager-url", url + "/", env={"FAKE_REPORT": str(fake["drifted"])})
    assert done.returncode == 10
    path, alerts = posts[-1]
    assert path == "/api/v2/alerts"
    drift, failed = by_name(alerts)["BudgetgpuNightlyDrift"], by_name(alerts)["BudgetgpuNightlyFailed"]
    assert drift["labels"]["severity"] == "warning" and drift["labels"]["job"] == "budgetgpu-nightly"
    assert drift["annotations"]["summary"] == done.stdout.splitlines()[0]
    assert "  changed  nccl_network: Write the NCCL environment file" in drift["annotations"]["description"]
    hold = datetime.fromisoformat(drift["endsAt"]) - datetime.fromisoformat(drift["startsAt"])
    assert hold.total_seconds() > 24 * 3600, "a firing alert lasts until the next night's run"
    assert failed["endsAt"] == failed["startsAt"], "the other outcome's alert is resolved"
    done = run_script(fake, "--alertmanager-url", url, env={"FAKE_RC": "1"})
    assert done.returncode == 20
    failed = by_name(posts[-1][1])["BudgetgpuNightlyFailed"]
    assert (failed["labels"]["severity"], failed["annotations"]["exit_status"]) == ("critical", "20")
    assert failed["endsAt"] > failed["startsAt"]
    run_script(fake, "--alertmanager-url", url, env={"FAKE_REPORT": str(fake["clean"])})
    for alert in posts[-1][1]:
        ends, starts = (datetime.fromisoformat(alert[key]) for key in ("endsAt", "startsAt"))
        assert ends <= starts, f"a clean run resolves {alert['labels']['alertname']}"


def test_an_alertmanager_that_does_not_answer_is_reported_and_changes_nothing(fake):
    done = run_script(fake, "--alertmanager-url", "http://127.0.0.1:9", env={"FAKE_REPORT": str(fake["drifted"])})
    assert done.returncode == 10
    assert "cannot post to Alertmanager at http://127.0.0.1:9/api/v2/alerts" in done.stderr
    assert "Traceback" not in done.stderr
