"""nvml_probe: the H200 node's NVML answers, simulated profiles, and every driver state."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pynvml as real_pynvml
import pytest
from ansible_collections.budgetgpu.cluster.plugins.module_utils import nvml_probe

H200 = Path(__file__).resolve().parents[3] / "fixtures" / "h200-node"


def smi_row() -> dict[str, str]:
    with open(H200 / "nvidia-smi-query.csv", encoding="utf-8") as handle:
        rows = list(csv.reader(handle, skipinitialspace=True))
    return dict(zip(rows[0], rows[1], strict=True))


def test_h200_profile_matches_the_captured_node(fake_pynvml, tmp_path):
    facts = nvml_probe.probe_nvml(fake_pynvml("h200"), proc_root=str(tmp_path), modules_root=str(tmp_path))
    captured = json.loads((H200 / "nvml.json").read_text())
    smi = smi_row()
    assert facts["driver"]["state"] == "loaded" and facts["driver"]["loaded"] is True
    assert facts["driver"]["version"] == smi["driver_version"] == "580.159.04"
    assert facts["driver"]["nvml_version"] == captured["nvml"]
    assert facts["driver"]["cuda_driver_version"] == "13.0"
    assert facts["count"] == 1
    gpu = facts["gpus"][0]
    assert gpu["name"] == smi["name"] == "NVIDIA H200"
    assert gpu["uuid"] == smi["uuid"]
    assert gpu["serial"] == "1653824016794"
    assert gpu["bus_id"] == "0000:00:06.0"
    assert f"{gpu['memory_total_mib']} MiB" == smi["memory.total [MiB]"]
    assert gpu["compute_capability"] == smi["compute_cap"] == "9.0"
    assert gpu["pcie"] == {
        "gen_current": 5,
        "gen_max": 5,
        "gen_gpu_max": 5,
        "width_current": 16,
        "width_max": 16,
        "replay_counter": 0,
    }
    assert gpu["temperature_c"] == 35
    assert gpu["power_draw_w"] == 77.65 and gpu["power_limit_w"] == 700.0
    assert (gpu["sm_clock_mhz"], gpu["sm_clock_max_mhz"]) == (345, 1980)
    assert gpu["throttle_reasons"] == ["gpu_idle"]  # nvidia-smi: clocks_event_reasons.active 0x1
    assert gpu["ecc_mode"] == {"current": "enabled", "pending": "enabled"}
    assert gpu["persistence_mode"] == "enabled"
    assert gpu["mig_mode"] == {"current": "disabled", "pending": "disabled"}
    assert gpu["remapped_rows"] == {"correctable": 0, "uncorrectable": 0, "pending": False, "failure": False}
    # What this GPU does not support is said so, not a crash and not a made-up number.
    for field in ("fan_speed_pct", "numa_node", "nvlinks_active", "retired_pages"):
        assert gpu[field] == nvml_probe.UNSUPPORTED, field
    assert gpu["errors"] == {}


def test_consumer_cards_report_what_they_lack(fake_pynvml, tmp_path):
    facts = nvml_probe.probe_nvml(fake_pynvml("rtx3090x4-risers"), str(tmp_path), str(tmp_path))
    assert facts["count"] == 4
    assert [gpu["bus_id"] for gpu in facts["gpus"]] == ["0000:01:00.0", "0000:02:00.0", "0000:03:00.0", "0000:04:00.0"]
    gpu = facts["gpus"][3]
    assert gpu["name"] == "NVIDIA GeForce RTX 3090" and gpu["memory_total_mib"] == 24576
    assert gpu["compute_capability"] == "8.6"
    assert (gpu["pcie"]["gen_current"], gpu["pcie"]["width_current"], gpu["pcie"]["width_max"]) == (3, 1, 16)
    assert gpu["pcie"]["gen_max"] == 3 and gpu["pcie"]["gen_gpu_max"] == 4  # a gen4 card on a gen3 port
    assert gpu["pcie"]["replay_counter"] == 1873
    assert gpu["ecc_mode"] == gpu["mig_mode"] == gpu["serial"] == nvml_probe.UNSUPPORTED
    assert gpu["nvlinks_active"] == 0  # four NVLink ports, no bridge fitted
    assert gpu["fan_speed_pct"] == 30


def test_mixed_profile_names_both_models(fake_pynvml, tmp_path):
    facts = nvml_probe.probe_nvml(fake_pynvml("mixed-3090-4090"), str(tmp_path), str(tmp_path))
    assert [gpu["name"][-4:] for gpu in facts["gpus"]] == ["3090", "3090", "4090", "4090"]
    assert facts["gpus"][3]["pcie"]["gen_current"] == 1
    assert facts["gpus"][2]["nvlinks_active"] == nvml_probe.UNSUPPORTED


def test_real_nvidia_ml_py_without_a_driver_says_no_driver(tmp_path):
    # This build machine has nvidia-ml-py but no libnvidia-ml.so.1: the real library's error path.
    facts = nvml_probe.probe_nvml(real_pynvml, proc_root=str(tmp_path), modules_root=str(tmp_path))
    assert facts["count"] == 0 and facts["gpus"] == []
    assert facts["driver"]["state"] == "no_driver" and facts["driver"]["loaded"] is False
    assert "libnvidia-ml.so.1 is missing" in facts["driver"]["reason"]


def test_no_driver_profile_raises_like_real_nvml(fake_pynvml, tmp_path):
    facts = nvml_probe.probe_nvml(fake_pynvml("no-driver"), str(tmp_path), str(tmp_path))
    assert facts["driver"]["state"] == "no_driver" and facts["count"] == 0


class StubNvml:
    """Only what probe_nvml touches before any GPU: init fails with the given NVML code."""

    NVMLError = real_pynvml.NVMLError

    def __init__(self, code: int) -> None:
        self.code = code

    def nvmlInit(self) -> None:
        raise real_pynvml.NVMLError(self.code)


def kernel_tree(tmp_path: Path, loaded: str | None, installed: bool) -> tuple[str, str]:
    import os

    proc = tmp_path / "proc"
    (proc / "driver" / "nvidia").mkdir(parents=True)
    if loaded:
        (proc / "driver" / "nvidia" / "version").write_text(
            f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {loaded}  Release Build  (nixbld@)\n"
        )
    modules = tmp_path / "modules" / os.uname().release
    modules.mkdir(parents=True)
    dep = "kernel/drivers/net/dummy.ko:\n"
    if installed:
        dep += "updates/dkms/nvidia.ko.xz:\nupdates/dkms/nvidia-uvm.ko.xz: updates/dkms/nvidia.ko.xz\n"
    (modules / "modules.dep").write_text(dep)
    return str(proc), str(tmp_path / "modules")


@pytest.mark.parametrize(
    ("code", "loaded", "installed", "state", "words"),
    [
        (real_pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, None, False, "no_driver", "install the driver"),
        (real_pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "550.120", True, "no_library", "550.120 is loaded"),
        (real_pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, None, True, "not_loaded", "installed for kernel"),
        (real_pynvml.NVML_ERROR_DRIVER_NOT_LOADED, None, True, "not_loaded", "modprobe nvidia"),
        (real_pynvml.NVML_ERROR_DRIVER_NOT_LOADED, None, False, "not_loaded", "none is installed"),
        (real_pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "550.120", True, "version_mismatch", "(550.120)"),
        # Root in a container: the library makes /dev/nvidiactl itself and fails with Unknown.
        (real_pynvml.NVML_ERROR_UNKNOWN, None, False, "not_loaded", "(nvmlInit: Unknown Error)"),
        (real_pynvml.NVML_ERROR_NO_PERMISSION, "550.120", True, "error", "Insufficient Permissions"),
    ],
)
def test_driver_states(tmp_path, code, loaded, installed, state, words):
    proc, modules = kernel_tree(tmp_path, loaded, installed)
    driver = nvml_probe.probe_nvml(StubNvml(code), proc_root=proc, modules_root=modules)["driver"]
    assert driver["state"] == state
    assert driver["loaded"] is False
    assert words in driver["reason"]
    assert driver["kernel_module_installed"] is installed
    assert driver["kernel_module_version"] == loaded


def test_kernel_module_version_reads_old_and_open_module_banners(tmp_path):
    (tmp_path / "driver" / "nvidia").mkdir(parents=True)
    version = tmp_path / "driver" / "nvidia" / "version"
    version.write_text((H200 / "proc-driver-version.txt").read_text())
    assert nvml_probe.kernel_module_version(str(tmp_path)) == "580.159.04"
    version.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.129.03  Thu Oct 19 18:56:32 UTC 2023\n")
    assert nvml_probe.kernel_module_version(str(tmp_path)) == "535.129.03"


def test_other_errors_are_kept_per_field_and_old_pynvml_still_works(fake_pynvml, tmp_path):
    nvml = fake_pynvml("h200")

    def no_permission(handle):
        raise nvml.NVMLError(nvml.NVML_ERROR_NO_PERMISSION)

    nvml.nvmlDeviceGetPowerUsage = no_permission
    del nvml.nvmlDeviceGetCurrentClocksEventReasons  # nvidia-ml-py before 12.535
    del nvml.nvmlDeviceGetRemappedRows  # a function this library lacks reads as unsupported
    gpu = nvml_probe.probe_nvml(nvml, str(tmp_path), str(tmp_path))["gpus"][0]
    assert gpu["power_draw_w"] is None
    assert gpu["errors"] == {"power_draw_w": "Insufficient Permissions"}
    assert gpu["throttle_reasons"] == ["gpu_idle"]
    assert gpu["remapped_rows"] == nvml_probe.UNSUPPORTED


def test_shutdown_always_follows_init(fake_pynvml, tmp_path):
    nvml = fake_pynvml("h200")
    nvml_probe.probe_nvml(nvml, str(tmp_path), str(tmp_path))
    with pytest.raises(nvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()


@pytest.mark.parametrize(
    ("mask", "names"),
    [
        (0, []),
        (0x1, ["gpu_idle"]),
        (0x4 | 0x40, ["sw_power_cap", "hw_thermal_slowdown"]),
        (0x1 | 0x1000, ["gpu_idle", "0x1000"]),
    ],
)
def test_decode_throttle_reasons(mask, names):
    assert nvml_probe.decode_throttle_reasons(mask) == names


def test_throttle_bits_match_nvidia_ml_py():
    for bit, name in nvml_probe.THROTTLE_REASONS:
        camel = "".join(part.capitalize() for part in name.split("_"))
        assert getattr(real_pynvml, f"nvmlClocksThrottleReason{camel}") == bit, name


def test_error_codes_match_nvidia_ml_py():
    for name in ("NOT_SUPPORTED", "DRIVER_NOT_LOADED", "LIBRARY_NOT_FOUND", "FUNCTION_NOT_FOUND", "INVALID_ARGUMENT"):
        assert getattr(nvml_probe, f"ERROR_{name}") == getattr(real_pynvml, f"NVML_ERROR_{name}")
    assert nvml_probe.ERROR_LIB_RM_VERSION_MISMATCH == real_pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH


def test_bus_id_and_cuda_version_forms():
    assert nvml_probe.nvml_bus_id_to_sysfs("00000000:3B:00.0") == "0000:3b:00.0"
    assert nvml_probe.nvml_bus_id_to_sysfs(b"00000001:01:00.0") == "0001:01:00.0"
    assert nvml_probe.cuda_version_text(13000) == "13.0"
    assert nvml_probe.cuda_version_text(12040) == "12.4"
