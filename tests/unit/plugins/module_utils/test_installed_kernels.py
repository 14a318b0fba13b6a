"""The kernels installed on a node, whether each has an nvidia module, and what `dkms status` lists (gpu_facts)."""

from __future__ import annotations

import json

import pytest
from ansible.module_utils.testing import patch_module_args
from ansible_collections.budgetgpu.cluster.plugins.module_utils import nvml_probe
from ansible_collections.budgetgpu.cluster.plugins.modules import gpu_facts


def kernel(root, release, modules_dep=None, package=True, build_link=False):
    folder = root / release
    folder.mkdir(parents=True)
    if package:
        (folder / "modules.builtin").write_text("kernel/fs/ext4/ext4.ko\n")
    if modules_dep is not None:
        (folder / "modules.dep").write_text(modules_dep)
    if build_link:
        (folder / "build").symlink_to("/usr/src/linux-headers-" + release)


def test_installed_kernels_oldest_first_with_their_modules(tmp_path):
    kernel(tmp_path, "6.1.0-9-amd64", "kernel/fs/ext4/ext4.ko: kernel/fs/mbcache.ko\n")
    # Debian's DKMS module is nvidia-current.ko, compressed or not; upstream's nvidia.ko.
    kernel(tmp_path, "6.1.0-27-amd64", "updates/dkms/nvidia-current.ko: \nupdates/dkms/nvidia-current-uvm.ko: x\n")
    kernel(tmp_path, "6.1.0-10-cloud-amd64", "kernel/drivers/video/nvidia.ko.zst:\n")
    (tmp_path / "usr-src" / "linux-headers-6.1.0-27-amd64" / "include").mkdir(parents=True)
    (tmp_path / "6.1.0-27-amd64" / "build").symlink_to(tmp_path / "usr-src" / "linux-headers-6.1.0-27-amd64")
    # What a removed kernel leaves (DKMS's updates folder) and a headers package alone (the build link).
    kernel(tmp_path, "6.1.0-8-amd64", "updates/dkms/nvidia-current.ko:\n", package=False)
    kernel(tmp_path, "6.1.0-50-amd64", package=False, build_link=True)
    found = nvml_probe.installed_kernels(str(tmp_path), running="6.1.0-27-amd64")
    assert found == [
        {"release": "6.1.0-9-amd64", "running": False, "nvidia_module": False, "headers": False},
        {"release": "6.1.0-10-cloud-amd64", "running": False, "nvidia_module": True, "headers": False},
        {"release": "6.1.0-27-amd64", "running": True, "nvidia_module": True, "headers": True},
    ]


def test_a_kernel_without_modules_dep_has_no_module_modprobe_could_load(tmp_path):
    kernel(tmp_path, "6.12.48+deb13-amd64")
    assert nvml_probe.installed_kernels(str(tmp_path), running="x") == [
        {"release": "6.12.48+deb13-amd64", "running": False, "nvidia_module": False, "headers": False}
    ]
    assert nvml_probe.installed_kernels(str(tmp_path / "absent"), running="x") == []


def test_nvidia_uvm_alone_is_not_the_driver_module(tmp_path):
    kernel(tmp_path, "6.1.0-27-amd64", "updates/dkms/nvidia-current-uvm.ko:\nkernel/x/nvidiafb.ko:\n")
    assert nvml_probe.installed_kernels(str(tmp_path), running="x")[0]["nvidia_module"] is False


DKMS_STATUS = """\
nvidia-current/535.261.03: added
nvidia-current/535.261.03, 6.1.0-27-amd64, x86_64: installed (WARNING! Diff between built and installed module!)
nvidia, 550.120, 5.15.0-122-generic, x86_64: installed
Error! Could not locate dkms.conf file.
"""


def test_dkms_status_of_dkms_2_and_3():
    assert nvml_probe.parse_dkms_status(DKMS_STATUS) == [
        {"module": "nvidia-current", "version": "535.261.03", "kernel": None, "arch": None, "status": "added"},
        {"module": "nvidia-current", "version": "535.261.03", "kernel": "6.1.0-27-amd64", "arch": "x86_64",
         "status": "installed"},
        {"module": "nvidia", "version": "550.120", "kernel": "5.15.0-122-generic", "arch": "x86_64",
         "status": "installed"},
    ]  # fmt: skip
    assert nvml_probe.parse_dkms_status("") == []


def run_gpu_facts(monkeypatch, capsys, tmp_path, dkms_path, dkms_out=(0, "", "")):
    calls = []
    monkeypatch.setattr(gpu_facts, "pynvml", None)
    monkeypatch.setattr(gpu_facts.AnsibleModule, "get_bin_path", lambda self, name, *a, **k: dkms_path)

    def run_command(self, argv, **kwargs):
        calls.append((argv, kwargs.get("environ_update")))
        return dkms_out

    monkeypatch.setattr(gpu_facts.AnsibleModule, "run_command", run_command)
    args = {"on_missing_pynvml": "report", "modules_root": str(tmp_path), "_ansible_check_mode": True}
    with patch_module_args(args), pytest.raises(SystemExit):
        gpu_facts.main()
    return json.loads(capsys.readouterr().out), calls


def test_gpu_facts_reports_kernels_and_dkms_even_without_pynvml(monkeypatch, capsys, tmp_path):
    kernel(tmp_path, "6.1.0-50-rt-amd64", "kernel/fs/ext4/ext4.ko:\n")
    result, calls = run_gpu_facts(monkeypatch, capsys, tmp_path, "/usr/sbin/dkms", (0, DKMS_STATUS, ""))
    driver = result["ansible_facts"]["budgetgpu_gpus"]["driver"]
    assert result["changed"] is False
    assert driver["state"] == "no_pynvml"
    assert [entry["release"] for entry in driver["kernels"]] == ["6.1.0-50-rt-amd64"]
    assert driver["dkms"][0] == {"module": "nvidia-current", "version": "535.261.03", "kernel": None,
                                 "arch": None, "status": "added"}  # fmt: skip
    assert calls == [(["/usr/sbin/dkms", "status"], {"LANG": "C", "LC_ALL": "C", "LC_MESSAGES": "C"})]


@pytest.mark.parametrize(("dkms_path", "dkms_out"), [(None, (0, "", "")), ("/usr/sbin/dkms", (3, "", "boom"))])
def test_gpu_facts_dkms_is_null_without_dkms_or_when_it_fails(monkeypatch, capsys, tmp_path, dkms_path, dkms_out):
    result, _calls = run_gpu_facts(monkeypatch, capsys, tmp_path, dkms_path, dkms_out)
    assert result["ansible_facts"]["budgetgpu_gpus"]["driver"]["dkms"] is None
