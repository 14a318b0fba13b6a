"""The benchmark on a node: gpu_bench_measure.py's time bound with stand-in devices, and
`gpu-probe --bench` run for real on the simulated 4x RTX 3090 tree (gpu_sim's drop-in NVML and its
simulated device, torch's CPU build), with a thermal throttle injected through the faults file."""

from __future__ import annotations

import getpass
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ansible_collections.budgetgpu.cluster.plugins.module_utils import gpu_bench_measure

REPO = Path(__file__).resolve().parents[3]
SIM_FILES = REPO / "roles" / "gpu_sim" / "files"
PROFILE = SIM_FILES / "profiles" / "rtx3090x4-risers.json"
HOT = "GPU-30900002-5a1e-4c0d-9b7e-000000000002"


class SteadyDevice:
    """A device that answers in a fixed time per iteration, at once."""

    def matmul_seconds(self, index, dtype, n, iters):
        return iters * 2 * n**3 / 20e12

    def memory_seconds(self, index, nbytes, iters):
        return iters * 2 * nbytes / 800e9

    def copy_seconds(self, index, direction, nbytes, iters):
        return iters * nbytes / (12e9 if direction == "h2d" else 13e9)


class HungDevice(SteadyDevice):
    """A device whose every call takes wall time: the bound has to stop it."""

    def matmul_seconds(self, index, dtype, n, iters):
        time.sleep(0.15)
        return 0.15


def test_figures_come_from_the_device_time():
    figures = gpu_bench_measure.measure_gpu(SteadyDevice(), 0, ["fp32", "fp16"], 10)
    assert figures["matmul_tflops"] == {"fp32": 20.0, "fp16": 20.0}
    assert (figures["memory_gbs"], figures["h2d_gbs"], figures["d2h_gbs"]) == (800.0, 12.0, 13.0)
    assert not figures["timed_out"]


def test_each_gpu_is_bounded_in_time():
    start = time.monotonic()
    figures = gpu_bench_measure.measure_gpu(HungDevice(), 0, ["fp32", "fp16", "bf16"], 0.4)
    assert time.monotonic() - start < 1.5
    assert figures["timed_out"] and figures["memory_gbs"] is None and "bf16" not in figures["matmul_tflops"]


@pytest.fixture
def sim_node(tmp_path, sim_tree):
    """What gpu_sim puts on a node, under tmp_path: the tree, the drop-in and device, a faults file."""
    pytest.importorskip("torch", reason="torch (CPU) from .cache/wheelhouse is not installed in this venv")
    lib = tmp_path / "sim-lib"
    lib.mkdir()
    for name in ("pynvml.py", "sim_device.py"):
        shutil.copy(SIM_FILES / name, lib / name)
    faults = tmp_path / "faults.json"
    # Bad thermal paste: hardware thermal slowdown, the SM clock 30% under its 2100 MHz.
    faults.write_text(json.dumps({HOT: {"throttle": 64, "sm_clock": 1470, "temp": 91}}))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(lib), os.environ.get("PYTHONPATH")])),
        "BUDGETGPU_SIM_LIB": str(lib),
        "BUDGETGPU_SIM_PROFILE": str(PROFILE),
        "BUDGETGPU_SIM_FAULTS": str(faults),
        "BUDGETGPU_SIM_STATE": str(tmp_path / "state.json"),
        "OMP_NUM_THREADS": "1",
    }
    return sim_tree("rtx3090x4-risers"), env


def bench(sim_node, *options: str) -> subprocess.CompletedProcess[str]:
    root, env = sim_node
    probe = REPO / "roles" / "probe" / "files" / "gpu-probe"
    argv = [sys.executable, str(probe), "--bench", "--backend", "sim", "--sysfs-root", root]
    # The test's own interpreter as the job venv's, as the user who runs the test (root on CI).
    argv += ["--python", sys.executable, "--user", getpass.getuser(), "--seconds", "30", *options]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=False)


