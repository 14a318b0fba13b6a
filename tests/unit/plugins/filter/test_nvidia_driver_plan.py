"""Role nvidia_driver's plan filter (plugins/filter/nvidia.py nvidia_driver_plan): one call that gives the role
Secure Boot's state, the module flavor, the headers, the installed branches and its one input check, from the
plugin_utils/driver.py and kernels.py functions (tested in tests/unit/plugins/plugin_utils/); the role calls no
other filter that only it used."""

from __future__ import annotations

import base64

from ansible_collections.budgetgpu.cluster.plugins.filter.nvidia import nvidia_driver_plan

GTX_1080_TI = {"bus_id": "0000:03:00.0", "device_id": "0x1b06"}
INPUTS = {
    "host": "node1",
    "distribution": "Debian",
    "version": "12.7",
    "supported_versions": ["12", "13"],
    "secure_boot_var": "",
    "kernel_modules": "auto",
    "pcie_gpus": [GTX_1080_TI],
    "nvml_gpus": [],
    "kernel": "6.1.0-28-amd64",
    "in_container": False,
    "kernels": [],
    "packages": {"nvidia-driver": [{"version": "535.216.01-1~deb12u1"}], "nvidia-modprobe": [{"version": "570.1-1"}]},
    "own_release_packages": ["nvidia-modprobe"],
    "major_version": "12",
    "source_asked": "auto",
    "source": "debian",
    "supported_sources": ["debian", "nvidia_repo"],
    "branch_asked": None,
    "branch": 535,
    "debian_branch": 535,
    "ubuntu_server": False,
    "module_options": {},
    "secure_boot": "refuse",
    "mok_key": "/var/lib/dkms/mok.key",
    "mok_cert": "/var/lib/dkms/mok.pub",
    "mok_missing": False,
    "allow_branch_change": False,
    "kernel_series": "6.1",
}


def test_the_plan_decides_flavor_headers_and_branches_and_finds_no_problem_in_good_inputs() -> None:
    plan = nvidia_driver_plan(INPUTS)
    assert plan["secure_boot_on"] is False
    assert plan["flavor"] == {"flavor": "proprietary", "problem": ""}
    assert plan["headers"] == {
        "kernel": "6.1.0-28-amd64",
        "packages": ["linux-headers-6.1.0-28-amd64", "linux-headers-amd64"],
        "note": None,
    }
    assert plan["installed_branches"] == [535]
    assert plan["problems"] == []


def test_the_input_check_reads_the_plans_own_secure_boot_flavor_and_branches() -> None:
    secure_boot_on = base64.b64encode(b"\x06\x00\x00\x00\x01").decode()
    plan = nvidia_driver_plan(
        {**INPUTS, "secure_boot_var": secure_boot_on, "kernel_modules": "open", "branch": 550, "source": "nvidia_repo"}
    )
    assert plan["secure_boot_on"] is True
    assert [problem.split(": ", 2)[1].split(" ")[0] for problem in plan["problems"]] == [
        "nvidia_driver_kernel_modules",
        "Secure",
        "driver",
    ]
    assert plan["problems"][0] == plan["flavor"]["problem"]


def test_an_unsupported_os_gets_its_one_problem_from_the_facts_alone() -> None:
    fedora = {key: INPUTS[key] for key in ("host", "secure_boot_var", "kernel_modules", "pcie_gpus", "kernel")}
    plan = nvidia_driver_plan({**fedora, "distribution": "Fedora", "version": "40", "supported_versions": []})
    assert plan["problems"] == [
        "node1: runs Fedora 40; budgetgpu.cluster.nvidia_driver supports Ubuntu 22.04/24.04 and Debian 12/13"
    ]
