"""cuda: NCCL pinned to the CUDA major and held, toolkit installed, versions of node and torch as facts."""

from __future__ import annotations

import json
import os

import testinfra.utils.ansible_runner

testinfra_hosts = testinfra.utils.ansible_runner.AnsibleRunner(os.environ["MOLECULE_INVENTORY_FILE"]).get_hosts(
    "gpu_nodes"
)

NCCL = "2.21.5-1+cuda12.4"


def test_repository_added_through_the_driver_roles_entry_point(host):
    source = host.file("/etc/apt/sources.list.d/cuda.sources").content_string
    assert "URIs: http://aptrepo:8080/cuda/repos/debian12/x86_64/" in source
    assert "Signed-By: /etc/apt/keyrings/cuda.asc" in source


def test_nccl_pinned_version_installed_although_newer_exists(host):
    for name in ("libnccl2", "libnccl-dev"):
        assert host.package(name).is_installed, name
        assert host.package(name).version == NCCL, name
    pin = host.file("/etc/apt/preferences.d/budgetgpu-nccl").content_string
    assert f"Pin: version {NCCL}" in pin and "Pin-Priority: 1001" in pin
    assert "2.23.4-1+cuda12.6" in host.check_output("apt-cache madison libnccl2")


def test_nccl_held(host):
    held = host.check_output("apt-mark showhold").split()
    assert "libnccl2" in held and "libnccl-dev" in held
    assert "Inst libnccl" not in host.check_output("apt-get --simulate upgrade")


def test_toolkit_installed_and_on_path(host):
    assert host.package("cuda-toolkit-12-4").version == "12.4.1-1"
    assert "release 12.4" in host.check_output("bash -lc 'nvcc --version'")


def test_facts_compare_system_and_torch_nccl(host):
    nccl = json.loads(host.file("/etc/ansible/facts.d/budgetgpu_nccl.fact").content_string)
    assert nccl["system"] == "2.21.5"
    assert nccl["system_package"] == NCCL
    assert nccl["system_cuda"] == "12.4"
    assert nccl["torch"] == "2.21.5"
    assert nccl["torch_cuda"] == "12.4"
    assert nccl["torch_error"] is None
    cuda = json.loads(host.file("/etc/ansible/facts.d/budgetgpu_cuda.fact").content_string)
    assert cuda == {
        "version": "12.4",
        "toolkit_source": "nvidia_repo",
        "toolkit_package": "cuda-toolkit-12-4",
        "toolkit_version": "12.4.1-1",
    }
