"""roles/gpu_health/files/gpu-health: one watch pass over gpu_sim's NVML with injected faults, the state file, the
change lines (once), the quarantine, release; and the launcher leaving quarantined GPUs out."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from ansible_collections.budgetgpu.cluster.plugins.module_utils import pcie, sharding

REPO = Path(__file__).resolve().parents[3]
GPUS = [f"GPU-3090000{i}-5a1e-4c0d-9b7e-00000000000{i}" for i in range(4)]
XID_79 = (
    "Dec  1 02:00:00 node1 kernel: NVRM: Xid (PCI:0000:03:00): 79, pid=42, name=python3, GPU has fallen off the bus.\n"
)


def metrics(path: Path) -> dict[str, float]:
    """{'name{labels}': value} of a textfile, read by prometheus_client's parser (labels sorted, as
    prometheus_client writes them); every sample's family has its TYPE and HELP."""
    from prometheus_client.parser import text_string_to_metric_families

    found = {}
    for family in text_string_to_metric_families(path.read_text()):
        assert family.documentation and family.type in ("gauge", "counter", "unknown"), family
        for sample in family.samples:
            text = ",".join(f'{key}="{value}"' for key, value in sorted(sample.labels.items()))
            found[sample.name + ("{" + text + "}" if text else "")] = sample.value
    return found


def gpu_labels(index: int, bus: str) -> str:
    model = "NVIDIA GeForce RTX 3090"
    return f'{{Hostname="node1",UUID="{GPUS[index]}",gpu="{index}",modelName="{model}",pci_bus_id="0000000{bus}"}}'


@pytest.fixture
def watch(fake_pynvml, sim_tree, tmp_path, monkeypatch):
    """(script module, config, faults writer) for a 4x RTX 3090 node with a kern.log file."""
    from ansible_collections.budgetgpu.cluster.tests.unit.file_modules import load_file_module

    script = load_file_module("gpu_health_script", REPO / "roles" / "gpu_health" / "files" / "gpu-health")
    faults = tmp_path / "faults.json"
    monkeypatch.setenv("BUDGETGPU_SIM_FAULTS", str(faults))
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml("rtx3090x4-risers"))
    (tmp_path / "kern.log").write_text("")
    root = sim_tree("rtx3090x4-risers")
    config = {
        "host": "node1",
        "state_file": str(tmp_path / "state.json"),
        "sysfs_root": root,
        "kernel_log": str(tmp_path / "kern.log"),
        "quarantine": [GPUS[1]],
        "boot_links": script.gpu_health.boot_links(pcie.probe_pcie(root)),
    }

    def inject(**by_gpu: dict) -> None:
        faults.write_text(json.dumps({GPUS[int(key[3:])]: value for key, value in by_gpu.items()}))

    return script, config, inject


def test_health_sample_reads_fans_ecc_and_the_injected_faults(watch):
    script, config, inject = watch
    inject(gpu2={"fans": [{"speed": 0, "target": 80}], "temp": 88, "pcie_replay": 500, "pcie_width_cur": 1})
    gpus = script.take_sample(config)["gpus"]
    assert [gpu["uuid"] for gpu in gpus] == GPUS
    assert (
        gpus[0]["fans"] == [{"speed_pct": 30, "target_pct": 30}] and gpus[0]["ecc_double_bit_volatile"] == "unsupported"
    )
    assert gpus[2]["fans"] == [{"speed_pct": 0, "target_pct": 80}] and gpus[2]["temperature_c"] == 88
    assert (gpus[2]["pcie"]["width_current"], gpus[2]["pcie"]["replay_counter"]) == (1, 500)
    assert gpus[2]["aer"]["correctable"].endswith("TOTAL_ERR_COR 0\n")  # render_sim's zeroed counters
    inject(gpu3={"gone": True})
    assert [gpu["uuid"] for gpu in script.take_sample(config)["gpus"]] == GPUS[:3]


