"""gpu_metrics: the watch's metric samples (dcgm-exporter names and labels where a twin exists), Xid counts
across passes, and what is left out. The text format is prometheus_client's (tests/unit/scripts/
test_gpu_health_script.py reads the watch's exposition back with prometheus_client's parser)."""

from __future__ import annotations

from ansible_collections.budgetgpu.cluster.plugins.module_utils import gpu_metrics

UUID = "GPU-30900002-5a1e-4c0d-9b7e-000000000002"
GPU = {
    "index": 2,
    "uuid": UUID,
    "name": "NVIDIA GeForce RTX 3090",
    "bus_id": "0000:04:00.0",
    "temperature_c": 88,
    "fans": [{"speed_pct": 0, "target_pct": 80}, {"speed_pct": 75, "target_pct": 80}],
    "power_draw_w": 251.5,
    "power_limit_w": 250.0,
    "energy_total_j": "unsupported",
    "sm_clock_mhz": 1695,
    "utilization_pct": 97,
    "pcie": {"gen_current": 3, "width_current": 1, "replay_counter": 900},
    "aer": {"correctable": "RxErr 2\nBadTLP 1\nTOTAL_ERR_COR 3\n", "nonfatal": None, "fatal": {"total": 0}},
}
STATE = {
    "gpus": {UUID: {"status": "take_out", "reasons": {"dead_fan": {}, "link_width": {}}}},
    "quarantine": {UUID: {"by": "watch", "reason": "fan dead?", "since": "t1"}},
}
LABELS = (
    'gpu="2",UUID="GPU-30900002-5a1e-4c0d-9b7e-000000000002",pci_bus_id="00000000:04:00.0",'
    'modelName="NVIDIA GeForce RTX 3090",Hostname="node1"'
)


def keyed(samples: list) -> dict[str, float]:
    """Return {'name{labels}': value}, labels in the order the samples give them, each name in METRICS."""
    found = {}
    for name, labels, value in samples:
        assert name in gpu_metrics.METRICS and isinstance(value, float), (name, value)
        text = ",".join(f'{key}="{val}"' for key, val in labels.items())
        found[name + ("{" + text + "}" if text else "")] = value
    return found


def test_dcgm_names_and_labels_for_the_twins():
    values = keyed(
        gpu_metrics.samples({"gpus": [GPU]}, STATE, "node1", {"0000:04:00.0": {"width": 4, "gen": 3}}, {}, 1.5)
    )
    assert values["DCGM_FI_DEV_GPU_TEMP{" + LABELS + "}"] == 88
    assert values["DCGM_FI_DEV_POWER_USAGE{" + LABELS + "}"] == 251.5
    assert values["DCGM_FI_DEV_POWER_MGMT_LIMIT{" + LABELS + "}"] == 250
    assert values["DCGM_FI_DEV_SM_CLOCK{" + LABELS + "}"] == 1695
    assert values["DCGM_FI_DEV_GPU_UTIL{" + LABELS + "}"] == 97
    assert values["DCGM_FI_DEV_FAN_SPEED{" + LABELS + "}"] == 0
    assert values["DCGM_FI_DEV_PCIE_REPLAY_COUNTER{" + LABELS + "}"] == 900
    assert values["DCGM_FI_DEV_PCIE_LINK_WIDTH{" + LABELS + "}"] == 1
    assert values["DCGM_FI_DEV_XID_ERRORS{" + LABELS + "}"] == 0
    assert values['budgetgpu_gpu_health_last_pass_timestamp_seconds{Hostname="node1"}'] == 1.5


def test_budgetgpu_metrics_for_what_dcgm_lacks():
    values = keyed(gpu_metrics.samples({"gpus": [GPU]}, STATE, "node1", {"0000:04:00.0": {"width": 4, "gen": 3}}))
    assert values["budgetgpu_gpu_fan_speed_percent{" + LABELS + ',fan="0"}'] == 0
    assert values["budgetgpu_gpu_fan_target_percent{" + LABELS + ',fan="0"}'] == 80
    assert values["budgetgpu_gpu_fan_speed_percent{" + LABELS + ',fan="1"}'] == 75
    assert values["budgetgpu_gpu_pcie_link_width_expected{" + LABELS + "}"] == 4
    assert values["budgetgpu_gpu_pcie_aer_errors_total{" + LABELS + ',severity="correctable"}'] == 3
    assert values["budgetgpu_gpu_pcie_aer_errors_total{" + LABELS + ',severity="fatal"}'] == 0
    assert not any('severity="nonfatal"' in key for key in values)  # the kernel has no such file
    assert values["budgetgpu_gpu_health_status{" + LABELS + "}"] == 2
    assert values["budgetgpu_gpu_health_finding{" + LABELS + ',kind="dead_fan"}'] == 1
    assert values["budgetgpu_gpu_quarantined{" + LABELS + "}"] == 1
    assert values['budgetgpu_gpu_health_gpus{Hostname="node1"}'] == 1


