"""Debian 13: Debian's driver pinned and held beside trixie's deb822 sources, docker.io running, no venv."""

from __future__ import annotations

import json
import os
import re

import testinfra.utils.ansible_runner

testinfra_hosts = testinfra.utils.ansible_runner.AnsibleRunner(os.environ["MOLECULE_INVENTORY_FILE"]).get_hosts(
    "gpu_nodes"
)

# Headless: the kernel module, nvidia-smi and the CUDA and NVML libraries, no X driver.
DRIVER_PACKAGES = ("nvidia-kernel-dkms", "nvidia-smi", "libcuda1", "libnvidia-ml1", "nvidia-persistenced")


def test_the_node_is_debian_13_with_deb822_sources(host):
    assert host.system_info.distribution == "debian"
    assert host.system_info.release.startswith("13")
    assert not host.file("/etc/apt/sources.list").exists
    assert "Suites: trixie trixie-updates" in host.file("/etc/apt/sources.list.d/debian.sources").content_string


def test_nonfree_sources_name_the_keyring_of_debian_sources(host):
    own = host.file("/etc/apt/sources.list.d/debian.sources").content_string
    keyring = re.search(r"^Signed-By: (\S+)$", own, re.MULTILINE).group(1)
    assert keyring == "/usr/share/keyrings/debian-archive-keyring.pgp"
    source = host.file("/etc/apt/sources.list.d/budgetgpu-debian-nonfree.sources").content_string
    assert "Suites: trixie trixie-updates" in source
    assert "Components: contrib non-free non-free-firmware" in source
    assert f"Signed-By: {keyring}" in source
    security = host.file("/etc/apt/sources.list.d/budgetgpu-debian-security-nonfree.sources").content_string
    assert "Suites: trixie-security" in security and f"Signed-By: {keyring}" in security


def test_apt_reads_every_source(host):
    # Two Signed-By keyrings for one mirror make apt refuse to read its sources at all.
    policy = host.run("apt-cache policy nvidia-driver")
    assert policy.rc == 0 and not policy.stderr.strip(), policy.stderr
    assert "trixie/non-free amd64" in policy.stdout


def test_headless_driver_550_installed_pinned_and_held(host):
    for name in DRIVER_PACKAGES:
        assert host.package(name).is_installed, name
        assert host.package(name).version.startswith("550."), name
    assert not host.package("nvidia-driver").is_installed
    assert not host.package("xserver-xorg-video-nvidia").is_installed
    assert not host.package("nvidia-open-kernel-dkms").is_installed
    assert host.package("python3-pynvml").is_installed
    pin = host.file("/etc/apt/preferences.d/budgetgpu-nvidia-driver").content_string
    assert "Pin: version 550.*" in pin and "Pin-Priority: 1001" in pin
    held = host.check_output("apt-mark showhold").split()
    for name in DRIVER_PACKAGES:
        assert name in held, name


def test_nvidia_modprobe_of_its_own_release_is_no_driver_branch(host):
    # trixie's nvidia-kernel-support pulls nvidia-modprobe 570 beside driver 550; the idempotence run
    # passed, so the role did not take it for a second installed branch.
    assert host.package("nvidia-modprobe").version.startswith("570.")
    facts = json.loads(host.file("/etc/ansible/facts.d/budgetgpu_driver.fact").content_string)
    assert facts["source"] == "debian" and facts["branch"] == 550
    assert facts["installed_version"].startswith("550.")
    assert facts["kernel_headers"] == "skipped: container"


def test_nvml_says_driver_not_loaded(host):
    # trixie's python3-pynvml against its libnvidia-ml1: the module is registered, not loaded.
    probe = host.run(
        "python3 -c 'import pynvml\ntry:\n    pynvml.nvmlInit()\nexcept pynvml.NVMLError as e:\n    print(e.value)'"
    )
    assert probe.stdout.strip() == "9", probe.stdout + probe.stderr  # NVML_ERROR_DRIVER_NOT_LOADED


def test_docker_io_from_trixie_runs_with_live_restore(host):
    assert host.package("docker.io").version.startswith("26.")
    assert "docker.io" in host.check_output("apt-mark showhold").split()
    docker = host.service("docker")
    assert docker.is_running and docker.is_enabled
    config = json.loads(host.file("/etc/docker/daemon.json").content_string)
    assert config["live-restore"] is True and config["storage-driver"] == "vfs"
    info = host.check_output("docker info --format '{{.LiveRestoreEnabled}} {{.Driver}}'")
    assert info.strip() == "true vfs"
    assert not host.file("/etc/apt/sources.list.d/nvidia-container-toolkit.sources").exists


def test_python_env_refused_before_changing_anything(host):
    assert not host.file("/opt/budgetgpu/venv").exists
    assert not host.file("/var/cache/budgetgpu/wheelhouse").exists
    assert not host.user("budgetgpu").exists
    assert host.check_output("python3 -c 'import sys; print(sys.version_info[:2])'") == "(3, 13)"
