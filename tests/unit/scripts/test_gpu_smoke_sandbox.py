"""roles/probe/files/gpu-smoke --sandbox: the job unit's sandbox read from the unit or the role, the systemd-run
command built from it, the CUDA probe's result read back and judged, all without a GPU or systemd."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import render_job_unit

REPO = Path(__file__).resolve().parents[3]
PROC_DEVICES = REPO / "tests" / "fixtures" / "proc-devices"
OLD_LIST = ["char-nvidia-frontend rw", "char-nvidia-uvm rw", "char-nvidia-caps rw", "char-nvidia-nvswitch rw"]


@pytest.fixture(scope="module")
def smoke():
    from ansible_collections.budgetgpu.cluster.tests.unit.file_modules import load_file_module

    return load_file_module("gpu_smoke_sandbox", REPO / "roles" / "probe" / "files" / "gpu-smoke")


@pytest.fixture(scope="module")
def unit_file(tmp_path_factory) -> Path:
    return render_job_unit(tmp_path_factory.mktemp("unit"))


def probe_line(nodes: dict[str, str], cuda: dict) -> str:
    return "BUDGETGPU-SANDBOX " + json.dumps({"uid": 998, "nodes": nodes, "torch": "2.11.0+cu130", "cuda": cuda})


GOOD_NODES = {"/dev/nvidia0": "ok", "/dev/nvidiactl": "ok", "/dev/nvidia-uvm": "ok", "/dev/nvidia-uvm-tools": "ok"}
GOOD_CUDA = {"ok": True, "devices": 1, "name": "NVIDIA H200"}


def test_unit_properties_reads_the_service_section_of_the_rendered_unit(smoke, unit_file):
    settings = smoke.unit_properties(unit_file.read_text())
    keys = [key for key, _value in settings]
    assert "Description" not in keys and "WantedBy" not in keys  # [Unit] and [Install] are not the sandbox
    assert ("DevicePolicy", "closed") in settings and ("User", "budgetgpu") in settings
    assert [value for key, value in settings if key == "DeviceAllow"][:2] == [
        "char-nvidia-uvm rw",
        "char-nvidia-caps rw",
    ]
    assert smoke.python_of(settings) == "/opt/budgetgpu/venv/bin/python3"


def test_systemctl_cat_drop_ins_apply_in_order(smoke, unit_file):
    cat = (
        f"# {unit_file}\n{unit_file.read_text()}\n"
        "# /etc/systemd/system/budgetgpu-job-main.service.d/override.conf\n"
        "[Service]\nDeviceAllow=\nDeviceAllow=char-nvidia-frontend rw\nUser=trainer\n"
        "ExecStart=\nExecStart=/srv/venv/bin/torchrun \\\n  --nproc-per-node=1 /srv/train.py\n"
    )
    settings = smoke.sandbox_settings(smoke.unit_properties(cat))
    allow = [value for key, value in settings if key == "DeviceAllow"]
    assert allow[-2:] == ["", "char-nvidia-frontend rw"]  # the reset goes to systemd-run as it is
    assert [value for key, value in settings if key == "User"][-1] == "trainer"
    assert not {"ExecStart", "ExecStartPre", "EnvironmentFile", "WorkingDirectory", "Restart"} & {
        k for k, _unused in settings
    }
    assert smoke.python_of(smoke.unit_properties(cat)) == "/srv/venv/bin/python3"


def test_role_defaults_give_the_sandbox_the_rendered_unit_has(smoke, unit_file):
    from_unit = smoke.sandbox_settings(smoke.unit_properties(unit_file.read_text()))
    from_role = smoke.role_properties()
    # The unit adds the job's own ReadWritePaths and limits; everything the role decides is the same.
    assert sorted(from_role) == sorted(
        s for s in from_unit if s[0] not in ("ReadWritePaths", "LimitMEMLOCK", "LimitNOFILE")
    )


def test_sandbox_settings_user_option_wins(smoke):
    settings = smoke.sandbox_settings([("User", "budgetgpu"), ("DevicePolicy", "closed")], user="alice")
    assert settings == [("DevicePolicy", "closed"), ("User", "alice")]


def test_sandbox_command(smoke):
    settings = [("DevicePolicy", "closed"), ("DeviceAllow", "char-nvidia rw"), ("CapabilityBoundingSet", "")]
    command = smoke.sandbox_command(settings, "/opt/budgetgpu/venv/bin/python3", "budgetgpu-gpu-smoke-7")
    assert command == [
        "systemd-run", "--quiet", "--wait", "--pipe", "--collect", "--unit=budgetgpu-gpu-smoke-7",
        "-p", "DevicePolicy=closed", "-p", "DeviceAllow=char-nvidia rw", "-p", "CapabilityBoundingSet=",
        "--", "/opt/budgetgpu/venv/bin/python3", "-c", smoke.SANDBOX_PROBE,
    ]  # fmt: skip


def test_the_probe_runs_without_a_gpu_and_reports_why(smoke):
    # This machine's python (torch CPU build, or no torch): the result line comes back either way.
    done = subprocess.run(
        [sys.executable, "-c", smoke.SANDBOX_PROBE], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    result = smoke.parse_sandbox_output(done.stdout)
    assert isinstance(result["nodes"], dict)
    assert result["cuda"]["ok"] or result["cuda"]["error"]  # a machine with a GPU passes, any other says why


def test_parse_sandbox_output_skips_torch_noise(smoke):
    out = f"UserWarning: something\n{probe_line(GOOD_NODES, GOOD_CUDA)}\n"
    assert smoke.parse_sandbox_output(out)["cuda"]["name"] == "NVIDIA H200"
    assert smoke.parse_sandbox_output("Traceback ...\n") is None
    assert smoke.parse_sandbox_output("BUDGETGPU-SANDBOX {not json\n") is None


def test_report_pass(smoke):
    result = smoke.parse_sandbox_output(probe_line(GOOD_NODES, GOOD_CUDA))
    status, lines = smoke.sandbox_report(result, 0, "", [], "budgetgpu")
    assert status == 0
    assert lines[-1] == (
        "sandbox  PASS: CUDA ran in the job's sandbox as budgetgpu (uid 998): NVIDIA H200, 1 GPU(s), torch 2.11.0+cu130"
    )


def test_report_names_what_the_device_policy_refused(smoke):
    nodes = {**GOOD_NODES, "/dev/nvidia0": "EPERM", "/dev/nvidiactl": "EPERM", "/dev/nvidia-caps/nvidia-cap1": "EACCES"}
    cuda = {"ok": False, "error": "RuntimeError: Found no NVIDIA driver on your system."}
    status, lines = smoke.sandbox_report(smoke.parse_sandbox_output(probe_line(nodes, cuda)), 0, "", [], "budgetgpu")
    assert status == 1
    assert "sandbox  FAIL: CUDA could not start in the job's sandbox as budgetgpu (uid 998): RuntimeError" in lines[-2]
    assert lines[-1].startswith("sandbox  FAIL: the device policy refused /dev/nvidia0, /dev/nvidiactl (EPERM)")
    assert "/dev/nvidia-caps/nvidia-cap1 EACCES" in lines[0]  # file mode, not the sandbox: shown, not failed


def test_report_hints_at_nvidia_uvm_and_fails_on_closed_groups_even_when_cuda_ran(smoke):
    cuda = {"ok": False, "error": "RuntimeError: CUDA driver initialization failed"}
    nodes = {"/dev/nvidia0": "ok", "/dev/nvidiactl": "ok"}
    _status, lines = smoke.sandbox_report(smoke.parse_sandbox_output(probe_line(nodes, cuda)), 0, "", [], "u")
    assert "/dev/nvidia-uvm is missing" in lines[-1] and "modules-load.d" in lines[-1]
    result = smoke.parse_sandbox_output(probe_line(GOOD_NODES, GOOD_CUDA))
    assert smoke.sandbox_report(result, 0, "", [(236, "nvidia-nvlink")], "u")[0] == 1


def test_report_when_systemd_run_gives_nothing(smoke):
    stderr = "Failed to start transient service unit: Unit budgetgpu-gpu-smoke-7.service has a bad unit file setting.\n"
    status, lines = smoke.sandbox_report(None, 1, stderr, [], "budgetgpu")
    assert status == 2
    assert lines[-1] == (
        "sandbox  COULD NOT RUN: systemd-run gave no result (Failed to start transient service unit: "
        "Unit budgetgpu-gpu-smoke-7.service has a bad unit file setting.)"
    )


def run_main(smoke, monkeypatch, capsys, argv, stdout, euid=0):
    calls = []

    def fake_run(command):
        calls.append(command)
        return subprocess.CompletedProcess(command, 0, stdout, "")

    monkeypatch.setattr(smoke, "run_in_sandbox", fake_run)
    monkeypatch.setattr(smoke.os, "geteuid", lambda: euid)
    status = smoke.main(argv)
    return status, capsys.readouterr().out, calls


def test_main_sandbox_only_passes_on_a_550_node(smoke, unit_file, monkeypatch, capsys):
    argv = ["--sandbox-only", "--unit-file", str(unit_file), "--proc-devices", str(PROC_DEVICES / "550.txt")]
    status, out, calls = run_main(smoke, monkeypatch, capsys, argv, probe_line(GOOD_NODES, GOOD_CUDA) + "\n")
    assert status == 0, out
    assert f"sandbox  from unit file {unit_file}: run /opt/budgetgpu/venv/bin/python3 as budgetgpu" in out
    assert "sandbox  NVIDIA groups in /proc/devices: nvidia 195, nvidiactl 195, nvidia-caps-imex-channels 234" in out
    assert "DeviceAllow= opens every NVIDIA device group in /proc/devices" in out
    assert calls[0][:5] == ["systemd-run", "--quiet", "--wait", "--pipe", "--collect"]
    assert "-p" in calls[0] and "DeviceAllow=/dev/char/195:255 rw" in calls[0] and "DevicePolicy=closed" in calls[0]
    assert "SupplementaryGroups=budgetgpu-gpu" in calls[0]


def test_main_fails_with_the_old_list_on_a_550_node(smoke, tmp_path, monkeypatch, capsys):
    unit = render_job_unit(tmp_path, {"torchrun_device_allow": OLD_LIST})
    # The unit of that time: no node of the GPU major (issue 40's per-GPU entries came later).
    unit.write_text("".join(line for line in unit.read_text().splitlines(True) if "/dev/char/195:" not in line))
    nodes = {**GOOD_NODES, "/dev/nvidia0": "EPERM", "/dev/nvidiactl": "EPERM"}
    cuda = {"ok": False, "error": "RuntimeError: Found no NVIDIA driver on your system."}
    argv = ["--sandbox-only", "--unit-file", str(unit), "--proc-devices", str(PROC_DEVICES / "550.txt")]
    status, out, _calls = run_main(smoke, monkeypatch, capsys, argv, probe_line(nodes, cuda))
    assert status == 1
    assert "sandbox  FAIL: DeviceAllow= does not open the NVIDIA device groups nvidia (major 195), nvidiactl" in out
    assert (
        "add /dev/char/195:255 rw, char-nvidia-caps-imex-channels rw, char-nvidia-nvlink rw to torchrun_device_allow"
        in out
    )
    assert "the device policy refused /dev/nvidia0, /dev/nvidiactl (EPERM)" in out


def test_main_without_root_still_reports_the_groups(smoke, unit_file, monkeypatch, capsys):
    argv = ["--sandbox-only", "--unit-file", str(unit_file), "--proc-devices", str(PROC_DEVICES / "535.txt")]
    status, out, calls = run_main(smoke, monkeypatch, capsys, argv, "", euid=1000)
    assert status == 2 and calls == []
    assert "DeviceAllow= opens every NVIDIA device group in /proc/devices" in out
    assert out.rstrip().endswith("COULD NOT RUN: systemd-run needs root to start a system unit: run with sudo")


def test_main_from_the_role_defaults(smoke, monkeypatch, capsys):
    argv = ["--sandbox-only", "--user", "trainer", "--proc-devices", str(PROC_DEVICES / "580-open.txt")]
    status, out, calls = run_main(smoke, monkeypatch, capsys, argv, probe_line(GOOD_NODES, GOOD_CUDA))
    assert status == 0, out
    assert "sandbox  from the torchrun role's defaults and vars in" in out
    assert "run /opt/budgetgpu/venv/bin/python3 as trainer" in out
    assert calls[0].count("User=trainer") == 1 and "User=budgetgpu" not in calls[0]
