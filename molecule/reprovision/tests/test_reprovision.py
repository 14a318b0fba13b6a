"""The nightly run as installed on a control node: cron entry, log directory, the script as cron runs it, lock."""

from __future__ import annotations

import json
import os
import shlex
import time

import pytest
import testinfra.utils.ansible_runner

testinfra_hosts = testinfra.utils.ansible_runner.AnsibleRunner(os.environ["MOLECULE_INVENTORY_FILE"]).get_hosts("all")

CRON_FILE = "/etc/cron.d/budgetgpu-nightly"
PULL_FILE = "/etc/cron.d/budgetgpu-nightly-pull"
LOG_DIR = "/var/log/budgetgpu/nightly"
USER = "budgetgpu-ops"


def cron_entry(host, path):
    """(schedule, user, command) of the one entry in a cron.d file."""
    lines = [line for line in host.file(path).content_string.splitlines() if line and not line.startswith("#")]
    assert len(lines) == 1, lines
    fields = lines[0].split(None, 6)
    return " ".join(fields[:5]), fields[5], fields[6]


def run_as_cron(host, command, env=""):
    return host.run(f"su {USER} -s /bin/sh -c {shlex.quote(f'cd / && {env} {command}')}")


def test_cron_runs_and_starts_at_boot(host):
    cron = host.service("cron")
    assert cron.is_running
    assert cron.is_enabled


def test_the_entry_runs_the_checkouts_script_nightly_as_the_operator(host):
    schedule, user, command = cron_entry(host, CRON_FILE)
    assert (schedule, user) == ("17 3 * * *", USER)
    argv = shlex.split(command)
    assert argv[0] == "/opt/budgetgpu/scripts/nightly-reprovision"
    assert argv[argv.index("--inventory") + 1] == "/opt/budgetgpu/inventory/cluster"
    assert argv[argv.index("--log-dir") + 1] == LOG_DIR
    assert argv[argv.index("--keep") + 1] == "3"
    assert "--quiet" in argv
    assert argv[argv.index("--timeout") + 1] == "10"
    assert argv[argv.index("--min-free-mb") + 1] == "1"
    assert argv[argv.index("--alertmanager-url") + 1] == "http://127.0.0.1:9093"
    assert host.file(argv[0]).mode & 0o111


def test_the_log_directory_belongs_to_the_operator(host):
    log_dir = host.file(LOG_DIR)
    assert log_dir.is_directory
    assert (log_dir.user, log_dir.mode) == (USER, 0o750)


def test_the_pull_entry_runs_ansible_pull_for_this_node_under_a_lock(host):
    schedule, user, command = cron_entry(host, PULL_FILE)
    assert (schedule, user) == ("17 4 * * *", "root")
    argv = shlex.split(command.split(" >> ")[0])
    assert argv[:6] == ["flock", "-n", "-o", "-E", "75", "/var/log/budgetgpu/pull/nightly.lock"]
    # The lock has a limit: ansible-pull ends at reprovision_timeout_seconds (unit test test_reprovision_pull_lock).
    assert argv[6:9] == ["timeout", "--kill-after=60", "10800"]
    pull = argv[argv.index("ansible-pull") :]
    assert pull[pull.index("--url") + 1] == "https://git.example.org/ops/budgetgpu.git"
    assert pull[pull.index("--limit") + 1] == host.backend.get_hostname()
    assert json.loads(pull[pull.index("--extra-vars") + 1]) == {"budgetgpu_safe_mode": True}
    assert pull[-1] == "site.yml"
    assert "ANSIBLE_CALLBACKS_ENABLED=budgetgpu.cluster.drift_report" in argv
    assert command.endswith(">> /var/log/budgetgpu/pull/ansible-pull.log 2>&1")


def test_the_cron_command_reports_drift_calls_the_hook_and_rotates(host):
    _unused1, _unused2, command = cron_entry(host, CRON_FILE)
    for _unused in range(4):
        done = run_as_cron(host, command)
        assert done.rc == 10, done.stdout + done.stderr
    summary = host.file(f"{LOG_DIR}/latest/summary.txt").content_string
    assert "drift fixed (exit 10)" in summary.splitlines()[0]
    assert "strategy linear" in summary
    assert "  changed  nccl_network: Write the NCCL environment file" in summary
    assert "node2: no drift" in summary
    assert host.file("/tmp/nightly-hook.txt").content_string == "status 10\n" + summary
    runs = host.check_output(f"ls {LOG_DIR}").split()
    assert len([run for run in runs if run[:8].isdigit()]) == 3, runs
    report = json.loads(host.file(f"{LOG_DIR}/latest/drift.json").content_string)
    assert report["nightly"]["status"] == 10


