"""The GPU health watch on a simulated 4x RTX 3090 node: faults injected beneath the code (the fake
NVML's faults file, the sysfs AER counters, the kern.log), passes run by the watch's own unit."""

from __future__ import annotations

import json
import os
import shlex
import time

import testinfra.utils.ansible_runner

testinfra_hosts = testinfra.utils.ansible_runner.AnsibleRunner(os.environ["MOLECULE_INVENTORY_FILE"]).get_hosts(
    "health_watch"
)

UNIT = "budgetgpu-gpu-health"
STATE = "/var/lib/budgetgpu/gpu-health/state.json"
FAULTS = "/etc/budgetgpu-sim/faults.json"
KERN_LOG = "/var/lib/budgetgpu-sim/kern.log"
AER = "/var/lib/budgetgpu-sim/sys/bus/pci/devices/0000:03:00.0/aer_dev_correctable"
LAUNCHER = "/var/lib/budgetgpu-probes/budgetgpu-torchrun"
GPUS = [f"GPU-3090000{i}-5a1e-4c0d-9b7e-00000000000{i}" for i in range(4)]
LISTED, FAULTY = GPUS[1], GPUS[2]  # GPU 1 from the inventory, GPU 2 from the faults below


def state(host) -> dict:
    return json.loads(host.file(STATE).content_string)


def run_pass(host) -> None:
    host.check_output(f"systemctl start {UNIT}.service")


def write(host, path: str, text: str) -> None:
    # %b: the newlines travel as \n inside the shell's double quotes.
    host.check_output(f"printf %b {json.dumps(text)} > {path}")


def journal(host) -> list[str]:
    return host.check_output(f"journalctl -u {UNIT} -o cat --no-pager").splitlines()


def passed_this_boot(host) -> str | None:
    """The result of the watch's last pass since systemd started, None before the first."""
    shown = host.check_output(f"systemctl show -p ExecMainExitTimestampMonotonic -p Result {UNIT}.service")
    props = dict(line.split("=", 1) for line in shown.splitlines())
    return None if props["ExecMainExitTimestampMonotonic"] == "0" else props["Result"]


def faults(host, replays: int, **more) -> None:
    fault = {"fans": [{"speed": 0, "target": 80}], "temp": 88, "pcie_replay": replays, "pcie_width_cur": 1, **more}
    write(host, FAULTS, json.dumps({FAULTY: fault}))


def plan(host, nproc: int, fixed: bool, user: str = "nobody") -> dict:
    """The launcher's decision at a job's start, as the job's (unprivileged) user makes it."""
    code = (
        "import importlib.machinery, json, sys;"
        f"l = importlib.machinery.SourceFileLoader('launcher', '{LAUNCHER}').load_module();"
        f"env = {{'BUDGETGPU_GPUS': '{','.join(GPUS)}', 'BUDGETGPU_NPROC_FIXED': '{int(fixed)}',"
        " 'BUDGETGPU_JOB': 'main'};"
        f"argv = l.gpu_health_argv(['--nproc-per-node={nproc}', 'train.py'], env);"
        "print(json.dumps({'argv': argv, 'visible': env.get('CUDA_VISIBLE_DEVICES')}))"
    )
    # The job venv has the node package on its path (python_env's .pth); the node venv stands in here.
    done = host.run(f"runuser -u {user} -- /opt/budgetgpu/node/bin/python3 -c {json.dumps(code)}")
    assert done.rc == 0, done.stderr
    return {**json.loads(done.stdout.splitlines()[-1]), "log": done.stdout}


def test_the_timer_runs_the_watch_unprivileged_in_a_sandbox(host):
    assert host.service(f"{UNIT}.timer").is_enabled and host.service(f"{UNIT}.timer").is_running
    props = dict(
        line.split("=", 1)
        for line in host.check_output(
            f"systemctl show {UNIT}.service -p User -p DevicePolicy -p PrivateNetwork -p ProtectSystem "
            "-p CapabilityBoundingSet -p NoNewPrivileges -p SupplementaryGroups"
        ).splitlines()
    )
    # The journal's group, and the GPU device files' (mode 0660: role nvidia_driver's devices.yml) to ask NVML.
    assert props["User"] == "budgetgpu-health" and props["SupplementaryGroups"] == "systemd-journal budgetgpu-gpu"
    assert (props["DevicePolicy"], props["PrivateNetwork"], props["ProtectSystem"]) == ("closed", "yes", "strict")
    assert props["NoNewPrivileges"] == "yes" and props["CapabilityBoundingSet"] == ""
    assert host.file(STATE).user == "budgetgpu-health" and host.file(STATE).mode == 0o644
    out = state(host)["quarantine"]
    assert out == {LISTED: {"by": "inventory", "reason": "listed in gpu_health_quarantine", "since": None}}


