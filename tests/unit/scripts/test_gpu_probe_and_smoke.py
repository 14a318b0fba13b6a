"""gpu-probe and gpu-smoke (roles/probe/files): same facts as the modules, readable table, field checks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ansible_collections.budgetgpu.cluster.plugins.module_utils import pcie
from ansible_collections.budgetgpu.cluster.tests.unit.node_package import NODE_PACKAGES

REPO = Path(__file__).resolve().parents[3]
H200_CSV = REPO / "tests" / "fixtures" / "h200-node" / "nvidia-smi-query.csv"


@pytest.fixture
def probe_script():
    from ansible_collections.budgetgpu.cluster.tests.unit.file_modules import load_file_module

    return load_file_module("gpu_probe", REPO / "roles" / "probe" / "files" / "gpu-probe")


@pytest.fixture
def smoke_script():
    from ansible_collections.budgetgpu.cluster.tests.unit.file_modules import load_file_module

    return load_file_module("gpu_smoke", REPO / "roles" / "probe" / "files" / "gpu-smoke")


def test_probe_table_shows_link_limit_and_reason(probe_script, fake_pynvml, sim_tree):
    data = probe_script.collect(sim_tree("rtx3090x4-risers"), fake_pynvml("rtx3090x4-risers"), with_net=False)
    assert data["pcie"] == pcie.probe_pcie(sim_tree("rtx3090x4-risers"))  # the module's code, not a copy
    table = probe_script.render_table(data).splitlines()
    assert table[0].endswith("driver 535.247.01 (CUDA 12.2), 4 NVIDIA GPU(s) on the PCI bus")
    row = next(line for line in table if line.startswith("3 "))
    for cell in ("0000:04:00.0", "NVIDIA GeForce RTX 3090", "24576 MiB", "gen3 x1", "gen3 x4 (card gen4 x16)",
                 "0000:00:1d.0", "41C", "27/350 W (100-400)", "DOWNGRADED", "replays=1873"):  # fmt: skip
        assert cell in row, cell
    assert "trained at x1 but both ends support x4" in table[6]
    # Energy per GPU since the driver loaded (NVML's counter), and the node's cost at the guide's price.
    kwh = data["gpus"]["gpus"][3]["energy_total_j"] / 3_600_000
    assert f"{kwh:.2f} kWh" in row
    total = sum(gpu["energy_total_j"] for gpu in data["gpus"]["gpus"]) / 3_600_000
    summary = next(line for line in table if line.startswith("energy since the driver loaded: GPU 0 "))
    assert summary.endswith(f"; {total:.2f} kWh = ${total * 0.12:.2f} at $0.12/kWh")


def test_probe_without_pynvml_still_prints_sysfs_with_a_note(probe_script, sim_tree):
    data = probe_script.collect(sim_tree("no-driver"), None, with_net=False)
    table = probe_script.render_table(data)
    assert "driver no_pynvml, 2 NVIDIA GPU(s) on the PCI bus" in table
    assert "0000:02:00.0" in table and "gen3 x8" in table
    assert "nvidia-ml-py is not installed" in table.splitlines()[-1]


def test_probe_runs_with_plain_python_and_the_gpu_sim_pynvml(tmp_path, sim_tree):
    # What a person on a simulated node gets: no Ansible, the drop-in pynvml on the path.
    shutil.copy(REPO / "roles" / "gpu_sim" / "files" / "pynvml.py", tmp_path)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}:{NODE_PACKAGES}")
    env["BUDGETGPU_SIM_PROFILE"] = str(REPO / "roles" / "gpu_sim" / "files" / "profiles" / "h200.json")
    env["BUDGETGPU_SIM_STATE"] = str(tmp_path / "sim-state.json")
    command = [sys.executable, "-s", str(REPO / "roles" / "probe" / "files" / "gpu-probe"), "--json"]
    done = subprocess.run(
        [*command, "--sysfs-root", sim_tree("h200")], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["gpus"]["gpus"][0]["name"] == "NVIDIA H200"
    assert data["pcie"]["gpus"][0]["effective"]["width"] == 16
    assert data["net"]["interfaces"]  # from the real /sys: the simulated tree has no class/net
    gpu = data["gpus"]["gpus"][0]
    assert (gpu["power_limit_w"], gpu["power_limit_min_w"], gpu["power_limit_max_w"]) == (700.0, 200.0, 700.0)
    table = subprocess.run(
        [*command[:-1], "--sysfs-root", sim_tree("h200"), "--price-per-kwh", "0.3", "--currency", "EUR"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    assert " EUR at 0.30 EUR/kWh" in table
    bad = subprocess.run(
        [*command, "--sysfs-root", str(tmp_path / "nope")], capture_output=True, text=True, check=False
    )
    assert bad.returncode == 2 and "is not a directory" in bad.stderr


def h200_probe(probe_script, fake_pynvml, h200_sysfs):
    return json.loads(json.dumps(probe_script.collect(h200_sysfs, fake_pynvml("h200"), with_net=False)))


def test_smoke_agrees_with_the_captured_nvidia_smi(probe_script, smoke_script, fake_pynvml, h200_sysfs):
    probe = h200_probe(probe_script, fake_pynvml, h200_sysfs)
    results = smoke_script.compare(probe, smoke_script.parse_smi_csv(H200_CSV.read_text()))
    fields = {field for _bus, field, *_rest in results}
    assert {"name", "memory.total", "pci.bus_id", "driver_version", "pcie.link.gen.current", "pcie.link.gen.max",
            "pcie.link.width.current", "pcie.link.width.max", "compute_cap", "ecc.mode.current",
            "persistence_mode"} <= fields  # fmt: skip
    assert all(agree for *_rest, agree in results), smoke_script.report(results)
    assert smoke_script.report(results).splitlines()[-1] == f"{len(results)} of {len(results)} fields agree"


def test_smoke_reports_each_disagreement(probe_script, smoke_script, fake_pynvml, h200_sysfs):
    probe = h200_probe(probe_script, fake_pynvml, h200_sysfs)
    csv_text = H200_CSV.read_text().replace(", 16, 16, 35,", ", 8, 16, 35,").replace("Enabled, 0x", "Disabled, 0x")
    results = smoke_script.compare(probe, smoke_script.parse_smi_csv(csv_text))
    bad = {field: (ours, theirs) for _bus, field, ours, theirs, agree in results if not agree}
    assert bad == {
        "pcie.link.width.current": (16, 8),
        "sysfs pcie.link.width.current": (16, 8),
        "ecc.mode.current": ("enabled", "disabled"),
    }
    assert "DISAGREE  gpu-probe=16  nvidia-smi=8" in smoke_script.report(results)


def test_smoke_flags_gpus_seen_by_one_side_only(probe_script, smoke_script, fake_pynvml, h200_sysfs):
    probe = h200_probe(probe_script, fake_pynvml, h200_sysfs)
    csv_text = H200_CSV.read_text().replace("00000000:00:06.0", "00000000:00:07.0")
    results = smoke_script.compare(probe, smoke_script.parse_smi_csv(csv_text))
    assert [(bus, field, ours, theirs) for bus, field, ours, theirs, _ok in results] == [
        ("0000:00:07.0", "present", "missing", "present"),
        ("0000:00:06.0", "present", "present", "missing"),
    ]


def test_smoke_parsing_and_command_line(smoke_script, probe_script, fake_pynvml, h200_sysfs, tmp_path, capsys):
    row = smoke_script.parse_smi_csv(H200_CSV.read_text())[0]
    assert row["memory.total"] == "143771 MiB" and row["pci.bus_id"] == "00000000:00:06.0"
    assert smoke_script.smi_number("143771 MiB") == 143771 and smoke_script.smi_number("[N/A]") is None
    assert smoke_script.smi_mode("[N/A]") == "unsupported" and smoke_script.smi_mode("Enabled") == "enabled"
    saved = tmp_path / "probe.json"
    saved.write_text(json.dumps(h200_probe(probe_script, fake_pynvml, h200_sysfs)))
    assert smoke_script.main(["--probe-json", str(saved), "--smi-csv", str(H200_CSV)]) == 0
    assert "14 of 14 fields agree" in capsys.readouterr().out
    no_driver = {"gpus": {"driver": {"loaded": False, "reason": "no driver"}, "gpus": []}, "pcie": {"gpus": []}}
    saved.write_text(json.dumps(no_driver))
    assert smoke_script.main(["--probe-json", str(saved), "--smi-csv", str(H200_CSV)]) == 2


def test_smoke_quant_runs_the_workers_own_load_and_names_what_fails_without_cuda(smoke_script, capsys):
    # No GPU here: the worker's load refuses 4bit on CPU, and the report says so, not a traceback alone.
    pytest.importorskip("torch", reason="torch (make unit installs it) is not in this python")
    pytest.importorskip("transformers", reason="transformers is not in this python")
    assert smoke_script.main(["--quant", "--python", sys.executable]) == 1
    out = capsys.readouterr().out
    assert out.startswith("quant    FAILED (exit 1): ") and "quantization 4bit needs a CUDA GPU" in out, out
