"""Which headers keep DKMS building for the next kernel, and which installed kernels have no nvidia module."""

from __future__ import annotations

import pytest
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.kernels import (
    headers_metapackage,
    kernel_headers,
    kernel_module_problems,
)

DEBIAN_12 = ("Debian", "12", "6.1")
UBUNTU_2204 = ("Ubuntu", "22.04", "5.15")
UBUNTU_2404 = ("Ubuntu", "24.04", "6.8")


@pytest.mark.parametrize(
    ("release", "os", "expected"),
    [
        ("6.1.0-27-amd64", DEBIAN_12, "linux-headers-amd64"),
        ("6.1.0-27-cloud-amd64", DEBIAN_12, "linux-headers-cloud-amd64"),
        ("6.1.0-27-rt-amd64", DEBIAN_12, "linux-headers-rt-amd64"),
        ("6.1.0-27-arm64", DEBIAN_12, "linux-headers-arm64"),
        # Debian 12's newer series has metapackages of its own; linux-headers-amd64 would bring 6.1's headers.
        ("6.12.118+deb12-amd64", DEBIAN_12, "linux-headers-6.12-amd64"),
        ("6.12.48+deb13-cloud-amd64", ("Debian", "13", "6.12"), "linux-headers-cloud-amd64"),
        ("5.15.0-122-generic", UBUNTU_2204, "linux-headers-generic"),
        ("6.5.0-35-generic", UBUNTU_2204, "linux-headers-generic-hwe-22.04"),
        ("6.8.0-45-lowlatency", UBUNTU_2204, "linux-headers-lowlatency-hwe-22.04"),
        ("6.8.0-1015-aws", UBUNTU_2204, "linux-headers-aws"),
        ("6.8.0-45-generic", UBUNTU_2404, "linux-headers-generic"),
        ("6.11.0-19-generic", UBUNTU_2404, "linux-headers-generic-hwe-24.04"),
        ("6.8.0-45-generic-64k", UBUNTU_2404, "linux-headers-generic-64k"),
        # A custom kernel, a backports one, another OS: no metapackage of the archive follows them.
        ("6.18.44-fc-v1252", DEBIAN_12, None),
        ("6.12.12+bpo-amd64", DEBIAN_12, None),
        ("6.1.0-27-amd64", ("Fedora", "41", "6.11"), None),
    ],
)
def test_headers_metapackage_follows_the_kernels_flavour_and_series(release, os, expected):
    distribution, version, series = os
    assert headers_metapackage(release, distribution, version, series) == expected


def test_headers_of_the_running_kernel_beside_the_metapackage():
    decided = kernel_headers("6.1.0-27-cloud-amd64", False, [], *DEBIAN_12)
    assert decided == {
        "kernel": "6.1.0-27-cloud-amd64",
        "packages": ["linux-headers-6.1.0-27-cloud-amd64", "linux-headers-cloud-amd64"],
        "note": None,
    }


def test_a_container_takes_its_newest_installed_kernel_not_its_hosts():
    kernels = [{"release": "6.1.0-47-amd64"}, {"release": "6.1.0-50-rt-amd64"}]
    decided = kernel_headers("6.18.44-fc-v1252", True, kernels, *DEBIAN_12)
    assert decided["packages"] == ["linux-headers-6.1.0-50-rt-amd64", "linux-headers-rt-amd64"]
    empty = kernel_headers("6.18.44-fc-v1252", True, [], *DEBIAN_12)
    assert empty["packages"] == [] and "has no kernel installed of its own" in empty["note"]


def test_a_custom_kernel_gets_its_own_headers_and_a_note():
    decided = kernel_headers("6.1.0-custom7-amd64x", False, None, *DEBIAN_12)
    assert decided["packages"] == ["linux-headers-6.1.0-custom7-amd64x"]
    assert "not a kernel of Debian 12's archive" in decided["note"]


REGISTERED = [{"module": "nvidia-current", "version": "535.261.03", "kernel": None, "arch": None, "status": "added"}]


def kernels(*entries: tuple[str, bool], headers: bool = False) -> list[dict]:
    return [
        {"release": release, "running": False, "nvidia_module": built, "headers": headers} for release, built in entries
    ]


def test_the_newest_kernel_without_a_module_is_the_next_boot_without_a_driver():
    driver = {"kernels": kernels(("6.1.0-27-amd64", True), ("6.1.0-28-amd64", False)), "dkms": REGISTERED}
    assert kernel_module_problems(driver, "node1") == [
        "node1: kernel 6.1.0-28-amd64 installed, no nvidia module built for it: the next boot has no driver"
        " (install linux-headers-6.1.0-28-amd64 and run `dkms autoinstall -k 6.1.0-28-amd64`)"
    ]


def test_a_kernel_with_headers_but_no_module_is_dkms_not_building_it():
    # Debian's rt kernels: NVIDIA's dkms.conf excludes PREEMPT_RT, so DKMS skips them although their headers are there.
    driver = {"kernels": kernels(("6.1.0-50-rt-amd64", False), headers=True), "dkms": REGISTERED}
    (problem,) = kernel_module_problems(driver, "node1")
    assert problem.endswith(
        "the next boot has no driver (its headers are there but DKMS built nothing: "
        "`dkms autoinstall -k 6.1.0-50-rt-amd64` says why)"
    )


def test_an_older_kernel_without_a_module_is_named_without_claiming_the_next_boot():
    driver = {"kernels": kernels(("6.1.0-26-amd64", False), ("6.1.0-27-amd64", True)), "dkms": REGISTERED}
    (problem,) = kernel_module_problems(driver, "node2")
    assert problem.startswith("node2: kernel 6.1.0-26-amd64 installed, no nvidia module built for it: booting it")


def test_prebuilt_modules_without_dkms_count_as_an_installed_driver():
    driver = {"kernels": kernels(("6.8.0-45-generic", True), ("6.8.0-47-generic", False)), "dkms": None}
    (problem,) = kernel_module_problems(driver, "node3")
    assert "6.8.0-47-generic" in problem and "install the driver's kernel module package" in problem


@pytest.mark.parametrize(
    "driver",
    [
        # No driver installed yet: nothing to build for, no warning.
        {"kernels": kernels(("6.1.0-27-amd64", False)), "dkms": []},
        {"kernels": kernels(("6.1.0-27-amd64", False)), "dkms": None},
        # Another module registered with DKMS is no NVIDIA driver.
        {"kernels": kernels(("6.1.0-27-amd64", False)), "dkms": [{**REGISTERED[0], "module": "zfs"}]},
        # Every kernel has its module; facts of an older gpu_facts without the fields.
        {"kernels": kernels(("6.1.0-27-amd64", True), ("6.1.0-28-amd64", True)), "dkms": REGISTERED},
        {},
        None,
    ],
)
def test_no_problem_without_a_driver_or_with_every_module_built(driver):
    assert kernel_module_problems(driver, "node1") == []
