"""gpu_power: which GPU gets which cap, the card's range, the node's budget, and setting it in NVML."""

from __future__ import annotations

import pytest
from ansible_collections.budgetgpu.cluster.plugins.module_utils import gpu_power, nvml_probe

UUID_3 = "GPU-30900003-5a1e-4c0d-9b7e-000000000003"


@pytest.fixture
def mixed(fake_pynvml, tmp_path):
    """The mixed-3090-4090 node's GPUs as gpu_facts reports them (3090s at 01/21, 4090s at 41/61)."""
    nvml = fake_pynvml("mixed-3090-4090")
    return nvml, nvml_probe.probe_nvml(nvml, proc_root=str(tmp_path))["gpus"]


def watts(targets):
    return {index: cap["watts"] for index, cap in targets.items()}


def test_the_probe_reports_each_cards_range_default_and_counter(mixed):
    _nvml, gpus = mixed
    assert [(g["power_limit_min_w"], g["power_limit_max_w"], g["power_limit_default_w"]) for g in gpus] == [
        (100.0, 400.0, 350.0),
        (100.0, 400.0, 350.0),
        (150.0, 600.0, 450.0),
        (150.0, 600.0, 450.0),
    ]
    assert [g["power_limit_w"] for g in gpus] == [350.0, 350.0, 450.0, 450.0]
    assert all(isinstance(g["energy_total_j"], float) and g["energy_total_j"] > 0 for g in gpus)


def test_one_number_caps_every_gpu(mixed):
    assert watts(gpu_power.resolve_caps(mixed[1], 300)[0]) == {0: 300, 1: 300, 2: 300, 3: 300}


def test_a_gpus_own_key_beats_its_model_which_beats_all(mixed):
    caps = {
        "all": 320,
        "NVIDIA GeForce RTX 4090": 350,
        "41:00.0": 300,  # short bus id form
        "GPU-30900001-5A1E-4C0D-9B7E-000000000001": 250,  # UUIDs compare without case
    }
    targets, problems = gpu_power.resolve_caps(mixed[1], caps)
    assert problems == []
    assert watts(targets) == {0: 320, 1: 250, 2: 300, 3: 350}
    assert targets[2]["key"] == "41:00.0"


@pytest.mark.parametrize("bus_id", ["00000000:61:00.0", "0000:61:00.0", "61:00.0", "0000:61:00.0 "])
def test_every_bus_id_form_pcie_normalises_names_the_gpu(mixed, bus_id):
    targets, problems = gpu_power.resolve_caps(mixed[1], {bus_id: 200})
    assert (watts(targets), problems) == ({3: 200}, [])


def test_keys_that_match_nothing_are_refused_and_say_why(mixed):
    _targets, problems = gpu_power.resolve_caps(
        mixed[1], {"GPU-deadbeef": 200, "NVIDIA H200": 300, "0000:09:00.0": 200, 60.0: 250}
    )
    assert len(problems) == 4
    assert problems[0].startswith("gpu_power_limit_watts['GPU-deadbeef']: this uuid matches no GPU of the node")
    assert "this model matches no GPU" in problems[1] and "this bus id matches no GPU" in problems[2]
    assert "YAML read this key as a number: quote bus ids" in problems[3]  # an unquoted 01:00.0


def test_one_gpu_named_twice_with_two_caps_is_refused(mixed):
    _targets, problems = gpu_power.resolve_caps(
        mixed[1], {"01:00.0": 200, "GPU-30900000-5a1e-4c0d-9b7e-000000000000": 250}
    )
    assert len(problems) == 1 and "is named by '01:00.0' (200 W) and by 'GPU-3090" in problems[0]
    assert gpu_power.resolve_caps(mixed[1], {"01:00.0": 200, "0000:01:00.0": 200})[1] == []


@pytest.mark.parametrize("value", ["280W", True, 0, -5, None])
def test_a_cap_must_be_watts(mixed, value):
    _targets, problems = gpu_power.resolve_caps(mixed[1], {"all": value})
    assert problems == [f"gpu_power_limit_watts['all']: expected watts (a number above 0), found {value!r}"]


def test_caps_outside_a_cards_range_name_host_gpu_value_and_range(mixed):
    problems = gpu_power.cap_problems("node1", mixed[1], {"all": 420})
    # The 3090s go to 400 W, the 4090s to 600 W.
    assert problems == [
        "node1: gpu_power_limit_watts['all']: GPU 0 (GPU-30900000-5a1e-4c0d-9b7e-000000000000, 0000:01:00.0, "
        "NVIDIA GeForce RTX 3090): 420 W is outside the card's range 100-400 W (NVML power management limit "
        "constraints): choose a cap inside it",
        "node1: gpu_power_limit_watts['all']: GPU 1 (GPU-30900001-5a1e-4c0d-9b7e-000000000001, 0000:21:00.0, "
        "NVIDIA GeForce RTX 3090): 420 W is outside the card's range 100-400 W (NVML power management limit "
        "constraints): choose a cap inside it",
    ]
    assert gpu_power.cap_problems("node1", mixed[1], {"NVIDIA GeForce RTX 4090": 149})[0].endswith(
        "149 W is outside the card's range 150-600 W (NVML power management limit constraints): choose a cap inside it"
    )
    assert gpu_power.cap_problems("node1", mixed[1], {"all": 150, "NVIDIA GeForce RTX 3090": 400}) == []


def test_a_card_without_power_management_refuses_any_cap(mixed):
    gpus = [dict(mixed[1][0], power_limit_min_w="unsupported", power_limit_max_w="unsupported")]
    assert "the card reports no power limit range (NVML: unsupported)" in gpu_power.cap_problems("n", gpus, 200)[0]