def test_a_pass_quarantines_logs_each_change_once_and_release_returns_the_gpu(watch, tmp_path):
    script, config, inject = watch
    assert script.run_pass(config, "t0") == []
    assert script.read_json(config["state_file"])["quarantine"] == {
        GPUS[1]: {"by": "inventory", "reason": "listed in gpu_health_quarantine", "since": None}
    }
    inject(gpu2={"fans": [{"speed": 0, "target": 80}], "temp": 88, "pcie_replay": 500, "pcie_width_cur": 1})
    with open(config["kernel_log"], "a") as log:
        log.write(XID_79)
    lines = script.run_pass(config, "t1")
    assert any("fan 0% (target 80%) at 88 C" in line for line in lines)
    assert any("Xid 79" in line for line in lines) and any("PCIe link now x1, x4 at boot" in line for line in lines)
    inject(gpu2={"fans": [{"speed": 0, "target": 80}], "temp": 88, "pcie_replay": 1000, "pcie_width_cur": 1})
    again = script.run_pass(config, "t2")
    assert not [line for line in again if not line.startswith("cleared")]  # only the Xid, an event, clears
    state = script.read_json(config["state_file"])
    assert state["quarantine"][GPUS[2]]["since"] == "t1" and state["gpus"][GPUS[2]]["status"] == "take_out"
    assert Path(config["state_file"]).stat().st_mode & 0o777 == 0o644
    code, message = script.release(config, "GPU-bad", "t3")
    assert code == 2 and message.startswith("node1: GPU GPU-bad is not quarantined here, expected one of")
    assert GPUS[1] in message and GPUS[2] in message
    assert script.release(config, GPUS[1], "t3") == (
        2,
        f"node1: GPU {GPUS[1]} is listed in gpu_health_quarantine: remove it there and provision again",
    )
    inject()
    script.run_pass(config, "t4")
    code, message = script.release(config, GPUS[2], "t5")
    assert code == 0 and "released (take_out -> " in message
    assert script.run_pass(config, "t6") == [] and set(script.read_json(config["state_file"])["quarantine"]) == {
        GPUS[1]
    }


def test_release_as_root_follows_no_link_planted_as_the_watchs_lock_file(watch, tmp_path):
    """The watch's directory is its user's; root's release opens the lock file there. A link the watch user
    planted must not make root create (or lock) its target, and the state stays as it was."""
    script, config, _inject = watch
    script.run_pass(config, "t0")
    before = Path(config["state_file"]).read_bytes()
    target = tmp_path / "elsewhere" / "made-by-root"
    target.parent.mkdir()
    lock = Path(config["state_file"] + ".lock")
    lock.unlink()  # the pass's
    lock.symlink_to(target)
    code, message = script.release(config, GPUS[2], "t1")
    assert code == 2 and message.startswith(f"node1: cannot release GPU {GPUS[2]} ({config['state_file']}): ")
    assert message.endswith("nothing changed")
    assert not target.exists()
    assert Path(config["state_file"]).read_bytes() == before


def test_release_does_not_wait_on_a_fifo_planted_as_the_lock_file(watch):
    script, config, _inject = watch
    os.mkfifo(config["state_file"] + ".lock")
    # Opening a FIFO to read blocks until a writer comes: the alarm ends a release that waits.
    signal.signal(signal.SIGALRM, lambda *_args: pytest.fail("release waited on the FIFO"))
    signal.alarm(5)
    try:
        code, message = script.release(config, GPUS[2], "t1")
    finally:
        signal.alarm(0)
    assert code == 2 and "is not a regular file: remove it" in message


def test_a_kern_log_created_after_a_pass_is_read_from_its_start(watch):
    script, config, _inject = watch
    Path(config["kernel_log"]).unlink()
    script.run_pass(config, "t0")
    Path(config["kernel_log"]).write_text(XID_79)
    assert any("Xid 79" in line for line in script.run_pass(config, "t1"))


def test_one_pass_on_a_4_gpu_node_costs_under_100_ms_of_cpu(watch):
    script, config, inject = watch
    inject(gpu2={"fans": [{"speed": 0, "target": 80}], "temp": 88, "pcie_replay": 500})
    script.run_pass(config, "t0")
    start, passes = time.process_time(), 20
    for n in range(passes):
        script.run_pass(config, f"t{n + 1}")
    assert (time.process_time() - start) / passes < 0.1


