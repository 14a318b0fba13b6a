"""nvidia_driver with Debian's real non-free packages: installed, pinned, held, not loaded, reboot pending."""

from __future__ import annotations

import json
import os

import testinfra.utils.ansible_runner

testinfra_hosts = testinfra.utils.ansible_runner.AnsibleRunner(os.environ["MOLECULE_INVENTORY_FILE"]).get_hosts(
    "gpu_nodes"
)

DRIVER_PACKAGES = ("nvidia-driver", "nvidia-kernel-dkms", "nvidia-persistenced")


def _facts(host) -> dict:
    return json.loads(host.file("/etc/ansible/facts.d/budgetgpu_driver.fact").content_string)


def test_debian_nonfree_components_added(host):
    source = host.file("/etc/apt/sources.list.d/budgetgpu-debian-nonfree.sources").content_string
    assert "Components: contrib non-free non-free-firmware" in source
    assert "Suites: bookworm bookworm-updates" in source
    assert "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg" in source
    security = host.file("/etc/apt/sources.list.d/budgetgpu-debian-security-nonfree.sources").content_string
    assert "Suites: bookworm-security" in security
    assert not host.file("/etc/apt/sources.list.d/cuda.sources").exists


def test_debian_driver_installed_with_proprietary_modules(host):
    for name in DRIVER_PACKAGES:
        assert host.package(name).is_installed, name
    assert host.package("nvidia-driver").version.startswith("535.")
    # No GPU is seen and branch 535 predates NVIDIA's open default: proprietary modules.
    assert not host.package("nvidia-open-kernel-dkms").is_installed
    assert host.package("python3-pynvml").is_installed


def test_branch_pinned_and_packages_held(host):
    pin = host.file("/etc/apt/preferences.d/budgetgpu-nvidia-driver").content_string
    assert "Pin: version 535.*" in pin and "Pin-Priority: 1001" in pin
    held = host.check_output("apt-mark showhold").split()
    for name in DRIVER_PACKAGES:
        assert name in held, name
    assert "python3-pynvml" not in held


def test_unattended_upgrades_blacklist(host):
    dumped = host.check_output("apt-config dump Unattended-Upgrade::Package-Blacklist")
    for pattern in ('"nvidia-"', '"libnvidia-"', '"libcuda1"'):
        assert pattern in dumped, pattern


def test_nouveau_blacklisted_and_initramfs_hook(host):
    blacklist = host.file("/etc/modprobe.d/budgetgpu-blacklist-nouveau.conf").content_string
    assert "blacklist nouveau" in blacklist
    hook = host.file("/etc/initramfs-tools/hooks/budgetgpu-nvidia")
    assert hook.exists and hook.mode == 0o755
    assert host.package("initramfs-tools").is_installed
    # No module options asked for: no options file.
    assert not host.file("/etc/modprobe.d/budgetgpu-nvidia.conf").exists


def test_dkms_registered_the_module(host):
    assert host.file("/usr/src").listdir()
    assert any(name.startswith("nvidia-current-535") for name in host.file("/usr/src").listdir())


def test_nvml_says_driver_not_loaded(host):
    assert host.run("ldconfig -p | grep -q 'libnvidia-ml.so.1 '").rc == 0
    probe = host.run(
        "python3 -c 'import pynvml\ntry:\n    pynvml.nvmlInit()\nexcept pynvml.NVMLError as e:\n    print(e.value)'"
    )
    assert probe.stdout.strip() == "9", probe.stdout + probe.stderr  # NVML_ERROR_DRIVER_NOT_LOADED


def test_persistence_daemon_enabled(host):
    assert host.service("nvidia-persistenced").is_enabled


def test_facts_installed_not_loaded_reboot_pending(host):
    facts = _facts(host)
    assert facts["source"] == "debian"
    assert facts["branch"] == 535
    assert facts["kernel_modules"] == "proprietary"
    assert facts["installed_version"].startswith("535.")
    assert facts["loaded_version"] is None
    assert facts["state"] == "not_loaded"
    assert facts["reboot_pending"] is True
    assert facts["kernel_headers"] == "skipped: container"
