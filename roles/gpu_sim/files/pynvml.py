"""A drop-in for nvidia-ml-py's `pynvml` that answers from a budgetgpu GPU simulation profile.

Installed by the budgetgpu.cluster.gpu_sim role on test and demo nodes only. It covers the
calls that budgetgpu's probes make, with the real module's names, error classes and codes.
The profile is read at nvmlInit from $BUDGETGPU_SIM_PROFILE or /etc/budgetgpu-sim/profile.json;
without one, nvmlInit fails as NVML does on a node without libnvidia-ml.so.1.

Faults for tests: at every nvmlInit the drop-in also reads $BUDGETGPU_SIM_FAULTS or
/etc/budgetgpu-sim/faults.json, {"<GPU uuid>": {<nvml key>: value, ...}}, and lays those keys over
the GPU's answers ({"fans": [{"speed": 0, "target": 80}], "temp": 88, "pcie_replay": 900,
"pcie_width_cur": 1, "ecc_dbe_volatile": 2}); {"gone": true} takes the GPU off the bus (NVML no longer
lists it). A process that calls nvmlInit again (the health watch, once a pass) sees the new faults.

Per GPU answers live under the PCI function's "nvml" key, with the keys of
tests/fixtures/h200-node/nvml.json; a string "ERR:NVMLError_<Name>..." makes that call raise
NVMLError_<Name>. PCIe generation and width default to the function's sysfs link attributes.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

PROFILE_DEFAULT = "/etc/budgetgpu-sim/profile.json"
FAULTS_DEFAULT = "/etc/budgetgpu-sim/faults.json"

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_UNKNOWN = 999

NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_GRAPHICS = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_NVLINK_MAX_LINKS = 18
NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0
NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1

_MESSAGES = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_LIB_RM_VERSION_MISMATCH: "RM has detected an NVML/RM version mismatch.",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}


class NVMLError(Exception):
    """Base class; NVMLError(code) returns the subclass for that code, as in nvidia-ml-py."""

    _valClassMapping: dict[int, type] = {}

    def __new__(cls, value: int) -> NVMLError:
        subclass = NVMLError._valClassMapping.get(value, cls) if cls is NVMLError else cls
        obj = Exception.__new__(subclass)
        obj.value = value
        return obj

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _MESSAGES.get(self.value, f"NVML Error with code {self.value}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NVMLError) and self.value == other.value

    __hash__ = Exception.__hash__


def _class_name(constant: str) -> str:
    # NVML_ERROR_LIB_RM_VERSION_MISMATCH -> NVMLError_LibRmVersionMismatch, as nvidia-ml-py names them.
    return "NVMLError_" + "".join(part.capitalize() for part in constant[len("NVML_ERROR_") :].split("_"))


for _name, _code in list(globals().items()):
    if _name.startswith("NVML_ERROR_"):
        _cls = type(_class_name(_name), (NVMLError,), {})
        globals()[_cls.__name__] = _cls
        NVMLError._valClassMapping[_code] = _cls

_GEN_BY_GTS = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}
_state: dict[str, Any] = {"profile": None, "refcount": 0}


def _profile() -> dict[str, Any]:
    if _state["profile"] is None:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    return _state["profile"]


def _answer(value: Any) -> Any:
    """Return value, or raise the NVMLError subclass that an "ERR:NVMLError_<Name>" string names."""
    if isinstance(value, str) and value.startswith("ERR:"):
        cls = globals().get(value[4:].split(":")[0])
        codes = [code for code, mapped in NVMLError._valClassMapping.items() if mapped is cls]
        raise NVMLError(codes[0] if codes else NVML_ERROR_UNKNOWN)
    return value


class _Handle:
    def __init__(self, index: int, function: dict[str, Any], parent: dict[str, Any] | None) -> None:
        self.index = index
        self.function = function
        self.parent = parent or {}
        self.nvml = function.get("nvml", {})

    def get(self, key: str, default: Any = None) -> Any:
        return _answer(self.nvml.get(key, default))


class _Struct:
    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


def _gen(speed: Any) -> int | None:
    match = re.match(r"\s*([0-9.]+)\s*GT/s", str(speed or ""))
    return _GEN_BY_GTS.get(float(match.group(1))) if match else None


def _width(text: Any) -> int | None:
    return int(text) if str(text).strip().isdigit() else None


def _handles() -> list[_Handle]:
    functions = _profile().get("pci", [])
    by_bdf = {function["bdf"]: function for function in functions}
    gpus = sorted((f for f in functions if "nvml" in f), key=lambda f: f["bdf"])
    return [_Handle(i, f, by_bdf.get(f.get("parent") or "")) for i, f in enumerate(gpus)]


# -- library -------------------------------------------------------------------------------


def nvmlInit() -> None:
    nvmlInitWithFlags(0)


def nvmlInitWithFlags(flags: int) -> None:
    path = os.environ.get("BUDGETGPU_SIM_PROFILE", PROFILE_DEFAULT)
    try:
        with open(path, encoding="utf-8") as handle:
            profile = json.load(handle)
    except OSError:
        raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND) from None
    init_error = profile.get("nvml", {}).get("init_error")
    if init_error:
        _answer(init_error)
    _state["profile"] = _with_faults(profile)
    _state["refcount"] += 1


def nvmlShutdown() -> None:
    _profile()
    _state["refcount"] -= 1
    if _state["refcount"] <= 0:
        _state["profile"] = None
        _state["refcount"] = 0


def nvmlErrorString(result: int) -> str:
    return _MESSAGES.get(result, "Unknown Error")


def nvmlSystemGetDriverVersion() -> str:
    return _answer(_profile()["nvml"]["driver"])


def nvmlSystemGetNVMLVersion() -> str:
    return _answer(_profile()["nvml"]["nvml"])


def nvmlSystemGetCudaDriverVersion() -> int:
    return _answer(_profile()["nvml"]["cuda_driver"])


nvmlSystemGetCudaDriverVersion_v2 = nvmlSystemGetCudaDriverVersion


def nvmlDeviceGetCount() -> int:
    return len(_handles())


def nvmlDeviceGetHandleByIndex(index: int) -> _Handle:
    handles = _handles()
    if not 0 <= index < len(handles):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return handles[index]


# -- device --------------------------------------------------------------------------------


def nvmlDeviceGetName(handle: _Handle) -> str:
    return handle.get("name")


def nvmlDeviceGetUUID(handle: _Handle) -> str:
    return handle.get("uuid", f"GPU-00000000-0000-0000-0000-{handle.index:012d}")


def nvmlDeviceGetMinorNumber(handle: _Handle) -> int:
    # The device node gpu_sim makes for it (/dev/nvidia<index>), unless the profile says another.
    return handle.get("minor_number", handle.index)


def nvmlDeviceGetSerial(handle: _Handle) -> str:
    return handle.get("serial", "ERR:NVMLError_NotSupported")


def nvmlDeviceGetVbiosVersion(handle: _Handle) -> str:
    return handle.get("vbios", "94.02.42.00.A9")


def nvmlDeviceGetPciInfo(handle: _Handle) -> _Struct:
    domain, bus, rest = handle.function["bdf"].split(":")
    bus_id = handle.get("bus_id", f"{int(domain, 16):08X}:{bus.upper()}:{rest.upper()}")
    device = int(str(handle.function.get("device", "0")), 16)
    vendor = int(str(handle.function.get("vendor", "0x10de")), 16)
    return _Struct(
        busId=bus_id,
        busIdLegacy=bus_id,
        domain=int(domain, 16),
        bus=int(bus, 16),
        device=int(rest.split(".")[0], 16),
        pciDeviceId=handle.get("pci_device_id", device << 16 | vendor),
        pciSubSystemId=handle.get("pci_subsys", 0),
    )


nvmlDeviceGetPciInfo_v3 = nvmlDeviceGetPciInfo


def nvmlDeviceGetMemoryInfo(handle: _Handle, version: int | None = None) -> _Struct:
    total = handle.get("mem_total")
    used = handle.get("mem_used", 0)
    return _Struct(total=total, used=used, free=total - used)


def nvmlDeviceGetCudaComputeCapability(handle: _Handle) -> tuple[int, int]:
    major, minor = handle.get("cc")
    return (major, minor)


def nvmlDeviceGetCurrPcieLinkGeneration(handle: _Handle) -> int:
    return handle.get("pcie_gen_cur", _gen(handle.function.get("current_link_speed")))


def nvmlDeviceGetGpuMaxPcieLinkGeneration(handle: _Handle) -> int:
    return handle.get("pcie_gen_gpu_max", _gen(handle.function.get("max_link_speed")))


def nvmlDeviceGetMaxPcieLinkGeneration(handle: _Handle) -> int:
    # "Possible with this device and system": the lower of the GPU's and its port's maximum.
    known = [g for g in (_gen(handle.function.get("max_link_speed")), _gen(handle.parent.get("max_link_speed"))) if g]
    return handle.get("pcie_gen_max", min(known) if known else None)


def nvmlDeviceGetCurrPcieLinkWidth(handle: _Handle) -> int:
    return handle.get("pcie_width_cur", _width(handle.function.get("current_link_width")))


def nvmlDeviceGetMaxPcieLinkWidth(handle: _Handle) -> int:
    return handle.get("pcie_width_max", _width(handle.function.get("max_link_width")))


def nvmlDeviceGetPcieReplayCounter(handle: _Handle) -> int:
    return handle.get("pcie_replay", 0)


def nvmlDeviceGetTemperature(handle: _Handle, sensor: int) -> int:
    return handle.get("temp")


def nvmlDeviceGetPowerUsage(handle: _Handle) -> int:
    return handle.get("power_mw")


def nvmlDeviceGetFanSpeed(handle: _Handle) -> int:
    return handle.get("fan", "ERR:NVMLError_NotSupported")


def nvmlDeviceGetClockInfo(handle: _Handle, clock_type: int) -> int:
    return handle.get("sm_clock")


def nvmlDeviceGetUtilizationRates(handle: _Handle) -> _Struct:
    """An idle GPU unless the profile (or a fault) says "util_gpu" / "util_mem" (percent)."""
    return _Struct(gpu=handle.get("util_gpu", 0), memory=handle.get("util_mem", 0))


def nvmlDeviceGetMaxClockInfo(handle: _Handle, clock_type: int) -> int:
    return handle.get("sm_clock_max")


def nvmlDeviceGetCurrentClocksEventReasons(handle: _Handle) -> int:
    return handle.get("throttle", 0)


nvmlDeviceGetCurrentClocksThrottleReasons = nvmlDeviceGetCurrentClocksEventReasons


def nvmlDeviceGetEccMode(handle: _Handle) -> list[int]:
    return list(handle.get("ecc", "ERR:NVMLError_NotSupported"))


def nvmlDeviceGetPersistenceMode(handle: _Handle) -> int:
    return handle.get("persistence", 0)


def nvmlDeviceGetMigMode(handle: _Handle) -> list[int]:
    return list(handle.get("mig", "ERR:NVMLError_NotSupported"))


def nvmlDeviceGetNumaNodeId(handle: _Handle) -> int:
    return handle.get("numa", "ERR:NVMLError_NotSupported")


def nvmlDeviceGetNvLinkState(handle: _Handle, link: int) -> int:
    links = handle.get("nvlink", "ERR:NVMLError_NotSupported")
    if str(link) not in links:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return _answer(links[str(link)])


def nvmlDeviceGetRetiredPages(handle: _Handle, source: int) -> list[int]:
    pages = handle.get("retired_pages", "ERR:NVMLError_NotSupported")
    return list(pages["double_bit" if source == 1 else "single_bit"])


def nvmlDeviceGetRetiredPagesPendingStatus(handle: _Handle) -> int:
    pages = handle.get("retired_pages", "ERR:NVMLError_NotSupported")
    return int(pages.get("pending", 0))


def nvmlDeviceGetRemappedRows(handle: _Handle) -> tuple[int, int, int, int]:
    correctable, uncorrectable, pending, failure = handle.get("remapped_rows", "ERR:NVMLError_NotSupported")
    return (correctable, uncorrectable, pending, failure)


# -- the health watch's reads (fans, ECC counters) and the faults tests inject ---------------------


def _with_faults(profile: dict[str, Any]) -> dict[str, Any]:
    """Return the profile with the faults file's keys laid over each named GPU's answers."""
    try:
        with open(os.environ.get("BUDGETGPU_SIM_FAULTS", FAULTS_DEFAULT), encoding="utf-8") as handle:
            faults = json.load(handle)
    except (OSError, ValueError):
        return profile
    functions = []
    for function in profile.get("pci", []):
        fault = faults.get(str(function.get("nvml", {}).get("uuid"))) if "nvml" in function else None
        if fault and fault.get("gone"):
            function = {key: value for key, value in function.items() if key != "nvml"}
        elif fault:
            function = {**function, "nvml": {**function["nvml"], **fault}}
        functions.append(function)
    return {**profile, "pci": functions}


def _fan_list(handle: _Handle) -> list[dict[str, Any]]:
    """Return the GPU's fans: "fans" [{speed, target}], else one fan from "fan" (target "fan_target")."""
    fans = handle.get("fans")
    if fans is not None:
        return fans
    speed = handle.get("fan", "ERR:NVMLError_NotSupported")
    return [{"speed": speed, "target": handle.get("fan_target", speed)}]