def launcher_argv(state: dict, tmp_path, nproc: int, fixed: bool, **extra: str) -> tuple[list[str] | None, dict]:
    from ansible_collections.budgetgpu.cluster.tests.unit.file_modules import load_file_module

    launcher = load_file_module("budgetgpu_torchrun", REPO / "roles" / "torchrun" / "files" / "budgetgpu-torchrun")
    (tmp_path / "state.json").write_text(json.dumps(state))
    env = {
        "BUDGETGPU_GPUS": ",".join(GPUS),
        "BUDGETGPU_NPROC_FIXED": "1" if fixed else "0",
        "BUDGETGPU_GPU_HEALTH_STATE": str(tmp_path / "state.json"),
        "BUDGETGPU_GPU_HEALTH_UTILS": str(REPO / "plugins" / "module_utils" / "gpu_health.py"),
        **extra,
    }
    return launcher.gpu_health_argv(["--max-restarts=3", f"--nproc-per-node={nproc}", "train.py"], env), env


OUT = {"quarantine": {GPUS[2]: {"reason": "GPU 2: fan 0%", "since": "t1", "by": "watch"}}}


def test_the_launcher_leaves_a_quarantined_gpu_out(tmp_path, capsys):
    argv, env = launcher_argv(OUT, tmp_path, 4, fixed=False)
    assert argv == ["--max-restarts=3", "--nproc-per-node=3", "train.py"]
    assert env["CUDA_VISIBLE_DEVICES"] == ",".join([GPUS[0], GPUS[1], GPUS[3]])
    assert f"3 of 4 GPUs: left out {GPUS[2]} quarantined since t1 (GPU 2: fan 0%)" in capsys.readouterr().out
    # The ranks learn what the node planned and what was left out: they keep the global batch (sharding).
    assert env[sharding.PLANNED_LOCAL_ENV] == "4"
    assert env[sharding.LEFT_OUT_ENV].endswith(
        f": 3 of 4 GPUs: left out {GPUS[2]} quarantined since t1 (GPU 2: fan 0%)"
    )


def test_the_launcher_holds_a_fixed_size_job_that_needs_the_gpu(tmp_path, capsys):
    assert launcher_argv(OUT, tmp_path, 4, fixed=True)[0] is None
    assert "held, not started: nproc_per_node is fixed at 4" in capsys.readouterr().out
    argv, env = launcher_argv(OUT, tmp_path, 2, fixed=True)  # GPUs 0 and 1: none of them is out
    assert argv[1] == "--nproc-per-node=2" and "CUDA_VISIBLE_DEVICES" not in env


def test_the_launcher_holds_an_hsdp_job_rather_than_run_a_node_short(tmp_path, capsys):
    assert launcher_argv(OUT, tmp_path, 4, fixed=False, BUDGETGPU_PARALLELISM="hsdp")[0] is None
    assert "held, not started: nproc_per_node is fixed at 4 and " in (out := capsys.readouterr().out)
    assert "(hsdp needs as many ranks on every node); release a GPU" in out


def test_the_launcher_without_a_watch_starts_as_before(tmp_path):
    argv, env = launcher_argv({}, tmp_path, 4, fixed=False)
    assert argv[1] == "--nproc-per-node=4" and "CUDA_VISIBLE_DEVICES" not in env
    assert env[sharding.PLANNED_LOCAL_ENV] == "4" and sharding.LEFT_OUT_ENV not in env


def test_check_tells_an_inference_worker_whether_its_gpu_is_in_service(watch):
    script, config, _inject = watch
    script.run_pass(config, "t0")
    assert script.check(config, GPUS[0]) == (0, f"GPU {GPUS[0]} is in service")
    assert script.check(config, GPUS[1]) == (
        1,
        f"node1: not starting: {GPUS[1]} quarantined (listed in gpu_health_quarantine)",
    )


def test_fact_prints_the_quarantine_for_ansibles_local_facts(watch, tmp_path, capsys):
    script, config, _inject = watch
    script.run_pass(config, "t0")
    (tmp_path / "cfg.json").write_text(json.dumps(config))
    assert script.main(["--config", str(tmp_path / "cfg.json"), "fact"]) == 0
    fact = json.loads(capsys.readouterr().out)
    assert fact == {
        "quarantine": {GPUS[1]: {"by": "inventory", "reason": "listed in gpu_health_quarantine", "since": None}},
        "updated": "t0",
    }


