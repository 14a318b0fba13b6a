"""nvidia_driver with Debian's real non-free packages: installed, pinned, held, not loaded, reboot pending; the
headers of the node's own kernel and its flavour's metapackage; nvidia-uvm and its device nodes at boot; the role's
own reboot and its check after it.

Simulated: the booted kernel (a container runs its host's; the node's own kernel is Debian's rt kernel that prepare
installs, which DKMS skips for real, so it stays without a module), the kind of machine (reboot.yml takes the
container for a VM, which the role may reboot) and the boot itself (systemd reboots the container, whose restart
policy starts it again: systemd is PID 1 again, /run is a fresh tmpfs; no module can load, so the device unit meets
"module could not be loaded")."""

from __future__ import annotations

import json
import os
import re

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


def _node_kernel(host) -> str:
    """The kernel prepare installed in the node (the rt flavour), as /lib/modules names it."""
    (release,) = [name for name in host.file("/lib/modules").listdir() if name.endswith("-rt-amd64")
                  and host.file(f"/lib/modules/{name}/modules.builtin").exists]  # fmt: skip
    return release


def test_nouveau_blacklist_is_inside_the_initramfs(host):
    blacklist = host.file("/etc/modprobe.d/budgetgpu-blacklist-nouveau.conf").content_string
    assert "blacklist nouveau" in blacklist
    # The initramfs of the node's kernel, rebuilt by the role's handler, carries it (the hook's copy), so that
    # nouveau stays away in early boot too.
    listing = host.check_output(f"lsinitramfs /boot/initrd.img-{_node_kernel(host)}").splitlines()
    assert "etc/modprobe.d/budgetgpu-blacklist-nouveau.conf" in listing
    # No module options asked for: no options file, in /etc or in the initramfs.
    assert not host.file("/etc/modprobe.d/budgetgpu-nvidia.conf").exists
    assert "etc/modprobe.d/budgetgpu-nvidia.conf" not in listing


def test_dkms_registered_the_module(host):
    status = host.check_output("dkms status")
    # Registered ("added"; "installed" for a kernel it built for): DKMS knows the module, whatever /usr/src holds.
    assert re.search(r"^nvidia-current/535\.[0-9.]+(, \S+, \S+)?: (added|built|installed)", status, re.M), status
    # The rt kernel's build was DKMS's to skip (nvidia excludes PREEMPT_RT): nothing built for it.
    assert f"{_node_kernel(host)}, x86_64: installed" not in status


def test_headers_of_the_nodes_kernel_and_the_flavours_metapackage(host):
    kernel = _node_kernel(host)
    assert host.package(f"linux-headers-{kernel}").is_installed
    # The metapackage: each later rt kernel comes with its headers, and DKMS builds for it.
    assert host.package("linux-headers-rt-amd64").is_installed
    assert host.file(f"/lib/modules/{kernel}/build/include").is_directory
    assert _facts(host)["kernel_headers"] == f"linux-headers-{kernel}, linux-headers-rt-amd64"


def test_the_kernel_without_a_module_is_named(host, playbook):
    kernel = _node_kernel(host)
    expected = (
        f"{host.backend.host}: kernel {kernel} installed, no nvidia module built for it: the next boot has no driver"
    )
    assert [problem.split(" (")[0] for problem in _facts(host)["kernels_without_module"]] == [expected]
    # Preflight reads the node afresh (the probe's gpu_facts) and warns; it does not fail.
    result = playbook("preflight.yml")
    assert result.returncode == 0, result.stdout
    assert f"WARN {expected}" in result.stdout, result.stdout


def test_nvidia_uvm_loads_at_boot(host):
    entry = host.file("/etc/modules-load.d/budgetgpu-nvidia-uvm.conf").content_string
    assert [line for line in entry.splitlines() if line and not line.startswith("#")] == ["nvidia-uvm"]
    # Debian names the module nvidia-current-uvm: its modprobe configuration maps the name nvidia-uvm to it
    # (modprobe prints module names with underscores).
    config = host.check_output("modprobe --showconfig")
    assert re.search(r"^install nvidia_uvm .*modprobe -i nvidia-current-uvm", config, re.M), config


def test_device_unit_runs_before_every_service(host):
    unit = "budgetgpu-nvidia-devices.service"
    assert host.service(unit).is_enabled
    shown = dict(
        line.split("=", 1) for line in host.check_output(f"systemctl show -p Before -p WantedBy {unit}").splitlines()
    )
    assert "sysinit.target" in shown["Before"].split() and "sysinit.target" in shown["WantedBy"].split()
    # A unit like a job's (default dependencies) is ordered after sysinit.target, so after the device unit.
    host.check_output("systemd-run --unit=budgetgpu-job-order-probe --remain-after-exit true")
    try:
        after = host.check_output("systemctl show -p After budgetgpu-job-order-probe.service")
    finally:
        host.run("systemctl stop budgetgpu-job-order-probe.service")
    assert "sysinit.target" in after.split("=", 1)[1].split(), after


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


# Last: it reboots the node.
def test_the_role_reboots_the_node_and_its_check_after_the_boot_names_the_module_not_loaded(host, playbook):
    name = host.backend.get_hostname()
    before = host.interface("eth0").addresses
    host.check_output("touch /run/budgetgpu-before-reboot")  # every boot empties /run
    result = playbook("../molecule/nvidia_driver/reboot.yml")
    installed = _facts(host)["installed_version"]
    # The role's reboot task rebooted the node (a new boot: /run is empty, systemd booted again).
    assert re.search(
        r"TASK \[budgetgpu\.cluster\.nvidia_driver : Reboot into the installed driver, one node at a "
        rf"time\] \S* changed: \[{re.escape(name)}\]",
        result.stdout,
    ), result.stdout
    assert not host.file("/run/budgetgpu-before-reboot").exists
    # Booted ("degraded": a unit that cannot run in a container failed), at the same address, as a real node.
    assert host.check_output("systemctl is-system-running --wait || true") in ("running", "degraded")
    assert host.interface("eth0").addresses == before
    # Its check after the boot then finds the installed driver not loaded, and the role fails naming both.
    assert result.returncode != 0, result.stdout
    assert (
        f"{name}: after the reboot the loaded nvidia module is none and NVML reports not_loaded, "
        f"but {installed} is installed"
    ) in result.stdout, result.stdout
    shown = dict(
        line.split("=", 1)
        for line in host.check_output(
            "systemctl show -p ActiveState -p Result -p ExecMainStatus -p ExecMainStartTimestampMonotonic "
            "budgetgpu-nvidia-devices.service"
        ).splitlines()
    )
    # The device unit ran in this boot, nvidia-modprobe could not load the module (no GPU, the host's kernel), and
    # the unit still ends active: the boot is not failed by it.
    assert int(shown["ExecMainStartTimestampMonotonic"]) > 0, shown
    assert shown["ActiveState"] == "active" and shown["Result"] == "success", shown
    assert shown["ExecMainStatus"] != "0", shown
    assert not host.file("/dev/nvidia-uvm").exists
