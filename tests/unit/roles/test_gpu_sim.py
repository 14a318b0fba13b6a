"""gpu_sim: the pynvml drop-in behaves like nvidia-ml-py, and every profile is consistent."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pynvml as real_pynvml
import pytest
from ansible_collections.budgetgpu.cluster.plugins.module_utils import nvml_probe, pcie

PROFILES = sorted((Path(__file__).resolve().parents[3] / "roles" / "gpu_sim" / "files" / "profiles").glob("*.json"))


def test_the_required_profiles_exist():
    assert {p.stem for p in PROFILES} >= {"h200", "rtx3090x4-risers", "mixed-3090-4090", "no-driver"}


def test_error_classes_and_codes_are_nvidia_ml_pys(fake_pynvml):
    fake = fake_pynvml("h200")
    for code, real_class in real_pynvml.NVMLError._valClassMapping.items():
        if code in fake.NVMLError._valClassMapping:
            fake_class = fake.NVMLError._valClassMapping[code]
            assert fake_class.__name__ == real_class.__name__
            assert isinstance(fake.NVMLError(code), fake_class)
            assert (
                str(fake.NVMLError(code)) == str(real_pynvml.NVMLError(code)) or code == real_pynvml.NVML_ERROR_UNKNOWN
            )
    for name in ("NotSupported", "DriverNotLoaded", "LibraryNotFound", "LibRmVersionMismatch", "Uninitialized"):
        assert getattr(fake, f"NVMLError_{name}").__name__ == getattr(real_pynvml, f"NVMLError_{name}").__name__


def test_without_a_profile_init_fails_as_without_libnvidia_ml(fake_pynvml):
    fake = fake_pynvml(None)
    with pytest.raises(fake.NVMLError_LibraryNotFound) as info:
        fake.nvmlInit()
    assert info.value.value == real_pynvml.NVML_ERROR_LIBRARY_NOT_FOUND


def test_calls_before_init_fail_uninitialized(fake_pynvml):
    fake = fake_pynvml("h200")
    with pytest.raises(fake.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()
    fake.nvmlInit()
    with pytest.raises(fake.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetHandleByIndex(1)
    fake.nvmlShutdown()


@pytest.mark.parametrize("profile", [p.stem for p in PROFILES])
def test_profile_nvml_and_sysfs_agree(profile, fake_pynvml, sim_tree, tmp_path):
    facts_pcie = pcie.probe_pcie(sim_tree(profile))
    facts_nvml = nvml_probe.probe_nvml(fake_pynvml(profile), str(tmp_path), str(tmp_path))
    data = json.loads(next(p for p in PROFILES if p.stem == profile).read_text())
    assert data["profile"] == profile and data["description"]
    if facts_nvml["driver"]["loaded"]:
        assert facts_nvml["count"] == facts_pcie["count"] > 0
        for gpu, link in zip(facts_nvml["gpus"], facts_pcie["gpus"], strict=True):
            assert gpu["bus_id"] == link["bus_id"]
            assert gpu["pcie"]["width_current"] == link["link"]["current_width"]
            assert gpu["pcie"]["gen_current"] == link["link"]["current_gen"]
    else:
        assert facts_pcie["count"] > 0  # GPUs on the bus, no driver


def test_renderer_replaces_another_profile_and_keeps_its_own(render_sim, tmp_path):
    profiles = {p.stem: str(p) for p in PROFILES}
    root = str(tmp_path / "sys")
    assert render_sim.render_if_changed(profiles["h200"], root) is True
    assert render_sim.render_if_changed(profiles["h200"], root) is False
    assert render_sim.render_if_changed(profiles["no-driver"], root) is True
    assert sorted(os.listdir(os.path.join(root, "bus", "pci", "devices")))[0] == "0000:00:01.0"
    assert not os.path.exists(os.path.join(root, "devices", "pci0000:00", "0000:00:06.0"))  # the H200 is gone
    assert pcie.probe_pcie(root)["count"] == 2


@pytest.mark.parametrize("profile", [p.stem for p in PROFILES])
def test_the_watchs_sample_agrees_with_the_probe(profile, fake_pynvml, tmp_path, monkeypatch):
    monkeypatch.setenv("BUDGETGPU_SIM_FAULTS", str(tmp_path / "none.json"))
    fake = fake_pynvml(profile)
    probed, sample = nvml_probe.probe_nvml(fake, str(tmp_path), str(tmp_path)), nvml_probe.health_sample(fake)
    assert len(sample["gpus"]) == probed["count"]
    for gpu, watched in zip(probed["gpus"], sample["gpus"], strict=True):
        for key in ("uuid", "bus_id", "temperature_c", "power_draw_w", "retired_pages", "remapped_rows"):
            assert watched[key] == gpu[key], key
        assert nvml_probe.decode_throttle_reasons(watched["throttle_reasons"]) == gpu["throttle_reasons"]
        assert watched["pcie"]["replay_counter"] == gpu["pcie"]["replay_counter"]
        fans = watched["fans"]
        assert (
            fans == "unsupported"
            if gpu["fan_speed_pct"] == "unsupported"
            else fans[0]["speed_pct"] == gpu["fan_speed_pct"]
        )


def test_faults_lay_over_one_gpu_and_gone_takes_it_off_the_bus(fake_pynvml, tmp_path, monkeypatch):
    faults = tmp_path / "faults.json"
    monkeypatch.setenv("BUDGETGPU_SIM_FAULTS", str(faults))
    fake = fake_pynvml("h200")
    uuid = nvml_probe.health_sample(fake)["gpus"][0]["uuid"]
    assert nvml_probe.health_sample(fake)["gpus"][0]["utilization_pct"] == 0  # idle unless told
    faults.write_text(
        json.dumps({uuid: {"temp": 91, "ecc_dbe_volatile": 2, "remapped_rows": [0, 3, 0, 1], "util_gpu": 97}})
    )
    gpu = nvml_probe.health_sample(fake)["gpus"][0]  # nvmlInit rereads the faults
    assert (gpu["temperature_c"], gpu["ecc_double_bit_volatile"], gpu["utilization_pct"]) == (91, 2, 97)
    assert gpu["remapped_rows"] == {"correctable": 0, "uncorrectable": 3, "pending": False, "failure": True}
    faults.write_text(json.dumps({uuid: {"gone": True}}))
    assert nvml_probe.health_sample(fake)["gpus"] == []