def test_unsupported_and_unknown_values_are_left_out_and_a_healthy_gpu_reads_zero():
    gpu = {**GPU, "fans": "unsupported", "temperature_c": None, "name": "unsupported"}
    values = keyed(gpu_metrics.samples({"gpus": [gpu]}, {}, "node1"))
    assert not any(
        key.startswith(("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_FAN_SPEED", "budgetgpu_gpu_fan_")) for key in values
    )
    assert not any(
        key.startswith(("DCGM_FI_DEV_TOTAL_ENERGY", "budgetgpu_gpu_pcie_link_width_expected")) for key in values
    )
    assert not any(key.startswith("budgetgpu_gpu_health_finding") for key in values)
    labels = LABELS.replace("NVIDIA GeForce RTX 3090", "")
    assert values["budgetgpu_gpu_quarantined{" + labels + "}"] == 0
    assert values["budgetgpu_gpu_health_status{" + labels + "}"] == 0


def test_energy_in_millijoules_and_no_gpu_gives_only_the_node_line():
    values = keyed(gpu_metrics.samples({"gpus": [{**GPU, "energy_total_j": 1234.5678}]}, {}, "n"))
    assert values["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{" + LABELS.replace("node1", "n") + "}"] == 1234568
    assert keyed(gpu_metrics.samples({"gpus": []}, {}, "n")) == {
        'budgetgpu_gpu_health_gpus{Hostname="n"}': 0,
        'budgetgpu_gpu_health_gpus_expected{Hostname="n"}': 0,
    }


def test_xid_counts_grow_per_finding_and_keep_the_last_xid():
    findings = [{"gpu": UUID, "kind": "xid_79"}, {"gpu": UUID, "kind": "dead_fan"}, {"gpu": None, "kind": "xid_13"}]
    counts = gpu_metrics.xid_counts(None, findings)
    assert counts == {UUID: {"last": 79, "total": 1}}
    again = gpu_metrics.xid_counts(counts, [{"gpu": UUID, "kind": "xid_48"}])
    assert again == {UUID: {"last": 48, "total": 2}} and counts[UUID]["total"] == 1
    values = keyed(gpu_metrics.samples({"gpus": [GPU]}, {}, "node1", None, again))
    assert values["DCGM_FI_DEV_XID_ERRORS{" + LABELS + "}"] == 48
    assert values["budgetgpu_gpu_xid_errors_total{" + LABELS + "}"] == 2


def test_nvml_bus_id():
    assert gpu_metrics.nvml_bus_id("0000:3b:00.0") == "00000000:3B:00.0"
    assert gpu_metrics.nvml_bus_id("03:00.0") == "00000000:03:00.0"
    assert gpu_metrics.nvml_bus_id(None) == ""


def test_a_gpu_that_is_gone_keeps_its_series_present_0_quarantined_and_its_last_xid():
    other = {**GPU, "index": 0, "uuid": "GPU-a", "bus_id": "0000:01:00.0"}
    gone = {"index": 2, "uuid": UUID, "bus_id": "0000:04:00.0", "name": "NVIDIA GeForce RTX 3090"}
    state = {
        "gpus": {UUID: {"status": "take_out", "reasons": {"gpu_missing": {}, "xid_79": {}}}},
        "quarantine": {UUID: {"by": "watch", "reason": "gone", "since": "t1"}},
    }
    values = keyed(
        gpu_metrics.samples({"gpus": [other]}, state, "node1", xids={UUID: {"last": 79, "total": 1}}, gone=[gone])
    )
    assert values["budgetgpu_gpu_present{" + LABELS + "}"] == 0
    assert values["budgetgpu_gpu_quarantined{" + LABELS + "}"] == 1
    assert values["DCGM_FI_DEV_XID_ERRORS{" + LABELS + "}"] == 79
    assert values["budgetgpu_gpu_xid_errors_total{" + LABELS + "}"] == 1
    assert values["budgetgpu_gpu_health_status{" + LABELS + "}"] == 2
    assert values["budgetgpu_gpu_health_finding{" + LABELS + ',kind="gpu_missing"}'] == 1
    # No reading of NVML for it: its temperature, power and link series go (stale in Prometheus).
    assert not [key for key in values if key.startswith("DCGM_FI_DEV_GPU_TEMP") and UUID in key]
    assert values['budgetgpu_gpu_health_gpus{Hostname="node1"}'] == 1
    assert values['budgetgpu_gpu_health_gpus_expected{Hostname="node1"}'] == 2
    present = LABELS.replace('gpu="2"', 'gpu="0"').replace(UUID, "GPU-a").replace("04:00.0", "01:00.0")
    assert values["budgetgpu_gpu_present{" + present + "}"] == 1
