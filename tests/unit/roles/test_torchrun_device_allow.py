"""The job unit opens the GPU devices of every NVIDIA driver generation the collection installs.

The unit runs with DevicePolicy=closed, so it can open only the device groups its DeviceAllow=
lines name. The driver's group names changed between branches (tests/fixtures/proc-devices/
README.md): the unit is rendered from the role's template, defaults and vars with ansible-playbook
(local connection, no node), and its DeviceAllow= lines are checked against each generation's
/proc/devices with the same code gpu-smoke runs on a real node.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ansible_collections.budgetgpu.cluster.plugins.module_utils import device_allow
from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import render_job_unit

REPO = Path(__file__).resolve().parents[3]
PROC_DEVICES = REPO / "tests" / "fixtures" / "proc-devices"
GENERATIONS = sorted(path.stem for path in PROC_DEVICES.glob("*.txt"))
# CUDA opens these nodes; major 195 is fixed (NV_MAJOR_DEVICE_NUMBER), the others are dynamic.
FIXED_NODES = {"/dev/nvidia0": (195, 0), "/dev/nvidia-modeset": (195, 254), "/dev/nvidiactl": (195, 255)}


def render_unit(tmp_path: Path, extra_vars: dict | None = None) -> str:
    return render_job_unit(tmp_path, extra_vars).read_text()


def service_values(unit: str, key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in unit.splitlines() if line.startswith(f"{key}=")]


@pytest.fixture(scope="module")
def unit(tmp_path_factory) -> str:
    """The unit of a job whose one rank holds GPU 0 of the node."""
    return render_unit(tmp_path_factory.mktemp("unit"), {"test_job_gpus": 1})


def proc_devices(generation: str) -> str:
    return (PROC_DEVICES / f"{generation}.txt").read_text()


def test_the_fixtures_cover_both_names_of_major_195():
    names = {gen: {name for major, name in device_allow.nvidia_groups(
        device_allow.parse_proc_devices(proc_devices(gen))) if major == 195} for gen in GENERATIONS}  # fmt: skip
    assert names["535"] == {"nvidia-frontend"}
    assert names["550"] == {"nvidia", "nvidiactl"}
    assert {"470", "535", "550", "580-open"} <= set(GENERATIONS)


def test_the_unit_keeps_the_device_policy_closed(unit):
    assert service_values(unit, "DevicePolicy") == ["closed"]
    assert "PrivateDevices" not in unit  # it would hide /dev/nvidia* whatever DeviceAllow says


@pytest.mark.parametrize("generation", GENERATIONS)
def test_the_unit_opens_every_nvidia_group_the_driver_registers(unit, generation):
    allowed = service_values(unit, "DeviceAllow")
    uncovered = device_allow.uncovered_groups(allowed, proc_devices(generation))
    assert uncovered == [], f"driver {generation}: " + device_allow.uncovered_message(uncovered)


@pytest.mark.parametrize("generation", GENERATIONS)
def test_the_unit_opens_the_nodes_cuda_uses(unit, generation):
    rules = device_allow.parse_device_allow(service_values(unit, "DeviceAllow"))
    groups = device_allow.parse_proc_devices(proc_devices(generation))
    uvm = next(major for major, name in groups["char"] if name == "nvidia-uvm")
    nodes = {**FIXED_NODES, "/dev/nvidia-uvm": (uvm, 0), "/dev/nvidia-uvm-tools": (uvm, 1)}
    refused = [path for path, (major, minor) in nodes.items()
               if not device_allow.node_allowed(rules, groups, major, minor, stat_char=lambda _path: None)]  # fmt: skip
    assert refused == [], f"driver {generation}: the unit cannot open {refused}"


def test_an_inventory_list_reaches_the_unit_as_is_before_the_jobs_gpus(tmp_path):
    entries = ["char-nvidia rw", "/dev/nvidia0 rw"]
    unit = render_unit(tmp_path, {"torchrun_device_allow": entries, "test_job_gpus": 1})
    assert service_values(unit, "DeviceAllow") == [*entries, "/dev/char/195:0 rw", "/dev/char/195:254 rw",
                                                   "/dev/char/195:255 rw"]  # fmt: skip


def test_the_unit_opens_no_gpu_but_its_own(unit):
    """Issue 40: no rule of the unit opens GPU 1 of the node (an inference worker's, say), on any driver."""
    rules = device_allow.parse_device_allow(service_values(unit, "DeviceAllow"))
    for generation in GENERATIONS:
        groups = device_allow.parse_proc_devices(proc_devices(generation))
        assert not device_allow.node_allowed(rules, groups, 195, 1, stat_char=lambda _path: None), generation
        assert device_allow.node_allowed(rules, groups, 195, 0, stat_char=lambda _path: None), generation
    assert json.dumps(service_values(unit, "DevicePolicy")) == '["closed"]'
