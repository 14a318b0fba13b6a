"""roles/torchrun/files/budgetgpu-job-energy: the energy counters a job's unit records at its start,
read through nvml_probe (the probes' own NVML reader, the same counter gpu_facts reports)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ansible_collections.budgetgpu.cluster.plugins.module_utils import nvml_probe

REPO = Path(__file__).resolve().parents[3]


def load_recorder():
    from ansible_collections.budgetgpu.cluster.tests.unit.file_modules import load_file_module

    return load_file_module("budgetgpu_job_energy", REPO / "roles" / "torchrun" / "files" / "budgetgpu-job-energy")


def test_the_start_record_holds_each_gpus_counter_as_the_probe_reads_it(fake_pynvml, monkeypatch, tmp_path):
    nvml = fake_pynvml("rtx3090x4-risers")
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    recorder = load_recorder()
    assert recorder.main([str(tmp_path / "energy-start.json")]) == 0
    record = json.loads((tmp_path / "energy-start.json").read_text())
    probed = nvml_probe.probe_nvml(nvml)["gpus"]
    assert len(record["gpus"]) == 4
    for gpu in probed:
        # The counter grows with simulated time: the recorder read it a moment before the probe.
        assert 0 < record["gpus"][gpu["uuid"]] <= gpu["energy_total_j"]
    assert (tmp_path / "energy-start.json").stat().st_mode & 0o777 == 0o644


def test_no_nvml_records_no_gpu_and_never_stops_the_job(fake_pynvml, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(None))
    recorder = load_recorder()
    assert recorder.main([str(tmp_path / "energy-start.json")]) == 0
    assert json.loads((tmp_path / "energy-start.json").read_text())["gpus"] == {}