def nvmlDeviceGetNumFans(handle: _Handle) -> int:
    return len(_fan_list(handle))


def _fan(handle: _Handle, fan: int) -> dict[str, Any]:
    fans = _fan_list(handle)
    if not 0 <= fan < len(fans):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return fans[fan]


def nvmlDeviceGetFanSpeed_v2(handle: _Handle, fan: int) -> int:
    return _answer(_fan(handle, fan)["speed"])


def nvmlDeviceGetTargetFanSpeed(handle: _Handle, fan: int) -> int:
    return _answer(_fan(handle, fan)["target"])


def nvmlDeviceGetTotalEccErrors(handle: _Handle, error_type: int, counter_type: int) -> int:
    # Uncorrected (1) volatile (0) is what the watch reads; a card without ECC does not support it.
    handle.get("ecc", "ERR:NVMLError_NotSupported")
    key = "ecc_dbe_volatile" if error_type == 1 else "ecc_sbe_volatile"
    return handle.get(key if counter_type == 0 else key.replace("volatile", "aggregate"), 0)


# -- power limits and energy ---------------------------------------------------------------
# Profile keys (per GPU, under "nvml"): power_limit_min_mw, power_limit_max_mw,
# power_limit_default_mw (the card's constraints; a missing key makes the call unsupported, as on
# a card without power management) and energy_mj (the total-energy counter at the simulated boot;
# "ERR:NVMLError_NotSupported" for a card older than Volta). A limit set through
# nvmlDeviceSetPowerManagementLimit is kept in the simulation's state file, under /run: like the
# real driver, which forgets it at a reboot, the simulation forgets it when that file goes.
STATE_DEFAULT = "/run/budgetgpu-sim/state.json"