def test_the_budget_counts_caps_and_the_default_of_uncapped_gpus(mixed):
    caps = {"NVIDIA GeForce RTX 3090": 250}
    # 250 + 250 + 450 + 450 (the 4090s uncapped, at their default limit)
    assert gpu_power.cap_problems("node1", mixed[1], caps, 1400) == []
    problems = gpu_power.cap_problems("node1", mixed[1], caps, 1399)
    assert problems == [
        "node1: gpu_power_budget_watts: the GPUs' limits add up to 1400 W (GPU 0 250 W, GPU 1 250 W, GPU 2 450 W, "
        "GPU 3 450 W), above the budget 1399 W: lower the caps"
    ]
    assert gpu_power.cap_problems("node1", mixed[1], None, "2 kW") == [
        "node1: gpu_power_budget_watts: expected watts (a number above 0), found '2 kW'"
    ]


def test_apply_sets_only_what_differs_and_check_mode_sets_nothing(mixed):
    nvml, gpus = mixed
    nvml.nvmlInit()
    caps = {"all": 300, "GPU-40900003-7c2f-4a55-8e11-000000000003": 350}
    planned = gpu_power.apply_caps(nvml, gpus, caps, check_mode=True)
    assert [(c["index"], c["from_w"], c["to_w"]) for c in planned] == [
        (0, 350.0, 300.0),
        (1, 350.0, 300.0),
        (2, 450.0, 300.0),
        (3, 450.0, 350.0),
    ]
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetPowerManagementLimit(handle) == 350000  # check mode changed nothing
    assert gpu_power.apply_caps(nvml, gpus, caps) == planned
    assert [nvml.nvmlDeviceGetEnforcedPowerLimit(nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(4)] == [
        300000,
        300000,
        300000,
        350000,
    ]
    assert gpu_power.apply_caps(nvml, gpus, caps) == []  # the second run changes nothing
    nvml.nvmlShutdown()


def test_enforce_corrects_drift_and_reports_it(fake_pynvml):
    nvml = fake_pynvml("rtx3090x4-risers")
    assert gpu_power.enforce(nvml, "node1", 280)["changed"] is True
    nvml.nvmlInit()
    nvml.nvmlDeviceSetPowerManagementLimit(nvml.nvmlDeviceGetHandleByIndex(3), 400000)  # nvidia-smi -pl 400
    nvml.nvmlShutdown()
    result = gpu_power.enforce(nvml, "node1", 280)
    assert (result["failed"], result["changed"]) == (False, True)
    assert result["drift"] == [f"GPU 3 ({UUID_3}, 0000:04:00.0, NVIDIA GeForce RTX 3090): power limit 400 W -> 280 W"]
    assert gpu_power.enforce(nvml, "node1", 280)["changed"] is False


def test_enforce_refuses_and_changes_nothing(fake_pynvml, tmp_path):
    nvml = fake_pynvml("rtx3090x4-risers")
    result = gpu_power.enforce(nvml, "node1", {"all": 280, "04:00.0": 500}, budget=2000)
    assert result["failed"] is True and result["changed"] is False
    assert result["problems"] == [
        f"node1: gpu_power_limit_watts['04:00.0']: GPU 3 ({UUID_3}, 0000:04:00.0, NVIDIA GeForce RTX 3090): 500 W is "
        "outside the card's range 100-400 W (NVML power management limit constraints): choose a cap inside it"
    ]
    facts = nvml_probe.probe_nvml(nvml, proc_root=str(tmp_path))
    assert [gpu["power_limit_w"] for gpu in facts["gpus"]] == [350.0] * 4


def test_enforce_without_caps_asks_nothing_of_nvml(fake_pynvml):
    assert gpu_power.enforce(fake_pynvml(None), "node1", {})["msg"] == "no power caps declared"
    assert gpu_power.enforce(None, "node1", {})["failed"] is False  # no nvidia-ml-py: fine without caps
    assert gpu_power.enforce(None, "node1", 250)["msg"] == "node1: nvidia-ml-py (pynvml) is not installed"
    result = gpu_power.enforce(fake_pynvml("no-driver"), "node1", 280)
    assert result["failed"] is True and result["msg"].startswith("node1: no usable NVIDIA driver")


def test_the_simulation_forgets_a_limit_at_a_reboot_as_nvml_does(fake_pynvml, monkeypatch, tmp_path):
    nvml = fake_pynvml("h200")
    gpu_power.enforce(nvml, "h200", 500)
    facts = nvml_probe.probe_nvml(nvml, proc_root=str(tmp_path))
    assert facts["gpus"][0]["power_limit_w"] == 500.0
    monkeypatch.setenv("BUDGETGPU_SIM_STATE", str(tmp_path / "after-reboot.json"))
    facts = nvml_probe.probe_nvml(nvml, proc_root=str(tmp_path))
    assert facts["gpus"][0]["power_limit_w"] == facts["gpus"][0]["power_limit_default_w"] == 700.0


def test_the_simulation_refuses_what_nvml_refuses(fake_pynvml, monkeypatch):
    nvml = fake_pynvml("rtx3090x4-risers")
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(nvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceSetPowerManagementLimit(handle, 450000)
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(nvml.NVMLError_NoPermission):
        nvml.nvmlDeviceSetPowerManagementLimit(handle, 300000)
    assert nvml.nvmlDeviceGetPowerManagementLimit(handle) == 350000
    nvml.nvmlShutdown()