def test_gpu_probe_bench_finds_the_hot_card_and_the_riser(sim_node):
    done = bench(sim_node)
    assert done.returncode == 1, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[:4] == ["HOST", "GPU", "NAME", "FP32"]
    hot = next(line for line in lines if line.startswith("straggler:") and " GPU 2 " in line)
    assert "30% slower than the median of its model (4 GPU(s)" in hot
    assert "thermal throttling (hw_thermal_slowdown during the run, up to 91 C)" in hot
    link = next(line for line in lines if line.startswith("link:"))
    assert (
        " GPU 3 (0000:04:00.0): H2D 0.84 GB/s, D2H 0.84 GB/s, link x1 gen3 (limiting hop 0000:00:1d.0) carries "
        "0.98 GB/s: the link trained at x1 although both ends support x4" in link
    )
    assert [line for line in lines if line.startswith(("straggler:", "link:"))] == [
        line for line in lines if " GPU 2 " in line or " GPU 3 " in line
    ]


def test_gpu_probe_bench_json_carries_the_samples_and_the_report(sim_node):
    done = bench(sim_node, "--json", "--gpus", "1,2")
    assert done.returncode == 1, done.stderr
    data = json.loads(done.stdout)
    assert data["backend"] == "sim" and [gpu["index"] for gpu in data["gpus"]] == [1, 2]
    hot = data["gpus"][1]
    assert hot["dtypes"] == ["fp32", "fp16", "bf16"] and hot["device_id"] == "0x2204"
    assert hot["samples"]["throttle_reasons"] == ["hw_thermal_slowdown"] and hot["samples"]["count"] >= 2
    assert hot["link"] == {
        "gen": 3,
        "width": 4,
        "bandwidth_gbps": 3.94,
        "capable_gen": 3,
        "capable_width": 4,
        "limiting_hop": "0000:00:1c.4",
    }
    ratio = hot["matmul_tflops"]["fp32"] / data["gpus"][0]["matmul_tflops"]["fp32"]
    assert ratio == pytest.approx(0.7, abs=0.01)
    assert data["report"]["gpus"][1]["straggler"] and not data["report"]["gpus"][0]["straggler"]


def test_gpu_probe_bench_check_says_whether_gpus_are_free(sim_node):
    done = bench(sim_node, "--check")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(": GPUs free")


def test_the_plot_draws_every_gpu_against_its_peer_median(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib (the control node's) is not installed in this venv")
    from ansible_collections.budgetgpu.cluster.plugins.module_utils import gpu_bench
    from ansible_collections.budgetgpu.cluster.tests.unit.plugins.module_utils.test_gpu_bench import gpu

    report = tmp_path / "gpu-bench.json"
    report.write_text(json.dumps(gpu_bench.analyze([gpu(0), gpu(1, 0.7), gpu(2)])))
    png = tmp_path / "gpu-bench.png"
    done = subprocess.run(
        [sys.executable, str(REPO / "playbooks" / "files" / "gpu_bench_plot.py"), str(report), str(png)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gpu_probe_bench_check_refuses_the_gpus_a_running_jobs_unit_may_open_and_no_other(sim_node, tmp_path):
    # A job of nproc_per_node 1 on GPU 1: its unit's DeviceAllow= (jobs.job_gpus) opens 195:1 and nvidiactl.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    systemctl = bin_dir / "systemctl"
    systemctl.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        "list-units) echo 'budgetgpu-job-main.service loaded active running budgetgpu job main' ;;\n"
        "show) printf 'DevicePolicy=closed\\nDeviceAllow=/dev/char/195:255 rw\\nDeviceAllow=/dev/char/195:1 rw\\n' ;;\n"
        "esac\n"
    )
    systemctl.chmod(0o755)
    root, env = sim_node
    done = bench((root, {**env, "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}"}), "--check", "--json")
    assert done.returncode == 3, done.stderr
    busy = json.loads(done.stdout)["busy"]
    assert list(busy.values()) == ["job budgetgpu-job-main.service holds it"], busy
    assert "GPU 1 (" in json.loads(done.stdout)["refusal"] and "GPU 0 (" not in json.loads(done.stdout)["refusal"]