def test_a_second_run_is_refused_while_the_first_holds_the_lock(host):
    _unused1, _unused2, command = cron_entry(host, CRON_FILE)
    host.run("systemctl reset-failed nightly-first.service")
    started = host.run(
        f"systemd-run --unit nightly-first --uid {USER} --setenv FAKE_SLEEP=6 /bin/sh -c {shlex.quote(command)}"
    )
    assert started.rc == 0, started.stderr
    lock = f"{LOG_DIR}/nightly.lock"
    holder = {}
    for _unused in range(100):
        text = host.run(f"cat {lock}").stdout.strip()
        if text:
            holder = json.loads(text)
            break
        time.sleep(0.1)
    assert holder, "the first run never wrote its details into the lock file"
    second = run_as_cron(host, command)
    assert second.rc == 75, second.stdout + second.stderr
    assert f"another nightly run holds the lock {lock}: PID {holder['pid']} on" in second.stderr
    assert f"started {holder['started']}" in second.stderr
    # the first run is unharmed and finishes with its report
    host.run("for i in $(seq 60); do systemctl is-active -q nightly-first.service || break; sleep 0.5; done")
    assert host.run(f"cat {lock}").stdout == ""
    assert "drift fixed" in host.file(f"{LOG_DIR}/latest/summary.txt").content_string


def test_a_hung_run_is_killed_at_the_limit_alertmanager_hears_of_it_and_the_next_night_runs(host):
    _unused1, _unused2, command = cron_entry(host, CRON_FILE)
    host.run("rm -f /tmp/alerts.jsonl; systemctl reset-failed alert-receiver.service")
    assert host.run("systemd-run --unit alert-receiver python3 /opt/budgetgpu/alert_receiver.py").rc == 0
    try:
        for _unused in range(50):
            if host.run("python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", 9093), 1)'").rc == 0:
                break
            time.sleep(0.1)
        assert run_as_cron(host, command).rc == 10
        started = time.monotonic()
        hung = run_as_cron(host, command, "FAKE_HANG=1 FAKE_PIDS=/tmp/hang-pids")
        hung_s = time.monotonic() - started
        posts = [line.split(" ", 1) for line in host.file("/tmp/alerts.jsonl").content_string.splitlines()]
    finally:
        host.run("systemctl stop alert-receiver.service")
    # The run ends at its limit, says which task on which host hung, and leaves nothing behind.
    assert hung.rc == 21, hung.stdout + hung.stderr
    assert 10 <= hung_s < 90
    summary = host.file(f"{LOG_DIR}/latest/summary.txt").content_string
    assert "TIMED OUT (exit 21)" in summary.splitlines()[0]
    assert "TIMED OUT after 10 s (--timeout)" in summary
    assert "  the task running: probe : Probe the GPUs through NVML (play Probe); no result from: node2" in summary
    assert "status 21" in host.file("/tmp/nightly-hook.txt").content_string
    for pid in host.file("/tmp/hang-pids").content_string.split():
        state = host.run(f"ps -o stat= -p {pid}").stdout.strip()
        assert state in ("", "Z"), f"PID {pid} of the hung run is still alive ({state})"
    assert host.run(f"cat {LOG_DIR}/nightly.lock").stdout == ""
    # Alertmanager heard of the drift, then of the failure (which resolves the drift alert).
    assert [path for path, _body in posts] == ["/api/v2/alerts", "/api/v2/alerts"]
    drift, failed = ({a["labels"]["alertname"]: a for a in json.loads(body)} for _path, body in posts)
    firing = drift["BudgetgpuNightlyDrift"]
    assert firing["labels"]["severity"] == "warning" and firing["endsAt"] > firing["startsAt"]
    assert "drift fixed (exit 10)" in firing["annotations"]["summary"]
    failure = failed["BudgetgpuNightlyFailed"]
    assert (failure["labels"]["severity"], failure["annotations"]["exit_status"]) == ("critical", "21")
    assert "no result from: node2" in failure["annotations"]["description"]
    assert failed["BudgetgpuNightlyDrift"]["endsAt"] == failed["BudgetgpuNightlyDrift"]["startsAt"], "resolved"
    # The next night runs.
    assert run_as_cron(host, command).rc == 10


