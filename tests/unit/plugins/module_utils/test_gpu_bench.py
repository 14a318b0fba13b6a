"""The GPU benchmark's analysis (plugins/module_utils/gpu_bench.py): each GPU against the median of
its model, stragglers with their cause, copies held back by their link, busy GPUs refused."""

from __future__ import annotations

import copy

import pytest
from ansible_collections.budgetgpu.cluster.plugins.module_utils import gpu_bench

RTX3090 = {"device_id": "0x2204", "name": "NVIDIA GeForce RTX 3090", "compute_capability": "8.6"}


def gpu(index: int, scale: float = 1.0, host: str = "node1", **more) -> dict:
    """A healthy RTX 3090 on a gen3 x16 link; scale multiplies its compute figures."""
    result = {
        "host": host,
        "index": index,
        "uuid": f"GPU-{host}-{index}",
        "bus_id": f"0000:0{index + 1}:00.0",
        **RTX3090,
        "matmul_tflops": {"fp32": 26.7 * scale, "fp16": 53.2 * scale, "bf16": 53.2 * scale},
        "memory_gbs": 795.0 * scale,
        "h2d_gbs": 13.1,
        "d2h_gbs": 13.2,
        "link": {
            "gen": 3,
            "width": 16,
            "bandwidth_gbps": 15.76,
            "capable_gen": 3,
            "capable_width": 16,
            "limiting_hop": "0000:00:01.0",
        },
        "samples": {
            "temperature_c_max": 71,
            "sm_clock_mhz_median": 1890,
            "sm_clock_max_mhz": 2100,
            "power_w_max": 340.0,
            "power_limit_w": 350.0,
            "throttle_reasons": [],
        },
        "timed_out": False,
    }
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = {**result[key], **value}
        else:
            result[key] = value
    return result


@pytest.mark.parametrize(
    ("capability", "dtypes"),
    [
        ("8.6", ["fp32", "fp16", "bf16"]),
        ("9.0", ["fp32", "fp16", "bf16"]),
        ("7.5", ["fp32", "fp16"]),
        ("5.3", ["fp32", "fp16"]),
        ("5.2", ["fp32"]),
        ("unsupported", ["fp32"]),
        (None, ["fp32"]),
    ],
)
def test_dtypes_follow_the_compute_capability(capability, dtypes):
    assert gpu_bench.dtypes_for(capability) == dtypes


def test_bad_thermal_paste_30_percent_slower_is_a_thermal_straggler():
    # The guide: "a GPU with bad thermal paste runs 30% slower, making the entire cluster run at that speed".
    hot = gpu(
        2,
        0.7,
        samples={
            "temperature_c_max": 91,
            "sm_clock_mhz_median": 1320,
            "throttle_reasons": ["hw_thermal_slowdown", "sw_thermal_slowdown"],
        },
    )
    report = gpu_bench.analyze([gpu(0), gpu(1), hot, gpu(3)])
    assert not report["passed"]
    (line,) = report["stragglers"]
    assert line.startswith(
        "node1 GPU 2 (0000:03:00.0, NVIDIA GeForce RTX 3090): 30% slower than the median of its model"
    )
    assert "thermal throttling (hw_thermal_slowdown, sw_thermal_slowdown during the run, up to 91 C)" in line
    assert "thermal paste" in line
    entry = report["gpus"][2]
    assert entry["straggler"] and entry["ratio"]["matmul_fp32"] == pytest.approx(0.7)
    assert [e["straggler"] for e in report["gpus"]] == [False, False, True, False]
    assert report["link_flags"] == []


def test_within_the_threshold_is_no_straggler_and_the_threshold_is_a_parameter():
    results = [gpu(0), gpu(1), gpu(2, 0.9), gpu(3)]
    assert gpu_bench.analyze(results)["passed"]
    tight = gpu_bench.analyze(results, threshold=0.05)
    assert len(tight["stragglers"]) == 1 and "10% slower" in tight["stragglers"][0]


def test_power_throttling_and_low_clocks_are_named_when_no_thermal_reason_was_seen():
    capped = gpu(1, 0.75, samples={"throttle_reasons": ["sw_power_cap"], "power_w_max": 250.0, "power_limit_w": 250.0})
    slow_clock = gpu(2, 0.75, samples={"sm_clock_mhz_median": 1200})
    report = gpu_bench.analyze([gpu(0), capped, slow_clock, gpu(3), gpu(4)])
    causes = {entry["index"]: entry["cause"] for entry in report["gpus"] if entry["straggler"]}
    assert causes[1].startswith("power throttling (sw_power_cap during the run, drew up to 250 W of a 250 W limit)")
    assert causes[2] == "low clocks: SM at 1200 MHz during the run, its peers at 1890 MHz"
    unexplained = gpu_bench.analyze([gpu(0), gpu(1, 0.6), gpu(2)])["gpus"][1]["cause"]
    assert unexplained.startswith("no throttle reason, link or clock explains it")