def test_faults_take_gpu_2_out_and_each_change_is_logged_once(host):
    before = len(journal(host))
    faults(host, replays=500)
    host.check_output(
        f"echo 'Dec  1 02:00:00 monitoring-3090 kernel: NVRM: Xid (PCI:0000:03:00): 79, pid=4242, name=python3, "
        f"GPU has fallen off the bus.' >> {KERN_LOG}"
    )
    write(host, AER, "RxErr 40\nBadTLP 0\nBadDLLP 0\nRollover 0\nTimeout 0\nNonFatalErr 0\nTOTAL_ERR_COR 40\n")
    run_pass(host)
    faults(host, replays=1000)  # the replay counter keeps growing: the finding stays, not logged again
    run_pass(host)
    faults(host, replays=1500)
    run_pass(host)
    gpu = state(host)["gpus"][FAULTY]
    assert gpu["status"] == "take_out" and "fan 0% (target 80%) at 88 C" in gpu["taken_out"]["reason"]
    assert {"dead_fan", "link_width", "pcie_replays"} <= set(gpu["reasons"])
    lines = journal(host)[before:]
    for words in (
        "fan 0% (target 80%)",
        "Xid 79",
        "PCIe link now x1, x4 at boot",
        "PCIe replay counter",
        "AER correctable",
    ):
        assert len([line for line in lines if words in line and not line.startswith("cleared")]) == 1, (words, lines)
    assert len([line for line in lines if "status ok -> take_out" in line]) == 1
    out = state(host)["quarantine"]
    assert set(out) == {LISTED, FAULTY} and out[FAULTY]["by"] == "watch" and out[FAULTY]["since"]


def test_a_quarantined_gpu_stays_out_after_a_reboot_and_the_timer_runs_again(host, reboot):
    """The watch's state lives under /var/lib (StateDirectory=), not /run: GPU 2 stays out after a boot, and
    so it must, since nobody released it. Its faults are cleared first (the pass after the boot finds
    nothing), so only the kept state holds it out. The timer starts at boot and its first pass keeps it."""
    fault_text = host.file(FAULTS).content_string
    write(host, FAULTS, "{}")
    try:
        reboot(host)
        # Whether or not the timer's first pass of this boot ran yet: a worker's ExecCondition reads the kept state.
        worker = host.run(f"runuser -u nobody -- /usr/local/bin/gpu-health check {FAULTY}")
        assert worker.rc == 1 and f"{FAULTY} quarantined since" in worker.stderr, worker.stderr
        assert host.service(f"{UNIT}.timer").is_running
        # OnCalendar each minute: the first pass of this boot (a new systemd knows of no earlier one) within
        # about a minute, started by the timer alone.
        deadline = time.monotonic() + 120
        while passed_this_boot(host) is None and time.monotonic() < deadline:
            time.sleep(2)
        assert passed_this_boot(host) == "success", f"no pass within 120 s of the boot: {journal(host)[-5:]}"
        assert set(state(host)["quarantine"]) == {LISTED, FAULTY}
        kept = state(host)["quarantine"][FAULTY]
        assert kept["by"] == "watch" and "fan 0% (target 80%)" in kept["reason"], kept
    finally:
        write(host, FAULTS, fault_text)


def test_the_next_job_start_leaves_the_quarantined_gpus_out_or_holds_a_fixed_job(host):
    elastic = plan(host, nproc=4, fixed=False)
    assert elastic["argv"] == ["--nproc-per-node=2", "train.py"]
    assert elastic["visible"] == f"{GPUS[0]},{GPUS[3]}"
    assert f"left out {LISTED} quarantined" in elastic["log"] and "fan 0%" in elastic["log"]
    held = plan(host, nproc=4, fixed=True)
    assert held["argv"] is None and "held, not started: nproc_per_node is fixed at 4" in held["log"]
    one = plan(host, nproc=1, fixed=True)  # GPU 0 only: nothing it needs is out
    assert (one["argv"], one["visible"]) == (["--nproc-per-node=1", "train.py"], None)
    # An inference worker's ExecCondition, and the local fact preflight reads.
    worker = host.run(f"runuser -u nobody -- /usr/local/bin/gpu-health check {FAULTY}")
    assert worker.rc == 1 and f"monitoring-3090: not starting: {FAULTY} quarantined since" in worker.stderr
    assert host.run(f"runuser -u nobody -- /usr/local/bin/gpu-health check {GPUS[0]}").rc == 0
    fact = json.loads(host.check_output("/etc/ansible/facts.d/budgetgpu_gpu_health.fact"))
    assert set(fact["quarantine"]) == {LISTED, FAULTY}