def test_the_launcher_starts_as_before_when_it_cannot_read_the_state(tmp_path, capsys):
    from ansible_collections.budgetgpu.cluster.tests.unit.file_modules import load_file_module

    launcher = load_file_module("budgetgpu_torchrun", REPO / "roles" / "torchrun" / "files" / "budgetgpu-torchrun")
    (tmp_path / "state.json").write_text("{half a file")
    env = {
        "BUDGETGPU_GPUS": ",".join(GPUS),
        "BUDGETGPU_GPU_HEALTH_STATE": str(tmp_path / "state.json"),
        "BUDGETGPU_GPU_HEALTH_UTILS": str(REPO / "plugins" / "module_utils" / "gpu_health.py"),
    }
    assert launcher.gpu_health_argv(["--nproc-per-node=4", "train.py"], env) == ["--nproc-per-node=4", "train.py"]
    assert "cannot read the GPU health state" in capsys.readouterr().out


def test_a_pass_writes_the_metrics_file_atomically_with_the_dead_fan(watch, tmp_path):
    script, config, inject = watch
    config["metrics_file"] = str(tmp_path / "gpu.prom")
    script.run_pass(config, "t0")
    values = metrics(tmp_path / "gpu.prom")
    assert len([key for key in values if key.startswith("DCGM_FI_DEV_GPU_TEMP{")]) == 4
    assert values[f"budgetgpu_gpu_quarantined{gpu_labels(1, '0:02:00.0')}"] == 1
    assert not [key for key in values if "kind=" in key]
    assert not (tmp_path / "gpu.prom.tmp").exists()
    inject(gpu2={"fans": [{"speed": 0, "target": 80}], "temp": 88})
    with open(config["kernel_log"], "a") as log:
        log.write(XID_79)
    script.run_pass(config, "t1")
    values = metrics(tmp_path / "gpu.prom")
    labels = gpu_labels(2, "0:03:00.0")
    finding = labels.replace('gpu="2",', 'gpu="2",kind="dead_fan",')  # labels sorted by name
    assert values[f"budgetgpu_gpu_health_finding{finding}"] == 1
    assert values[f"DCGM_FI_DEV_XID_ERRORS{labels}"] == 79 and values[f"budgetgpu_gpu_xid_errors_total{labels}"] == 1


def test_the_exposition_is_prometheus_clients_with_dcgm_names_kept_and_labels_escaped(watch):
    script, _config, _inject = watch
    samples = [
        ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", {"gpu": "0", "modelName": 'odd "card"\\x'}, 900.0),
        ("budgetgpu_gpu_xid_errors_total", {"gpu": "0"}, 2.0),
        ("DCGM_FI_DEV_GPU_TEMP", {"gpu": "0"}, 88.0),
    ]
    text = script.textfile.exposition(script.gpu_metrics.METRICS, samples)
    # In METRICS' order; dcgm-exporter's counter keeps its name (untyped), ours is a counter with _total.
    assert text.splitlines() == [
        "# HELP DCGM_FI_DEV_GPU_TEMP GPU temperature (in C).",
        "# TYPE DCGM_FI_DEV_GPU_TEMP gauge",
        'DCGM_FI_DEV_GPU_TEMP{gpu="0"} 88.0',
        "# HELP DCGM_FI_DEV_PCIE_REPLAY_COUNTER Total number of PCIe retries.",
        "# TYPE DCGM_FI_DEV_PCIE_REPLAY_COUNTER untyped",
        'DCGM_FI_DEV_PCIE_REPLAY_COUNTER{gpu="0",modelName="odd \\"card\\"\\\\x"} 900.0',
        "# HELP budgetgpu_gpu_xid_errors_total Xid errors the health watch read in the kernel log.",
        "# TYPE budgetgpu_gpu_xid_errors_total counter",
        'budgetgpu_gpu_xid_errors_total{gpu="0"} 2.0',
    ]
    assert script.textfile.exposition(script.job_metrics.METRICS, []) == ""


