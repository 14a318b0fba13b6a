"""The probes inside containers: simulated GPUs, and the real NVML library without a driver."""

from __future__ import annotations

import json
import os

import pytest
import testinfra.utils.ansible_runner

testinfra_hosts = testinfra.utils.ansible_runner.AnsibleRunner(os.environ["MOLECULE_INVENTORY_FILE"]).get_hosts(
    "gpu_nodes"
)

DIR = "/var/lib/budgetgpu-probes"
SYSFS = "/var/lib/budgetgpu-sim/sys"


def facts(host):
    return json.loads(host.file(f"{DIR}/facts.json").content_string)


def by_bus(pcie):
    return {gpu["bus_id"]: gpu for gpu in pcie["gpus"]}


def test_risers_node_tells_slot_limits_from_the_bad_riser(host):
    data = facts(host)
    if data["host"] != "probes-3090":
        pytest.skip("a check for probes-3090")
    assert data["gpus"]["driver"]["state"] == "loaded" and data["gpus"]["count"] == 4
    assert {gpu["name"] for gpu in data["gpus"]["gpus"]} == {"NVIDIA GeForce RTX 3090"}
    assert data["pcie"]["count"] == 4  # the HDMI audio functions are not GPUs
    gpus = by_bus(data["pcie"])
    assert [gpus[bus]["effective"]["width"] for bus in sorted(gpus)] == [16, 4, 4, 1]
    assert [gpus[bus]["effective"]["gen"] for bus in sorted(gpus)] == [3, 3, 3, 3]
    assert [gpus[bus]["downgraded"] for bus in sorted(gpus)] == [False, False, False, True]
    assert gpus["0000:04:00.0"]["limiting_hop"] == "0000:00:1d.0"
    assert [gpu["bus_id"] for gpu in data["gpus"]["gpus"]] == sorted(gpus)  # NVML and sysfs agree


def test_h200_node_matches_the_reference_capture(host):
    data = facts(host)
    if data["host"] != "probes-h200":
        pytest.skip("a check for probes-h200")
    gpu = data["gpus"]["gpus"][0]
    assert (gpu["name"], gpu["memory_total_mib"], gpu["compute_capability"]) == ("NVIDIA H200", 143771, "9.0")
    assert gpu["fan_speed_pct"] == gpu["nvlinks_active"] == gpu["numa_node"] == "unsupported"
    link = data["pcie"]["gpus"][0]
    assert (link["effective"]["gen"], link["effective"]["width"], link["downgraded"]) == (5, 16, False)


def test_real_libnvidia_ml_without_driver_says_not_loaded(host):
    data = facts(host)
    if data["host"] != "probes-nvml":
        pytest.skip("a check for probes-nvml")
    assert host.package("libnvidia-ml1").is_installed
    assert not host.file("/usr/local/lib/budgetgpu-sim/python/pynvml.py").exists  # the real nvidia-ml-py answers
    driver = data["gpus"]["driver"]
    assert (driver["state"], driver["loaded"], data["gpus"]["count"]) == ("not_loaded", False, 0)
    assert "kernel module is not loaded" in driver["reason"]
    assert data["pcie"]["count"] == 2  # GPUs on the bus all the same


def test_cluster_interface_is_eth0(host):
    net = facts(host)["net"]
    assert net["cluster_interface"]["name"] == "eth0"
    eth0 = next(iface for iface in net["interfaces"] if iface["name"] == "eth0")
    assert eth0["kind"] == "veth" and eth0["mtu"] > 0
    assert any(iface["kind"] == "loopback" for iface in net["interfaces"])


def test_gpu_probe_runs_with_plain_python3_and_agrees_with_the_modules(host):
    data = facts(host)
    out = host.check_output(f"python3 {DIR}/scripts/gpu-probe --json --sysfs-root {SYSFS}")
    probe = json.loads(out)
    assert probe["pcie"]["gpus"] == data["pcie"]["gpus"]
    assert probe["gpus"]["driver"]["state"] == data["gpus"]["driver"]["state"]
    assert probe["gpus"]["count"] == data["gpus"]["count"]
    table = host.check_output(f"python3 {DIR}/scripts/gpu-probe --sysfs-root {SYSFS}")
    assert f"{data['pcie']['count']} NVIDIA GPU(s) on the PCI bus" in table.splitlines()[0]
