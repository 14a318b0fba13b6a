"""Unit tests for plugins/filter/nvidia.py: module flavor, versions, Secure Boot, NCCL/CUDA."""

from __future__ import annotations

import base64
import re

import pytest
from ansible_collections.budgetgpu.cluster.plugins.filter import nvidia
from ansible_collections.budgetgpu.cluster.plugins.filter.nvidia import (
    deb_upstream_version,
    driver_branch,
    gpu_architecture_from_device_id,
    gpu_generations,
    module_flavor_decision,
    nccl_cuda_version,
    nccl_version_tuple_text,
    secure_boot_enabled,
)
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils import driver


@pytest.mark.parametrize(
    ("device_id", "arch"),
    [
        ("0x1b06", "pascal"),  # GTX 1080 Ti
        ("0x15f8", "pascal"),  # P100 (inside the Maxwell block)
        ("0x13c2", "maxwell"),  # GTX 970
        ("0x1db1", "volta"),  # V100
        ("0x1e04", "turing"),  # RTX 2080 Ti
        ("0x1eb8", "turing"),  # T4
        ("0x2182", "turing"),  # GTX 1660 Ti
        ("0x20b0", "ampere"),  # A100
        ("0x2204", "ampere"),  # RTX 3090
        ("0x2484", "ampere"),  # RTX 3070
        ("0x2335", "hopper"),  # H200
        ("0x2684", "ada"),  # RTX 4090
        ("0x2901", "blackwell"),  # B200
        ("0x2b85", "blackwell"),  # RTX 5090
        ("0x3100", "newer"),
        (0x2204, "ampere"),
        ("0x0100", "unknown"),
        ("zz", "unknown"),
        (None, "unknown"),
    ],
)
def test_architecture_from_device_id(device_id, arch):
    assert gpu_architecture_from_device_id(device_id) == arch


def test_every_id_from_turing_on_is_turing_or_newer():
    for first, last, arch, cc in nvidia.DEVICE_ID_RANGES:
        assert (first >= nvidia.TURING_FIRST_ID) == (cc >= 7.5), (hex(first), arch)
        assert last >= first


H200_PCIE = [{"bus_id": "0000:00:06.0", "device_id": "0x2335"}]
GTX1080TI = {"bus_id": "0000:03:00.0", "device_id": "0x1b06"}
RTX3090 = {"bus_id": "0000:04:00.0", "device_id": "0x2204"}
RTX5090 = {"bus_id": "0000:05:00.0", "device_id": "0x2b85"}


@pytest.mark.parametrize(
    ("requested", "pcie", "nvml", "branch", "expected"),
    [
        ("auto", H200_PCIE, None, 550, "open"),
        ("auto", [RTX3090, RTX3090], None, 550, "open"),
        ("auto", [GTX1080TI], None, 550, "proprietary"),
        ("auto", [GTX1080TI, RTX3090], None, 550, "proprietary"),
        ("auto", [RTX5090], None, 570, "open"),
        ("auto", [], None, 550, "proprietary"),
        ("auto", [], None, 560, "open"),
        ("auto", None, None, "580", "open"),
        ("auto", [], [{"bus_id": "0000:03:00.0", "compute_capability": "6.1"}], 550, "proprietary"),
        ("auto", [], [{"index": 0, "compute_capability": "8.6"}], 550, "open"),
        # NVML's capability wins over an unknown PCI id.
        (
            "auto",
            [{"bus_id": "x", "device_id": "0x0100"}],
            [{"bus_id": "x", "compute_capability": "7.0"}],
            550,
            "proprietary",
        ),
        ("proprietary", [RTX3090], None, 550, "proprietary"),
        ("open", [RTX3090], None, 550, "open"),
    ],
)
def test_module_flavor(requested, pcie, nvml, branch, expected):
    assert module_flavor_decision(requested, pcie, nvml, branch) == {"flavor": expected, "problem": ""}


def test_open_refused_for_a_gtx_1080_ti_naming_host_and_variable():
    problem = module_flavor_decision("open", [GTX1080TI], None, 550, host="node1")["problem"]
    assert re.search(r"node1: nvidia_driver_kernel_modules is 'open'.*0000:03:00.0", problem)


def test_proprietary_refused_for_blackwell():
    problem = module_flavor_decision("proprietary", [RTX5090], None, 570, host="node1")["problem"]
    assert "runs only the open modules" in problem


def test_pascal_and_blackwell_on_one_node_refused():
    assert "one driver cannot serve both" in module_flavor_decision("auto", [GTX1080TI, RTX5090], None, 570)["problem"]


def test_unknown_flavor_refused():
    assert "expected auto, open or proprietary" in module_flavor_decision("closed")["problem"]


def test_generations_merge_pci_and_nvml_by_bus_id():
    gens = gpu_generations(
        [RTX3090], [{"bus_id": "0000:04:00.0", "name": "NVIDIA GeForce RTX 3090", "compute_capability": "8.6"}]
    )
    assert gens == [
        {
            "bus_id": "0000:04:00.0",
            "name": "NVIDIA GeForce RTX 3090",
            "arch": "ampere",
            "source": "compute_capability",
            "compute_capability": "8.6",
        }
    ]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("8.6", (8, 6)),
        (8.6, (8, 6)),
        ([9, 0], (9, 0)),
        ({"major": 7, "minor": 5}, (7, 5)),
        ("unsupported", None),
        (None, None),
        ("x", None),
    ],
)
def test_parse_compute_capability(value, expected):
    assert nvidia.parse_compute_capability(value) == expected


@pytest.mark.parametrize(
    ("version", "upstream", "branch"),
    [
        ("535.261.03-1", "535.261.03", 535),
        ("1:550.127.08-0ubuntu1", "550.127.08", 550),
        ("550.127.08-1", "550.127.08", 550),
        ("535.171.04-1~deb12u1", "535.171.04", 535),
        ("580.65.06", "580.65.06", 580),
        ("", None, None),
        (None, None, None),
    ],
)
def test_deb_versions(version, upstream, branch):
    assert deb_upstream_version(version) == upstream
    assert driver_branch(version) == branch


def _efivar(value: int) -> str:
    return base64.b64encode(bytes([6, 0, 0, 0, value])).decode()


def test_secure_boot():
    assert secure_boot_enabled(_efivar(1)) is True
    assert secure_boot_enabled(_efivar(0)) is False
    assert secure_boot_enabled("") is False
    assert secure_boot_enabled(None) is False
    assert secure_boot_enabled("!!not base64") is False


@pytest.mark.parametrize(
    ("nccl", "cuda"),
    [("2.21.5-1+cuda12.4", "12.4"), ("2.18.3-1+cuda11", "11"), ("2.18.5-1", None), (None, None)],
)
def test_nccl_cuda_version(nccl, cuda):
    assert nccl_cuda_version(nccl) == cuda


def test_cuda_versions():
    assert driver.cuda_package_suffix("12.4") == "12-4"
    with pytest.raises(ValueError, match="MAJOR.MINOR"):
        driver.cuda_package_suffix("twelve")


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ((2, 21, 5), "2.21.5"),
        ([2, 18, 1], "2.18.1"),
        (22105, "2.21.5"),
        (2708, "2.7.8"),
        ("2.21.5", "2.21.5"),
        (None, None),
    ],
)
def test_nccl_version_text(value, text):
    assert nccl_version_tuple_text(value) == text


def test_filter_module_exports_every_filter():
    names = nvidia.FilterModule().filters()
    assert {"nvidia_driver_plan", "nvidia_kernel_problems", "deb_upstream_version"} <= set(names)
