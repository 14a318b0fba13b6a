"""gpu_power_limits module, roles/gpu_power/files/gpu-power on a node, the filters and the role's unit ordering."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ansible.module_utils.testing import patch_module_args
from ansible_collections.budgetgpu.cluster.plugins.filter import power
from ansible_collections.budgetgpu.cluster.plugins.module_utils import nvml_probe
from ansible_collections.budgetgpu.cluster.plugins.modules import gpu_power_limits
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils import jobs
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference import services
from ansible_collections.budgetgpu.cluster.tests.unit.node_package import NODE_PACKAGES

REPO = Path(__file__).resolve().parents[4]
GPU_SIM = REPO / "roles" / "gpu_sim" / "files"


def run(args, capsys):
    with patch_module_args(args), pytest.raises(SystemExit) as info:
        gpu_power_limits.main()
    return info.value.code, json.loads(capsys.readouterr().out)


def test_module_sets_caps_reports_drift_and_is_idempotent(monkeypatch, fake_pynvml, capsys):
    monkeypatch.setattr(gpu_power_limits, "pynvml", fake_pynvml("h200"))
    args = {"caps": {"NVIDIA H200": 500}, "budget_watts": 600, "node_name": "h200"}
    code, result = run({**args, "_ansible_check_mode": True}, capsys)
    assert code == 0 and result["changed"] is True and result["drift"][0].endswith("power limit 700 W -> 500 W")
    code, result = run(args, capsys)
    assert code == 0 and result["changed"] is True
    code, result = run(args, capsys)
    assert code == 0 and result["changed"] is False and result["drift"] == []


def test_module_refuses_a_cap_outside_the_range_and_changes_nothing(monkeypatch, fake_pynvml, capsys, tmp_path):
    nvml = fake_pynvml("h200")
    monkeypatch.setattr(gpu_power_limits, "pynvml", nvml)
    code, result = run({"caps": 150, "node_name": "h200"}, capsys)
    assert code == 1 and result["failed"] is True
    assert "h200: gpu_power_limit_watts['all']: GPU 0 (GPU-0f7beba8" in result["msg"]
    assert "150 W is outside the card's range 200-700 W" in result["msg"]
    assert nvml_probe.probe_nvml(nvml, proc_root=str(tmp_path))["gpus"][0]["power_limit_w"] == 700.0


def test_module_without_pynvml_says_so(monkeypatch, capsys):
    monkeypatch.setattr(gpu_power_limits, "pynvml", None)
    code, result = run({"caps": 200}, capsys)
    assert code == 1 and "nvidia-ml-py" in result["msg"]


def test_gpu_power_script_runs_with_the_node_package_and_no_ansible(tmp_path):
    """As the boot unit runs it: the script with the node package (budgetgpu_node), no Ansible."""
    (tmp_path / "sim").mkdir()
    (tmp_path / "sim" / "pynvml.py").write_text((GPU_SIM / "pynvml.py").read_text())
    config = tmp_path / "gpu-power.json"
    config.write_text(json.dumps({"node": "node1", "caps": {"04:00.0": 250}, "budget_watts": None}))
    env = {
        "PATH": os.environ["PATH"],
        # The simulated pynvml and the node package only: no ansible_collections.
        "PYTHONPATH": f"{tmp_path / 'sim'}:{NODE_PACKAGES}",
        "BUDGETGPU_SIM_PROFILE": str(GPU_SIM / "profiles" / "rtx3090x4-risers.json"),
        "BUDGETGPU_SIM_STATE": str(tmp_path / "state.json"),
    }
    command = [sys.executable, "-s", str(REPO / "roles" / "gpu_power" / "files" / "gpu-power"), "--config", str(config)]

    def gpu_power(*extra):
        return subprocess.run([*command, *extra], env=env, capture_output=True, text=True, check=False, timeout=60)

    done = gpu_power()
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("0000:04:00.0, NVIDIA GeForce RTX 3090): power limit 350 W -> 250 W")
    assert json.loads(gpu_power("--json").stdout)["changed"] is False
    config.write_text(json.dumps({"node": "node1", "caps": 401}))
    done = gpu_power()
    assert done.returncode == 1 and "401 W is outside the card's range 100-400 W" in done.stderr


def test_problems_filter_checks_loaded_nodes_only(fake_pynvml, tmp_path):
    facts = nvml_probe.probe_nvml(fake_pynvml("h200"), proc_root=str(tmp_path))
    assert power.gpu_power_problems(facts, "h200", {}, None) == []
    assert power.gpu_power_problems(facts, "h200", {"all": 800}, None)[0].startswith("h200: gpu_power_limit_watts")
    assert power.gpu_power_problems(facts, "h200", {"all": 700}, 650)[0].startswith("h200: gpu_power_budget_watts")
    # Before the driver is installed NVML knows no GPU: role gpu_power checks after the install.
    no_driver = nvml_probe.probe_nvml(fake_pynvml("no-driver"), proc_root=str(tmp_path), modules_root=str(tmp_path))
    assert power.gpu_power_problems(no_driver, "fresh", {"all": 800}, None) == []


def test_energy_summary_filter_defaults_to_the_guides_price(fake_pynvml, tmp_path):
    facts = nvml_probe.probe_nvml(fake_pynvml("h200"), proc_root=str(tmp_path))
    assert power.gpu_energy_summary(facts).endswith(" at $0.12/kWh")
    assert power.gpu_energy_summary(facts, 0.3, "EUR").endswith(" at 0.30 EUR/kWh")
    assert power.gpu_energy_summary(None) == "energy: no GPU with an energy counter"


def test_the_boot_unit_is_ordered_before_every_job_and_worker_unit():
    ordered = yaml.safe_load((REPO / "roles" / "gpu_power" / "vars" / "main.yml").read_text())
    assert ordered["_gpu_power_ordered_prefixes"] == [jobs.UNIT_PREFIX, services.UNIT_PREFIX]
    # systemd applies "<prefix>.service.d/" to every unit whose name starts with the prefix.
    assert jobs.unit_name("main").startswith(jobs.UNIT_PREFIX)
    assert services.unit_name("chat", 0).startswith(services.UNIT_PREFIX)


def test_role_defaults_match_the_argument_spec():
    role = REPO / "roles" / "gpu_power"
    defaults = yaml.safe_load((role / "defaults" / "main.yml").read_text())
    options = yaml.safe_load((role / "meta" / "argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
    assert defaults == {name: spec["default"] for name, spec in options.items()}