def test_gpu_release_names_what_is_quarantined_then_returns_the_gpu(host, playbook):
    def release(gpu: str):
        return playbook("gpu_release.yml", "--limit", "health_watch", "-e", f"gpu={gpu}")

    wrong = release("GPU-deadbeef-0000-0000-0000-000000000000")
    assert wrong.returncode != 0
    assert "monitoring-3090: GPU GPU-deadbeef-0000-0000-0000-000000000000 is not quarantined here" in wrong.stdout
    assert FAULTY in wrong.stdout and LISTED in wrong.stdout
    listed = release(LISTED)
    assert listed.returncode != 0 and "is listed in gpu_health_quarantine" in listed.stdout
    write(host, FAULTS, "{}")  # the fan is replaced, the riser reseated
    run_pass(host)
    done = release(FAULTY)
    assert done.returncode == 0, done.stdout
    assert "released (take_out -> " in done.stdout
    run_pass(host)
    assert set(state(host)["quarantine"]) == {LISTED}
    assert plan(host, nproc=4, fixed=False)["argv"] == ["--nproc-per-node=3", "train.py"]


def test_what_a_jobs_user_plants_costs_that_jobs_metrics_only_and_a_cut_state_skips_no_worker(host):
    """As the job's user, in its own 0751 directory: a link to /dev/zero, a FIFO, a JSON list; beside a job
    whose status is good. The watch's pass (its unit, MemoryMax= on it) stays on time, the good job's
    metrics are written, each refusal is in the journal. Then the state cut in half: workers still start."""
    assert host.check_output(f"systemctl show -p MemoryMax --value {UNIT}.service") == str(256 << 20)
    root = "/var/lib/budgetgpu/jobs"
    good = shlex.quote(json.dumps({"step": 7}))
    plant = (
        f"install -d -m 0751 -o nobody -g nogroup {root}/good {root}/zero {root}/fifo {root}/list && "
        f"runuser -u nobody -- sh -c 'ln -s /dev/zero {root}/zero/status.json && mkfifo {root}/fifo/status.json && "
        f"echo [1] > {root}/list/status.json' && echo {good} | runuser -u nobody -- tee {root}/good/status.json"
    )
    host.check_output(plant)
    before = len(journal(host))
    try:
        started = time.monotonic()
        run_pass(host)
        assert time.monotonic() - started < 20
        text = host.check_output("cat /var/lib/budgetgpu/gpu-health/jobs.prom")
        assert 'budgetgpu_job_last_step{job="good"} 7.0' in text and 'job="zero"' not in text
        lines = journal(host)[before:]
        for job, words in (
            ("zero", "a symbolic link, expected a regular file"),
            ("fifo", "not a regular file"),
            ("list", "a JSON list, expected a mapping"),
        ):
            assert [line for line in lines if f"job {job}: " in line and words in line], (job, lines)
        # The state cut (a crash, a full disk): a worker's ExecCondition starts it on a GPU in service.
        host.check_output(f"cp {STATE} /tmp/state.json && truncate -s 40 {STATE}")
        worker = host.run(f"runuser -u nobody -- /usr/local/bin/gpu-health check {GPUS[0]}")
        assert worker.rc == 0 and "no quarantine known beyond the inventory's" in worker.stderr
        assert host.run(f"runuser -u nobody -- /usr/local/bin/gpu-health check {LISTED}").rc == 1
    finally:
        host.check_output(f"rm -rf {root}/good {root}/zero {root}/fifo {root}/list")
        host.check_output(f"if [ -f /tmp/state.json ]; then cat /tmp/state.json > {STATE}; fi")
        run_pass(host)
    assert set(state(host)["quarantine"]) == {LISTED}