def test_a_full_disk_on_both_paths_exits_22_and_the_next_run_after_freeing_it_succeeds(host):
    _unused1, _unused2, command = cron_entry(host, CRON_FILE)
    uid = host.user(USER).uid
    mounted = host.run(f"mount -t tmpfs -o size=2m,nr_inodes=64,uid={uid},mode=0750 budgetgpu-full {LOG_DIR}")
    assert mounted.rc == 0, mounted.stderr
    try:
        assert run_as_cron(host, command).rc == 10
        # 1. No inode left: the run directory cannot be made.
        host.run(f"i=0; while touch {LOG_DIR}/inode-$i 2>/dev/null; do i=$((i+1)); done")
        full = run_as_cron(host, command)
        assert full.rc == 22, full.stdout + full.stderr
        assert "cannot create the run directory under" in full.stdout and "Traceback" not in full.stderr
        assert "status 22" in host.file("/tmp/nightly-hook.txt").content_string
        host.run(f"rm -f {LOG_DIR}/inode-*")
        assert run_as_cron(host, command).rc == 10
        # 2. The disk fills during the run: the summary cannot be written.
        full = run_as_cron(host, command, f"FAKE_FILL={LOG_DIR}/filler")
        assert full.rc == 22, full.stdout + full.stderr
        assert "FAILED to write its results (exit 22)" in full.stdout.splitlines()[0]
        assert "WRITE FAILED: cannot write" in full.stdout and "No space left on device" in full.stdout
        assert "Traceback" not in full.stderr
        assert host.file("/tmp/nightly-hook.txt").content_string == "status 22\n" + full.stdout
        host.run(f"rm -f {LOG_DIR}/filler")
        assert run_as_cron(host, command).rc == 10
    finally:
        host.run(f"umount {LOG_DIR}")


RAPL_STATE = "/var/lib/budgetgpu/rapl"
FIXTURE = "/var/lib/budgetgpu-sim/powercap/intel-rapl:0/energy_uj"


def rapl_pass(host):
    done = host.run("systemctl start budgetgpu-rapl.service")
    assert done.rc == 0, host.run("journalctl -u budgetgpu-rapl.service -n 20 --no-pager").stdout
    return json.loads(host.file(f"{RAPL_STATE}/energy.json").content_string)


def test_the_rapl_reader_runs_as_root_from_its_timer_and_writes_root_owned_files(host):
    assert host.service("budgetgpu-rapl.timer").is_enabled
    assert host.service("budgetgpu-rapl.timer").is_running
    show = host.check_output("systemctl show budgetgpu-rapl.service -p User -p ProtectSystem -p PrivateNetwork")
    assert "ProtectSystem=strict" in show and "PrivateNetwork=yes" in show
    state_dir = host.file(RAPL_STATE)
    assert (state_dir.user, state_dir.group, state_dir.mode) == ("root", "root", 0o755)
    for name in ("energy.json", "rapl.prom"):
        written = host.file(f"{RAPL_STATE}/{name}")
        assert (written.user, written.mode) == ("root", 0o644)
    link = host.file("/var/lib/prometheus/node-exporter/budgetgpu_rapl.prom")
    assert link.is_symlink and link.linked_to == f"{RAPL_STATE}/rapl.prom"
    # The counter is root's only; what the reader made of it, everyone's.
    assert run_as_cron(host, f"cat {FIXTURE}").rc != 0
    assert "budgetgpu_node_base_watts 180.0" in run_as_cron(host, f"cat {RAPL_STATE}/rapl.prom").stdout


def test_the_rapl_reader_counts_across_the_counters_wrap(host):
    before = rapl_pass(host)["zones"]["intel-rapl:0"]["joules"]
    # 4 J up to max_energy_range_uj, then the counter wraps and counts 6 J more.
    host.run(f"printf '262143328850\\n' > {FIXTURE}")
    rapl_pass(host)
    host.run(f"printf '6000000\\n' > {FIXTURE}")
    after = rapl_pass(host)
    assert after["zones"]["intel-rapl:0"]["joules"] - before == pytest.approx(10)
    assert list(after["zones"]) == ["intel-rapl:0"], "core lies inside the package: counted once"
    text = host.file(f"{RAPL_STATE}/rapl.prom").content_string
    value = after["zones"]["intel-rapl:0"]["joules"]
    line = next(
        x for x in text.splitlines() if x.startswith('budgetgpu_node_cpu_energy_joules_total{zone="package-0"} ')
    )
    assert float(line.split()[-1]) == pytest.approx(value)
    host.run(f"printf '262139328850\\n' > {FIXTURE}")
