"""nvidia_driver from NVIDIA's repository (the local signed dummy repository): outcomes on the node."""

from __future__ import annotations

import json
import os

import testinfra.utils.ansible_runner

testinfra_hosts = testinfra.utils.ansible_runner.AnsibleRunner(os.environ["MOLECULE_INVENTORY_FILE"]).get_hosts(
    "gpu_nodes"
)

DRIVER_PACKAGES = ("cuda-drivers-550", "nvidia-kernel-open-dkms")


def test_repository_is_a_deb822_source_with_its_own_keyring(host):
    source = host.file("/etc/apt/sources.list.d/cuda.sources")
    assert source.exists
    assert "URIs: http://aptrepo:8080/cuda/repos/debian12/x86_64/" in source.content_string
    assert "Suites: /" in source.content_string
    assert "Signed-By: /etc/apt/keyrings/cuda.asc" in source.content_string
    key = host.file("/etc/apt/keyrings/cuda.asc")
    assert key.exists and key.mode == 0o644
    assert "BEGIN PGP PUBLIC KEY BLOCK" in key.content_string


def test_no_key_in_apt_keys_global_trust(host):
    assert not host.file("/etc/apt/trusted.gpg").exists
    assert host.run("ls /etc/apt/trusted.gpg.d/ | grep -i -e cuda -e nvidia").rc != 0


def test_apt_reads_the_signed_repository(host):
    policy = host.check_output("apt-cache policy cuda-drivers-550")
    assert "http://aptrepo:8080/cuda/repos/debian12/x86_64  Packages" in policy


def test_repository_and_branch_pins(host):
    repo_pin = host.file("/etc/apt/preferences.d/cuda-repository-pin-600").content_string
    assert "Pin: release l=NVIDIA CUDA" in repo_pin and "Pin-Priority: 600" in repo_pin
    branch_pin = host.file("/etc/apt/preferences.d/budgetgpu-nvidia-driver").content_string
    assert "Pin: version 550.*" in branch_pin and "Pin-Priority: 1001" in branch_pin
    assert "nvidia-*" in branch_pin and "cuda-drivers*" in branch_pin


def test_branch_550_installed_although_560_is_newer(host):
    for name in DRIVER_PACKAGES:
        assert host.package(name).is_installed, name
        assert host.package(name).version == "550.127.08-1", name
    # libnvidia-ml1 exists in Debian (535), in the repository as 550 and 560: the pin picks 550.
    assert host.package("libnvidia-ml1").version == "550.127.08-1"
    assert not host.package("nvidia-kernel-dkms").is_installed  # open modules asked for


def test_packages_are_held_and_upgrade_leaves_them(host):
    held = host.check_output("apt-mark showhold").split()
    for name in DRIVER_PACKAGES:
        assert name in held, name
    simulated = host.check_output("apt-get --simulate --with-new-pkgs upgrade")
    assert "Inst nvidia" not in simulated and "Inst cuda-drivers" not in simulated


def test_unattended_upgrades_blacklist(host):
    conf = host.file("/etc/apt/apt.conf.d/51budgetgpu-nvidia-unattended-upgrades").content_string
    assert "Unattended-Upgrade::Package-Blacklist" in conf
    assert '"nvidia-";' in conf and '"cuda-drivers";' in conf
    dumped = host.check_output("apt-config dump Unattended-Upgrade::Package-Blacklist")
    assert '"nvidia-"' in dumped


def test_nouveau_blacklisted_with_initramfs_hook(host):
    blacklist = host.file("/etc/modprobe.d/budgetgpu-blacklist-nouveau.conf").content_string
    assert "blacklist nouveau" in blacklist and "options nouveau modeset=0" in blacklist
    hook = host.file("/etc/initramfs-tools/hooks/budgetgpu-nvidia")
    assert hook.exists and hook.mode == 0o755
    assert "/etc/modprobe.d/budgetgpu-blacklist-nouveau.conf" in hook.content_string
    assert host.run("sh -n /etc/initramfs-tools/hooks/budgetgpu-nvidia").rc == 0


def test_module_options(host):
    options = host.file("/etc/modprobe.d/budgetgpu-nvidia.conf").content_string
    assert "options nvidia NVreg_PreserveVideoMemoryAllocations=1" in options
    assert "options nvidia_drm modeset=1" in options


def test_persistence_daemon_enabled(host):
    assert host.service("nvidia-persistenced").is_enabled


def test_facts_say_installed_but_reboot_pending(host):
    facts = json.loads(host.file("/etc/ansible/facts.d/budgetgpu_driver.fact").content_string)
    assert facts["source"] == "nvidia_repo"
    assert facts["branch"] == 550
    assert facts["kernel_modules"] == "open"
    assert facts["installed_version"] == "550.127.08"
    assert facts["loaded_version"] is None
    assert facts["reboot_pending"] is True
    assert "a container runs its host kernel" in facts["reboot_reason"]
    assert facts["secure_boot"] is False