def test_models_are_compared_by_pci_device_id_not_by_name():
    # Drivers spell names differently; the device id identifies the model. A 4090 is faster, not a straggler
    # of the 3090s, and a 3090 named otherwise is still a 3090.
    renamed = gpu(1, 0.7, name="GeForce RTX 3090")
    rtx4090 = gpu(2, 2.3, device_id="0x2684", name="NVIDIA GeForce RTX 4090")
    report = gpu_bench.analyze([gpu(0), renamed, rtx4090, gpu(3)])
    assert [e["index"] for e in report["gpus"] if e["straggler"]] == [1]
    assert report["gpus"][1]["peers"] == 3 and report["gpus"][2]["peers"] == 1
    assert gpu_bench.model_key({"name": "x"}) == "name:x"


def test_a_riser_at_x1_is_flagged_with_the_link_that_limits_it():
    riser_link = {"gen": 3, "width": 1, "bandwidth_gbps": 0.985, "capable_width": 4, "limiting_hop": "0000:00:1d.0"}
    riser = gpu(3, h2d_gbs=0.84, d2h_gbs=0.83, link=riser_link)
    x4 = {"gen": 3, "width": 4, "bandwidth_gbps": 3.94, "capable_width": 4, "limiting_hop": "0000:00:1c.0"}
    report = gpu_bench.analyze(
        [gpu(0), gpu(1, h2d_gbs=3.35, d2h_gbs=3.3, link=x4), gpu(2, h2d_gbs=3.35, d2h_gbs=3.3, link=x4), riser]
    )
    (flag,) = report["link_flags"]
    assert flag == (
        "node1 GPU 3 (0000:04:00.0): H2D 0.84 GB/s, D2H 0.83 GB/s, link x1 gen3 (limiting hop 0000:00:1d.0) carries "
        "0.98 GB/s: the link trained at x1 although both ends support x4: reseat the riser or card"
    )
    (line,) = report["stragglers"]
    assert "a slow link: x1 gen3 carries 0.98 GB/s, its peers' 3.94 GB/s" in line
    # The x4 cards are as fast as their slots allow: no flag, no straggler.
    assert [e["link_flags"] for e in report["gpus"][:3]] == [[], [], []]


def test_a_copy_far_below_its_own_link_is_flagged_with_what_else_to_check():
    report = gpu_bench.analyze([gpu(0), gpu(1, h2d_gbs=5.1)])
    (flag,) = report["link_flags"]
    assert flag.startswith("node1 GPU 1 (0000:02:00.0): H2D 5.10 GB/s, far below the 15.76 GB/s its link x16 gen3")
    assert "pinned" in flag


def test_busy_gpus_are_refused_naming_host_gpu_and_the_override():
    gpus = [{"index": 0, "uuid": "GPU-a"}, {"index": 1, "uuid": "GPU-b"}]
    assert gpu_bench.busy_gpus(gpus, {}, {}, {}) == {}
    assert gpu_bench.refusal("node2", gpus, {}) is None
    worker = gpu_bench.busy_gpus(gpus, {}, {"budgetgpu-infer-chat@0.service": "GPU-b"}, {"GPU-a": []})
    assert worker == {"GPU-b": "inference worker budgetgpu-infer-chat@0.service uses it"}
    message = gpu_bench.refusal("node2", gpus, worker)
    assert message.startswith("node2: will not benchmark GPUs in use")
    assert "GPU 1 (GPU-b): inference worker budgetgpu-infer-chat@0.service uses it" in message
    assert "gpu_bench_force=true" in message and "GPU 0" not in message
    held = {"budgetgpu-job-main.service": {0, 1}}
    job = gpu_bench.busy_gpus(gpus, held, {}, {"GPU-a": [4242]})
    assert job["GPU-a"] == "job budgetgpu-job-main.service holds it; processes 4242 use it"
    assert set(job) == {"GPU-a", "GPU-b"}
    both = gpu_bench.refusal("node2", gpus, gpu_bench.busy_gpus(gpus, held, {}, {}))
    assert "GPU 0 (GPU-a), GPU 1 (GPU-b): job budgetgpu-job-main.service holds it: stop them" in both
    # A job of nproc_per_node 1 holds GPU 0 (jobs.job_gpus, its unit's DeviceAllow=): GPU 1 may be measured.
    assert gpu_bench.busy_gpus(gpus, {"budgetgpu-job-main.service": {0}}, {}, {}) == {
        "GPU-a": "job budgetgpu-job-main.service holds it"
    }


def test_the_table_shows_each_gpu_against_its_peers_and_the_verdict():
    results = [gpu(0), gpu(1), gpu(2, 0.7, samples={"throttle_reasons": ["gpu_idle", "hw_thermal_slowdown"]})]
    lines = gpu_bench.report_table(gpu_bench.analyze(copy.deepcopy(results)))
    assert lines[0].split()[:5] == ["HOST", "GPU", "NAME", "FP32", "FP16"]
    row = lines[3]
    assert "18.7 (-30%)" in row and "hw_thermal_slowdown" in row and "gpu_idle" not in row and "STRAGGLER" in row
    assert lines[1].rstrip().endswith("ok")
    assert lines[-1].startswith("1 straggler(s) and 0 copy flag(s) among 3 GPU(s)")
    assert gpu_bench.report_table(gpu_bench.analyze(results[:2]))[-1].startswith("2 GPU(s) within 15%")
