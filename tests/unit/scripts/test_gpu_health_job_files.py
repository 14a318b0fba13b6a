"""roles/gpu_health/files/gpu-health against what a job's user can put in its own directory (issue 24): a status file
that is a JSON list, a 400-digit integer, a lone surrogate, a FIFO, a link to /dev/zero, 2 MB, 100,000
ranks; each costs that job's metrics only, the pass stays on time; and the watch's own state.json empty
or cut means "no quarantine known" (beyond the inventory's), logged, never "skip every worker".

The bad files are read in a child process with an address-space limit and a timeout: on a watch that
follows the link to /dev/zero or blocks on the FIFO the test fails, and the machine keeps its memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from ansible_collections.budgetgpu.cluster.tests.unit.scripts import test_gpu_health_script as base

GPUS = base.GPUS
watch = base.watch  # the fixture: a 4x RTX 3090 node of gpu_sim with a kern.log

REPO = Path(__file__).resolve().parents[3]
GOOD = {"step": 40, "steps_per_s": 7.5, "world": 2, "straggler_ratio": 1.02, "straggler_threshold": 0.15}
GOOD["ranks"] = [{"rank": 0, "host": "node1", "step_s": 0.05}, {"rank": 1, "host": "node2", "step_s": 0.051}]
# A child that reads the jobs' files as one pass does, under 1 GiB of address space and 20 s.
CHILD = textwrap.dedent(
    """
    import importlib.machinery, importlib.util, json, resource, sys, time
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    loader = importlib.machinery.SourceFileLoader("gpu_health_script", sys.argv[1])
    script = importlib.util.module_from_spec(importlib.util.spec_from_loader("gpu_health_script", loader))
    loader.exec_module(script)
    started = time.monotonic()
    refused = []
    text = script.job_metrics_text({"jobs_root": sys.argv[2], "job_stale_after_s": 600}, refused)
    print(json.dumps({"text": text, "refused": refused, "seconds": time.monotonic() - started}))
    """
)


def plant(root: Path) -> None:
    """Two good jobs around every bad file a job's user can write (the names sort them in between)."""
    now = time.time()

    def status(name: str, data: bytes) -> None:
        (root / name).mkdir()
        (root / name / "status.json").write_bytes(data)

    status("a-good", json.dumps({**GOOD, "time": now}).encode())
    status("big", json.dumps({**GOOD, "time": now, "pad": "x" * 2_000_000}).encode())  # 2 MB
    status("huge-int", b'{"step": 1' + b"0" * 399 + b"}")
    status("list", b"[1, 2, 3]")
    status("ranks", json.dumps({"time": now, "ranks": [{}] * 100_000}).encode())
    status("surrogate", json.dumps({**GOOD, "time": now, "ranks": [{"rank": 0, "host": "\ud800"}]}).encode())
    (root / "fifo").mkdir()
    os.mkfifo(root / "fifo" / "status.json")
    (root / "zero").mkdir()
    (root / "zero" / "status.json").symlink_to("/dev/zero")
    status("z-good", json.dumps({**GOOD, "time": now}).encode())


def test_each_bad_status_file_costs_only_its_jobs_metrics_and_the_pass_stays_on_time(tmp_path):
    root = tmp_path / "jobs"
    root.mkdir()
    plant(root)
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    done = subprocess.run(
        [sys.executable, str(child), str(REPO / "roles" / "gpu_health" / "files" / "gpu-health"), str(root)],
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout)
    text, refused = got["text"], got["refused"]
    running = {line.split('"')[1] for line in text.splitlines() if line.startswith("budgetgpu_job_running{")}
    # The surrogate is replaced (U+FFFD): the text is written, as UTF-8, with that job's metrics in it.
    assert running == {"a-good", "z-good", "surrogate"}, text
    assert 'budgetgpu_job_step_seconds{job="surrogate",rank="0",node="\ufffd"}' not in text  # no step_s
    text.encode("utf-8")
    reasons = {line.split(":")[0]: line for line in refused}
    assert set(reasons) == {"job big", "job huge-int", "job list", "job ranks", "job fifo", "job zero"}, refused
    assert "expected at most 1048576" in reasons["job big"]
    assert "an integer of 400 digits" in reasons["job huge-int"]
    assert "a JSON list, expected a mapping" in reasons["job list"]
    assert "100000 ranks, expected at most 1024" in reasons["job ranks"]
    assert "not a regular file" in reasons["job fifo"]
    assert "a symbolic link, expected a regular file" in reasons["job zero"]
    assert f"{root}/zero/status.json refused" in reasons["job zero"]
    # On time: the watch's unit gives a pass 50 s; these files cost well under one.
    assert got["seconds"] < 2, got["seconds"]


def test_a_pass_logs_each_refused_status_as_a_warning_and_writes_the_others(watch, tmp_path, monkeypatch):
    script, config, _inject = watch
    root = tmp_path / "jobs"
    (root / "demo").mkdir(parents=True)
    (root / "demo" / "status.json").write_text(json.dumps({**GOOD, "time": time.time()}))
    (root / "bad").mkdir()
    (root / "bad" / "status.json").write_text("[]")
    config.update(jobs_root=str(root), jobs_metrics_file=str(tmp_path / "jobs.prom"), job_stale_after_s=600)
    monkeypatch.setattr(
        script.subprocess,
        "run",
        lambda argv, **kw: script.subprocess.CompletedProcess(
            argv, 0, "Id=budgetgpu-job-demo.service\nActiveState=active\n", ""
        ),
    )
    lines = script.run_pass(config, "t0")
    assert f"warn: job bad: {root}/bad/status.json refused: a JSON list, expected a mapping" in lines
    values = metrics(tmp_path / "jobs.prom")
    assert values['budgetgpu_job_running{job="demo"}'] == 1 and not [key for key in values if 'job="bad"' in key]