def _state_path() -> str:
    return os.environ.get("BUDGETGPU_SIM_STATE", STATE_DEFAULT)


def _read_state() -> dict[str, Any]:
    try:
        with open(_state_path(), encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return {}


def _write_state(state: dict[str, Any]) -> None:
    path = _state_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(state, handle)
    os.replace(temporary, path)


def _booted_at() -> float:
    """When the simulated driver loaded: kept in the state file once a limit is set, else the time the
    profile was installed. Reading never writes (a probe on a build machine leaves nothing behind)."""
    booted = _read_state().get("booted_at")
    if booted is not None:
        return float(booted)
    try:
        return os.stat(os.environ.get("BUDGETGPU_SIM_PROFILE", PROFILE_DEFAULT)).st_mtime
    except OSError:
        return time.time()


def _constraint(handle: _Handle, key: str) -> int:
    return handle.get(key, "ERR:NVMLError_NotSupported")


def nvmlDeviceGetPowerManagementLimitConstraints(handle: _Handle) -> list[int]:
    return [_constraint(handle, "power_limit_min_mw"), _constraint(handle, "power_limit_max_mw")]


def nvmlDeviceGetPowerManagementDefaultLimit(handle: _Handle) -> int:
    return _constraint(handle, "power_limit_default_mw")


def nvmlDeviceGetPowerManagementLimit(handle: _Handle) -> int:
    limit = _read_state().get("power_limit_mw", {}).get(handle.function["bdf"])
    return limit if limit is not None else handle.get("power_limit_default_mw", handle.get("power_limit_mw"))


def nvmlDeviceGetEnforcedPowerLimit(handle: _Handle) -> int:
    return nvmlDeviceGetPowerManagementLimit(handle)


def nvmlDeviceSetPowerManagementLimit(handle: _Handle, limit: int) -> None:
    low, high = nvmlDeviceGetPowerManagementLimitConstraints(handle)
    if os.geteuid() != 0:
        raise NVMLError(NVML_ERROR_NO_PERMISSION)
    if not low <= int(limit) <= high:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    state = _read_state()
    state.setdefault("booted_at", _booted_at())
    state.setdefault("power_limit_mw", {})[handle.function["bdf"]] = int(limit)
    _write_state(state)


def nvmlDeviceGetTotalEnergyConsumption(handle: _Handle) -> int:
    """Millijoules since the driver loaded: the profile's counter plus the draw since the simulated boot."""
    base = handle.get("energy_mj", "ERR:NVMLError_NotSupported")
    return int(base + handle.get("power_mw", 0) * max(0.0, time.time() - _booted_at()))