def test_a_pass_exports_the_jobs_status_and_drops_the_rate_once_the_unit_stopped(watch, tmp_path, monkeypatch):
    script, config, _inject = watch
    root = tmp_path / "jobs"
    (root / "demo").mkdir(parents=True)
    (root / "other").mkdir()  # a job whose rank 0 runs elsewhere: no status here, no metrics
    status = {"step": 40, "steps_per_s": 7.5, "world": 2, "straggler_ratio": 1.02, "straggler_threshold": 0.15}
    status["ranks"] = [{"rank": 0, "host": "node1", "step_s": 0.05}, {"rank": 1, "host": "node2", "step_s": 0.051}]
    (root / "demo" / "status.json").write_text(json.dumps({**status, "time": time.time() - 3}))
    config.update(jobs_root=str(root), jobs_metrics_file=str(tmp_path / "jobs.prom"), job_stale_after_s=600)
    asked = []

    def systemctl(argv, **kwargs):
        asked.append(argv)
        state = "active" if len(asked) == 1 else "inactive"
        return script.subprocess.CompletedProcess(argv, 0, f"Id=budgetgpu-job-demo.service\nActiveState={state}\n", "")

    monkeypatch.setattr(script.subprocess, "run", systemctl)
    script.write_text(config["jobs_metrics_file"], script.job_metrics_text(config))
    assert asked == [["systemctl", "show", "--property=Id,ActiveState", "budgetgpu-job-demo.service"]]
    values = metrics(tmp_path / "jobs.prom")
    assert values['budgetgpu_job_steps_per_second{job="demo"}'] == 7.5
    assert values['budgetgpu_job_step_seconds{job="demo",node="node2",rank="1"}'] == 0.051
    assert not [key for key in values if 'job="other"' in key]
    script.write_text(config["jobs_metrics_file"], script.job_metrics_text(config))
    values = metrics(tmp_path / "jobs.prom")
    assert not [key for key in values if key.startswith("budgetgpu_job_steps_per_second")]
    assert values['budgetgpu_job_running{job="demo"}'] == 0
    assert values['budgetgpu_job_last_step{job="demo"}'] == 40


def test_root_restarts_a_gpu_job_on_a_gpu_the_pass_took_out_and_names_a_fixed_one(watch, tmp_path, monkeypatch):
    script, config, inject = watch
    envs = tmp_path / "jobs"
    envs.mkdir()
    (envs / "all.env").write_text('BUDGETGPU_JOB="all"\nBUDGETGPU_NPROC_FIXED="0"\n')
    (envs / "fixed.env").write_text('BUDGETGPU_JOB="fixed"\nBUDGETGPU_NPROC_FIXED="1"\n')
    (envs / "stopping.env").write_text('BUDGETGPU_NPROC_FIXED="0"\n')
    config["jobs_env_dir"] = str(envs)

    def unit(job: str, minors: tuple[int, ...], state: str = "active") -> str:
        allow = "".join(f"DeviceAllow=/dev/char/195:{minor} rw\n" for minor in (*minors, 255))
        return f"Id=budgetgpu-job-{job}.service\nActiveState={state}\nDevicePolicy=closed\n{allow}"

    shown = {f"budgetgpu-job-{job}.service": unit(job, minors) for job, minors in
             (("all", (0, 1, 2, 3)), ("fixed", (0, 1, 2, 3)), ("two", (0, 1)))}  # fmt: skip
    # Someone is stopping this one: the watch does not start it again.
    shown["budgetgpu-job-stopping.service"] = unit("stopping", (0, 1, 2, 3), "deactivating")
    calls = []

    def systemctl(*args):
        calls.append(args)
        out = ""
        if args[0] == "list-units":
            out = "".join(f"{unit} loaded active running x\n" for unit in [*shown, "budgetgpu-job-start@all.service"])
        elif args[0] == "show":
            out = "\n\n".join(shown[unit] for unit in args[2:])
        return script.subprocess.CompletedProcess(args, 0, out, "")

    monkeypatch.setattr(script, "systemctl", systemctl)
    script.run_pass(config, "t0")
    assert script.restart_jobs(config) == [] and calls == []  # nothing new: systemd is not even asked
    inject(gpu2={"fans": [{"speed": 0, "target": 80}], "temp": 88})
    script.run_pass(config, "t1")
    lines = script.restart_jobs(config)
    assert [call for call in calls if call[0] == "restart"] == [("restart", "--no-block", "budgetgpu-job-all.service")]
    assert lines[0].startswith(f"take_out: job budgetgpu-job-all.service restarted: {GPUS[2]} quarantined since t1")
    assert lines[0].endswith("nproc_per_node is gpu: it restarts on the GPUs still in service")
    assert lines[1].startswith(f"warn: job budgetgpu-job-fixed.service not restarted: {GPUS[2]} quarantined")
    assert len(lines) == 2  # the job on GPUs 0 and 1 holds nothing taken out
    script.run_pass(config, "t2")
    calls.clear()
    assert script.restart_jobs(config) == [] and calls == []