def test_the_state_is_written_with_fsync_of_the_file_and_its_directory(watch, monkeypatch):
    script, config, _inject = watch
    synced = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(script.os, "fsync", fsync)
    script.run_pass(config, "t0")
    state = config["state_file"]
    directory = os.path.dirname(state)
    # The data before the rename, the directory (the rename itself) after it.
    assert [os.path.dirname(path) for path in synced] == [directory, os.path.dirname(directory)]
    assert synced[1] == directory and os.path.basename(synced[0]).startswith(".state.")
    assert json.loads(Path(state).read_text())["updated"] == "t0"
    assert [name for name in os.listdir(directory) if name.startswith(".state.")] == []


def test_an_empty_or_cut_state_means_no_quarantine_known_logged_never_skip_every_worker(watch, tmp_path, capsys):
    script, config, _inject = watch
    (tmp_path / "cfg.json").write_text(json.dumps(config))
    state = Path(config["state_file"])
    for text in ("", '{"quarantine": {"' + GPUS[2] + '": {"by": "wa'):
        state.write_text(text)
        # GPU 0 is in service; GPU 1 stays out: the inventory lists it (the config, not the state).
        assert script.main(["--config", str(tmp_path / "cfg.json"), "check", GPUS[0]]) == 0
        err = capsys.readouterr().err
        assert f"{state} cannot be read" in err and "no quarantine known beyond the inventory's" in err
        assert script.main(["--config", str(tmp_path / "cfg.json"), "check", GPUS[1]]) == 1
        assert "listed in gpu_health_quarantine" in capsys.readouterr().err
        assert script.main(["--config", str(tmp_path / "cfg.json"), "fact"]) == 0
        assert json.loads(capsys.readouterr().out) == {"quarantine": {}, "updated": None}
        # The next pass logs it and writes the state anew.
        lines = script.run_pass(config, "t1")
        assert any(line.startswith(f"warn: {state} cannot be read") for line in lines), lines
        assert set(json.loads(state.read_text())["quarantine"]) == {GPUS[1]}


metrics = base.metrics
labels = base.gpu_labels


def test_a_gpu_off_the_bus_keeps_its_series_present_0_quarantined_1_and_its_xid(watch, tmp_path):
    script, config, inject = watch
    config["metrics_file"] = str(tmp_path / "gpu.prom")
    script.run_pass(config, "t0")
    # GPU 2 (0000:03:00.0) falls off the bus: Xid 79 in the kernel log, NVML no longer lists it.
    inject(gpu2={"gone": True})
    with open(config["kernel_log"], "a") as log:
        log.write(base.XID_79)
    script.run_pass(config, "t1")
    for _pass in range(2):  # and it stays so, pass after pass
        values = metrics(tmp_path / "gpu.prom")
        gone = labels(2, "0:03:00.0")
        assert values[f"budgetgpu_gpu_present{gone}"] == 0 and values[f"budgetgpu_gpu_quarantined{gone}"] == 1
        assert values[f"DCGM_FI_DEV_XID_ERRORS{gone}"] == 79 and values[f"budgetgpu_gpu_xid_errors_total{gone}"] == 1
        assert f"DCGM_FI_DEV_GPU_TEMP{gone}" not in values
        assert values[f"budgetgpu_gpu_present{labels(0, '0:01:00.0')}"] == 1
        assert values['budgetgpu_gpu_health_gpus{Hostname="node1"}'] == 3
        assert values['budgetgpu_gpu_health_gpus_expected{Hostname="node1"}'] == 4
        script.run_pass(config, "t2")
    # Released, the gone GPU is forgotten: a card taken out of the node for good.
    assert script.release(config, GPUS[2], "t3")[0] == 0
    script.run_pass(config, "t4")
    values = metrics(tmp_path / "gpu.prom")
    assert values['budgetgpu_gpu_health_gpus_expected{Hostname="node1"}'] == 3
    assert not [key for key in values if GPUS[2] in key]


def test_a_gpu_the_probe_saw_and_the_watch_never_did_is_missing_from_the_first_pass(watch, tmp_path):
    script, config, inject = watch
    from ansible_collections.budgetgpu.cluster.plugins.module_utils import gpu_health, nvml_probe

    sample = nvml_probe.health_sample(sys.modules["pynvml"])  # the probe's view, all four GPUs
    config["expected_gpus"] = gpu_health.expected_gpus(sample)
    config["metrics_file"] = str(tmp_path / "gpu.prom")
    inject(gpu3={"gone": True})  # gone before the watch's first pass (a lost state, a card dead at boot)
    lines = script.run_pass(config, "t0")
    assert any("no longer listed by NVML" in line for line in lines), lines
    assert script.check(config, GPUS[3])[0] == 1
    values = metrics(tmp_path / "gpu.prom")
    assert values[f"budgetgpu_gpu_present{labels(3, '0:04:00.0')}"] == 0
    assert values[f"budgetgpu_gpu_quarantined{labels(3, '0:04:00.0')}"] == 1
    assert values['budgetgpu_gpu_health_gpus_expected{Hostname="node1"}'] == 4
