"""The distros' NVML bindings, for real, over a fake libnvidia-ml.so.1 that answers from gpu_sim's
profiles (tests/unit/nvml_shim.py): Ubuntu 22.04's 7.352 (2016), Debian 12's 11.525, Ubuntu 24.04's
12.535. Each binding runs in a child Python of its own, finds the library by name as on a node, and
drives the probe (the gpu_facts module), the health watch's fan check, the power limits, the bench's
sampling and torch's build decision. Where a binding lacks a call, the field reads "unsupported" and
the decisions say so: no traceback, no made-up value, no CPU build of torch on GPUs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils import torch_build
from ansible_collections.budgetgpu.cluster.tests.unit import nvml_shim

REPO = Path(__file__).resolve().parents[4]
RELEASES = nvml_shim.binding_list()
H200_UUID = "GPU-0f7beba8-d2ad-9855-c2eb-a600187383a0"
RTX0 = "GPU-30900000-5a1e-4c0d-9b7e-000000000000"
RTX1 = "GPU-30900001-5a1e-4c0d-9b7e-000000000001"
CANDIDATES = yaml.safe_load((REPO / "roles/python_env/defaults/main.yml").read_text())["python_env_torch_cuda_variants"]

# What the H200 profile's GPU reads "unsupported" under each binding: the GPU itself has no fan,
# NVLink, NUMA id or retired pages; 7.352 also lacks the calls newer than 2016 (CUDA version,
# compute capability, the GPU's own PCIe maximum, energy, MIG, remapped rows, NVLink).
GPU_LACKS = {"fan_speed_pct", "nvlinks_active", "numa_node", "retired_pages"}
BINDING_LACKS = {
    "ubuntu-22.04": {"compute_capability", "pcie.gen_gpu_max", "energy_total_j", "mig_mode", "remapped_rows"},
    "debian-12": set(),
    "ubuntu-24.04": set(),
}


@pytest.fixture(scope="module", params=[release for release, _requirement in RELEASES])
def binding(request) -> nvml_shim.Binding:
    requirement = dict(RELEASES)[request.param]
    found = nvml_shim.install_binding(request.param, requirement)
    if found.path is None:
        pytest.skip(found.why_missing)
    return found


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> dict[str, Path]:
    """The shim as a current driver's library, and as an older one's (without the newer calls)."""
    return {
        "current": nvml_shim.build_shim(tmp_path_factory.mktemp("nvml-current")),
        "old": nvml_shim.build_shim(tmp_path_factory.mktemp("nvml-old"), old_driver=True),
    }


def profile(tmp_path: Path, name: str, faults: dict | None = None) -> Path:
    path = tmp_path / f"{name}.profile"
    path.write_text(nvml_shim.flat_profile(name, faults))
    return path


def field(gpu: dict, name: str):
    for part in name.split("."):
        gpu = gpu[part]
    return gpu


def test_every_binding_is_listed_once_per_release():
    assert [release for release, _requirement in RELEASES] == ["ubuntu-22.04", "debian-12", "ubuntu-24.04"]
    assert all("==" in requirement for _release, requirement in RELEASES)


def test_gpu_facts_reads_field_by_field_what_the_binding_has(binding, libs, tmp_path):
    result = nvml_shim.run_module(binding, libs["current"], profile(tmp_path, "h200"), {}, tmp_path)
    assert "failed" not in result, result
    facts = result["ansible_facts"]["budgetgpu_gpus"]
    driver, gpu = facts["driver"], facts["gpus"][0]
    assert (driver["state"], driver["version"], driver["nvml_version"]) == ("loaded", "580.159.04", "13.580.159.04")
    assert driver["binding"]["version"] == binding.version
    assert driver["binding"]["path"] == str(binding.path / "pynvml.py")
    assert facts["count"] == 1 and gpu["uuid"] == H200_UUID and gpu["name"] == "NVIDIA H200"
    assert gpu["bus_id"] == "0000:00:06.0" and gpu["memory_total_mib"] == 143771
    assert (gpu["power_limit_min_w"], gpu["power_limit_max_w"], gpu["power_limit_w"]) == (200.0, 700.0, 700.0)
    assert gpu["ecc_mode"] == {"current": "enabled", "pending": "enabled"}
    assert gpu["throttle_reasons"] == ["gpu_idle"]
    lacks = GPU_LACKS | BINDING_LACKS[binding.release]
    for name in ("compute_capability", "pcie.gen_gpu_max", "energy_total_j", "mig_mode", "remapped_rows", *GPU_LACKS):
        assert (field(gpu, name) == "unsupported") == (name in lacks), (binding.release, name, field(gpu, name))
    # Degrading is not failing: nothing the binding lacks shows up as an error.
    assert gpu["errors"] == {} and driver["errors"] == {}
    if binding.release == "ubuntu-22.04":
        assert driver["cuda_driver_version"] == "unsupported"
    else:
        assert driver["cuda_driver_version"] == "13.0" and gpu["compute_capability"] == "9.0"
        assert gpu["remapped_rows"] == {"correctable": 0, "uncorrectable": 0, "pending": False, "failure": False}


def test_torch_auto_refuses_where_the_binding_cannot_read_cuda_and_never_takes_the_cpu_build(binding, libs, tmp_path):
    facts = nvml_shim.run(binding, libs["current"], profile(tmp_path, "h200"), tmp_path / "state", "probe")["facts"]
    cuda = torch_build.driver_cuda(facts)
    problem = torch_build.torch_variant_problem("auto", cuda, facts)
    if binding.release == "ubuntu-22.04":
        assert cuda == torch_build.UNREADABLE
        with pytest.raises(ValueError, match="never installs the CPU build on GPUs"):
            torch_build.torch_variant("auto", cuda, CANDIDATES)
        assert problem.startswith("the node has 1 NVIDIA GPU(s) with driver 580.159.04 loaded, but pynvml 7.352.0 ")
        assert f"(nvidia-ml-py3, {binding.path / 'pynvml.py'}) cannot read the driver's CUDA version" in problem
    else:
        assert cuda == "13.0" and problem == ""
        assert torch_build.torch_variant("auto", cuda, CANDIDATES) == "cu130"


def test_a_node_without_a_driver_library_reads_no_driver_and_keeps_the_cpu_build(binding, tmp_path):
    facts = nvml_shim.run(binding, None, profile(tmp_path, "h200"), tmp_path / "state", "probe")["facts"]
    assert facts["count"] == 0 and facts["driver"]["state"] == "no_driver"
    assert facts["driver"]["binding"]["version"] == binding.version
    cuda = torch_build.driver_cuda(facts)
    assert cuda is None and torch_build.torch_variant("auto", cuda, CANDIDATES) == "cpu"
    assert torch_build.torch_variant_problem("auto", cuda, facts) == ""


def test_a_dead_fan_is_found_with_every_binding(binding, libs, tmp_path):
    # GPU 0's fan stopped at 88 C; GPU 1's turns at 30% of an 80% target.
    faults = {RTX0: {"fans": [{"speed": 0, "target": 80}], "temp": 88}, RTX1: {"fans": [{"speed": 30, "target": 80}]}}
    faults[RTX1]["temp"] = 85
    path = profile(tmp_path, "rtx3090x4-risers", faults)
    answer = nvml_shim.run(binding, libs["current"], path, tmp_path / "state", "health")
    fans = {gpu["uuid"]: gpu["fans"] for gpu in answer["sample"]["gpus"]}
    dead = {finding["gpu"]: finding["detail"] for finding in answer["fan_findings"]}
    assert dead[RTX0].endswith(": fan dead?") and "fan 0%" in dead[RTX0] and "at 88 C" in dead[RTX0]
    if binding.release == "ubuntu-22.04":
        # No nvmlDeviceGetNumFans / _v2 / target in 7.352: v1 reads the first fan, without its target, so a
        # slow fan is not told from one that is told to be slow; a stopped one still is.
        assert fans[RTX0] == [{"speed_pct": 0, "target_pct": "unsupported"}]
        assert RTX1 not in dead
    else:
        assert fans[RTX0] == [{"speed_pct": 0, "target_pct": 80}]
        assert "fan 30% (target 80%) at 85 C" in dead[RTX1]


def test_a_new_binding_on_an_old_driver_library_falls_back_to_the_v1_fan(libs, tmp_path):
    release, requirement = RELEASES[-1]
    newest = nvml_shim.install_binding(release, requirement)
    if newest.path is None:
        pytest.skip(newest.why_missing)
    path = profile(tmp_path, "rtx3090x4-risers", {RTX0: {"fans": [{"speed": 0, "target": 80}], "temp": 88}})
    answer = nvml_shim.run(newest, libs["old"], path, tmp_path / "state", "health")
    gpu = answer["sample"]["gpus"][0]
    # The library lacks the calls (FunctionNotFound from the binding): "unsupported", not an error.
    assert gpu["fans"] == [{"speed_pct": 0, "target_pct": "unsupported"}] and gpu["errors"] == {}
    assert [finding["gpu"] for finding in answer["fan_findings"]] == [RTX0]


def test_power_limits_are_set_and_checked_through_every_binding(binding, libs, tmp_path):
    path, state = profile(tmp_path, "rtx3090x4-risers"), tmp_path / "state"
    first = nvml_shim.run(binding, libs["current"], path, state, "power", json.dumps({"all": 300}))["power"]
    assert first["failed"] is False and first["changed"] is True
    assert [(change["from_w"], change["to_w"]) for change in first["changes"]] == [(350.0, 300.0)] * 4
    again = nvml_shim.run(binding, libs["current"], path, state, "power", json.dumps({"all": 300}))["power"]
    assert again["changed"] is False and again["msg"] == "every power limit as declared"
    too_high = nvml_shim.run(binding, libs["current"], path, state, "power", json.dumps({RTX0: 500}))["power"]
    assert too_high["failed"] is True and "500 W is outside the card's range 100-400 W" in too_high["msg"]


def test_the_bench_samples_every_gpu_through_every_binding(binding, libs, tmp_path):
    path = profile(tmp_path, "h200")
    bench = nvml_shim.run(binding, libs["current"], path, tmp_path / "state", "bench")["bench"]
    (gpu,) = bench["gpus"]
    assert gpu["uuid"] == H200_UUID and gpu["samples"]["count"] >= 2
    assert gpu["samples"]["temperature_c_max"] == 35 and gpu["samples"]["throttle_reasons"] == ["gpu_idle"]
    # Without the compute capability (7.352) the bench measures fp32 only: it cannot tell what else the card runs.
    expected = ["fp32"] if binding.release == "ubuntu-22.04" else ["fp32", "fp16", "bf16"]
    assert gpu["dtypes"] == expected


def test_retired_pages_are_counted_with_every_binding(binding, libs, tmp_path):
    pages = {"single_bit": [4096, 8192], "double_bit": [12288], "pending": 1}
    path = profile(tmp_path, "h200", {H200_UUID: {"retired_pages": pages}})
    gpu = nvml_shim.run(binding, libs["current"], path, tmp_path / "state", "probe")["facts"]["gpus"][0]
    # 7.352 returns a map object (it was written for Python 2): counted all the same.
    assert gpu["retired_pages"] == {"single_bit_ecc": 2, "double_bit_ecc": 1, "pending": True}
