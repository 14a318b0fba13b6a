"""Driver state and per-GPU facts from NVML, through a pynvml-like module object.

Plain standard-library Python with no imports from the rest of the collection (roles/probe/files/gpu-probe
imports it from the node package). The caller imports `pynvml` (nvidia-ml-py, or the gpu_sim drop-in)
and passes the module in; nothing here imports it.

A field the GPU does not support is the string "unsupported" (UNSUPPORTED); a field that failed
for another reason is None, with the NVML error text under the GPU's `errors`.

Every NVML call goes through Reader, so that any binding works field by field: a function the
binding does not define (Ubuntu 22.04's 7.352 has no nvmlSystemGetCudaDriverVersion, no
nvmlDeviceGetNvLinkState, no fan v2) and one the driver's library lacks (the binding raises
FunctionNotFound) read UNSUPPORTED, like a field the GPU does not support. CONTRIBUTING ("NVML
bindings") lists what each supported binding reads.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from importlib import metadata
from typing import Any

UNSUPPORTED = "unsupported"

# NVML return codes (nvml.h); kept here so that this file needs no pynvml to be read.
ERROR_INVALID_ARGUMENT = 2
ERROR_NOT_SUPPORTED = 3
ERROR_DRIVER_NOT_LOADED = 9
ERROR_LIBRARY_NOT_FOUND = 12
ERROR_FUNCTION_NOT_FOUND = 13
ERROR_LIB_RM_VERSION_MISMATCH = 18

_UNSUPPORTED_CODES = {ERROR_NOT_SUPPORTED, ERROR_FUNCTION_NOT_FOUND}
TEMPERATURE_GPU = 0
CLOCK_SM = 1
PAGE_RETIREMENT_SINGLE_BIT = 0
PAGE_RETIREMENT_DOUBLE_BIT = 1

THROTTLE_REASONS = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
    (0x200, "board_limit"),
    (0x400, "reliability"),
)


def decode_throttle_reasons(mask: int) -> list[str]:
    """Return the names of the clock event (throttle) reasons set in mask; unknown bits as hex."""
    names = [name for bit, name in THROTTLE_REASONS if mask & bit]
    known = 0
    for bit, _name in THROTTLE_REASONS:
        known |= bit
    for bit in range(64):
        if mask & (1 << bit) & ~known:
            names.append(f"0x{1 << bit:x}")
    return names


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _enabled(value: int) -> str:
    return "enabled" if value else "disabled"


def nvml_bus_id_to_sysfs(bus_id: str) -> str:
    """Return NVML's "00000000:3B:00.0" as sysfs writes it: "0000:3b:00.0"."""
    domain, _colon, rest = _text(bus_id).strip().lower().partition(":")
    return f"{int(domain or '0', 16):04x}:{rest}"


def cuda_version_text(version: int) -> str:
    """Return NVML's CUDA driver version number (13000) as "13.0"."""
    return f"{version // 1000}.{version % 1000 // 10}"


def kernel_module_version(proc_root: str = "/proc") -> str | None:
    """Return the version of the loaded nvidia kernel module, or None when none is loaded."""
    try:
        with open(os.path.join(proc_root, "driver", "nvidia", "version"), encoding="utf-8") as handle:
            text = handle.read()
    except OSError:
        return None
    match = re.search(r"NVRM version:.*?\s(\d+\.\d+(?:\.\d+)?)\s", text)
    return match.group(1) if match else "unknown"


# What modprobe finds in modules.dep: upstream's nvidia.ko, or Debian's renamed nvidia-current.ko (its dkms.conf
# DEST_MODULE_NAME; Debian's modprobe.d maps the name nvidia to it). Compressed modules end in .xz or .zst.
NVIDIA_MODULE_DEP = re.compile(r"(^|/)nvidia(-current)?\.ko(\.\w+)?:", re.MULTILINE)
# A file that the kernel's own package ships: a folder without it is what a removed kernel left behind
# (DKMS's or depmod's files) or a headers package's build link alone.
KERNEL_PACKAGE_FILE = "modules.builtin"
_DKMS_LINE = re.compile(
    r"^(?P<module>[^/,:\s]+)[/,] ?(?P<version>[^,:\s]+)(?:, (?P<kernel>[^,:\s]+), (?P<arch>[^,:\s]+))?: (?P<status>\w+)"
)


def kernel_module_installed(modules_root: str = "/lib/modules", release: str | None = None) -> bool:
    """Return whether an nvidia kernel module is installed for the running (or given) kernel."""
    release = release or os.uname().release
    try:
        with open(os.path.join(modules_root, release, "modules.dep"), encoding="utf-8") as handle:
            return NVIDIA_MODULE_DEP.search(handle.read()) is not None
    except OSError:
        return False


def release_sort_key(release: str) -> list[tuple[int, int, str]]:
    """Version-sort key of a kernel release (numbers compare as numbers), as GRUB orders its entries."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.findall(r"\d+|\D+", release)]


def installed_kernels(modules_root: str = "/lib/modules", running: str | None = None) -> list[dict[str, Any]]:
    """Return the kernels installed under modules_root, oldest first (the last one is what GRUB boots by default),
    each as {release, running, nvidia_module, headers}: whether modprobe finds an nvidia module for it, and whether
    its headers are installed (the build link the headers package makes, which DKMS builds against)."""
    running = running or os.uname().release
    try:
        names = os.listdir(modules_root)
    except OSError:
        return []
    releases = [name for name in names if os.path.isfile(os.path.join(modules_root, name, KERNEL_PACKAGE_FILE))]
    return [
        {"release": release, "running": release == running,
         "nvidia_module": kernel_module_installed(modules_root, release),
         "headers": os.path.isdir(os.path.join(modules_root, release, "build", "include"))}
        for release in sorted(releases, key=release_sort_key)
    ]  # fmt: skip


def parse_dkms_status(text: str) -> list[dict[str, Any]]:
    """Return `dkms status` lines as {module, version, kernel, arch, status}: kernel and arch are None for a module
    only registered ("added"). Both dkms 3 (`nvidia-current/535.261.03, 6.1.0-27-amd64, x86_64: installed`) and
    dkms 2 (`nvidia, 550.120, 5.15.0-122-generic, x86_64: installed`) forms; other lines (warnings) are skipped."""
    found = []
    for line in text.splitlines():
        match = _DKMS_LINE.match(line.strip())
        if match:
            found.append(match.groupdict())
    return found


def driver_facts(state: str, reason: str | None, **found: Any) -> dict[str, Any]:
    """Return the driver facts in their one shape: every key present, None where not known."""
    facts: dict[str, Any] = dict.fromkeys(
        ("version", "nvml_version", "cuda_driver_version", "kernel_module_version", "kernel_module_installed")
    )
    facts.update(state=state, loaded=state == "loaded", reason=reason, errors={})
    facts.update(found)
    return facts


def driver_state_from_error(
    code: int | None, message: str, proc_root: str = "/proc", modules_root: str = "/lib/modules"
) -> dict[str, Any]:
    """Return the driver facts for a node where nvmlInit failed with this NVML error code."""
    release = os.uname().release
    module_version = kernel_module_version(proc_root)
    installed = kernel_module_installed(modules_root, release)
    if code == ERROR_LIBRARY_NOT_FOUND and module_version:
        state = "no_library"
        reason = (
            f"the nvidia kernel module {module_version} is loaded but libnvidia-ml.so.1 is missing: "
            "install the driver's user-space libraries of the same version"
        )
    elif code == ERROR_LIBRARY_NOT_FOUND and not installed:
        state = "no_driver"
        reason = (
            f"no NVIDIA driver: libnvidia-ml.so.1 is missing and no nvidia kernel module exists for kernel "
            f"{release}: install the driver (budgetgpu.cluster.nvidia_driver)"
        )
    elif code == ERROR_LIB_RM_VERSION_MISMATCH:
        state = "version_mismatch"
        reason = (
            f"libnvidia-ml and the loaded nvidia kernel module ({module_version or 'unknown version'}) are from "
            "different driver releases: reboot after a driver upgrade, or unload and reload the nvidia modules"
        )
    # Without the kernel module NVML fails with DriverNotLoaded, or, where it may create
    # /dev/nvidiactl itself (root in a container), with Unknown: the module decides.
    elif module_version is None and installed:
        state = "not_loaded"
        reason = (
            f"the NVIDIA driver is installed for kernel {release} but not loaded (nvmlInit: {message}): run "
            "`modprobe nvidia` or reboot; if it will not load, check `dmesg` for nouveau, Secure Boot or a failed "
            "DKMS build"
        )
    elif module_version is None:
        state = "not_loaded"
        reason = (
            f"libnvidia-ml is installed but the nvidia kernel module is not loaded (nvmlInit: {message}), and none "
            f"is installed for kernel {release}: install the driver's kernel module (DKMS) for this kernel"
        )
    else:
        state, reason = "error", f"nvmlInit failed: {message}"
    return driver_facts(state, reason, kernel_module_version=module_version, kernel_module_installed=installed)


class Reader:
    """Calls NVML getters, turning "not supported" into UNSUPPORTED and other errors into None.

    The one way this collection calls NVML (apart from nvmlInit/nvmlShutdown, in session): a
    function missing from the binding or from the driver's library is UNSUPPORTED."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self.errors: dict[str, str] = {}

    def call(self, function: str, *args: Any) -> tuple[Any, Exception | None]:
        """Return (value, None); (UNSUPPORTED, error or None) where the function or the GPU lacks it;
        (None, error) for another NVML error."""
        getter = getattr(self.nvml, function, None)
        if getter is None:
            return UNSUPPORTED, None
        try:
            return getter(*args), None
        except self.nvml.NVMLError as exc:
            return (UNSUPPORTED if error_code(exc) in _UNSUPPORTED_CODES else None), exc
        except (TypeError, ValueError, AttributeError) as exc:
            # A binding older than the struct or the Python it runs on (7.352 was written for
            # Python 2): the field is lost, not the probe.
            return None, exc

    def get(self, key: str, function: str, *args: Any) -> Any:
        value, error = self.call(function, *args)
        if value is None and error is not None:
            self.errors[key] = str(error) if isinstance(error, self.nvml.NVMLError) else f"{function}: {error!r}"
        return value


def error_code(exc: BaseException | None) -> int | None:
    """Return an NVMLError's return code (nvml.h), None for anything else."""
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


@contextlib.contextmanager
def session(nvml: Any) -> Iterator[None]:
    """nvmlInit, then nvmlShutdown however the block ends (a failing shutdown is not the caller's
    problem). nvmlInit's NVMLError is raised: its code says the driver's state."""
    nvml.nvmlInit()
    try:
        yield
    finally:
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()


def binding(nvml: Any) -> dict[str, Any]:
    """Return which NVML binding this is: {module, distribution, version, path}. nvidia-ml-py
    defines no version of its own: the distribution installed beside the module says it
    (nvidia-ml-py3 7.352.0 from PyPI; nvidia-ml-py 11.525.112 as Debian 12's python3-pynvml).
    Without one (gpu_sim's drop-in) distribution and version are None."""
    path = getattr(nvml, "__file__", None)
    found: dict[str, Any] = {"module": getattr(nvml, "__name__", "pynvml"), "distribution": None, "version": None}
    found["path"] = path
    if not path:
        return found
    here = os.path.dirname(os.path.realpath(path))
    for dist in metadata.distributions(path=[here]):
        top = (dist.read_text("top_level.txt") or "").split()
        files = [str(entry) for entry in dist.files or []]
        if found["module"] in top or f"{found['module']}.py" in files:
            found["distribution"], found["version"] = dist.metadata["Name"], dist.version
            break
    return found


def known(value: Any) -> bool:
    """Whether NVML gave the value: neither UNSUPPORTED nor None (the call failed)."""
    return value is not None and value != UNSUPPORTED


def _convert(value: Any, convert: Any) -> Any:
    return convert(value) if known(value) else value


def _nvlinks_active(reader: Reader, handle: Any) -> Any:
    """Return how many NVLinks are active, or UNSUPPORTED when the GPU (or the binding) has none."""
    active = 0
    for link in range(int(getattr(reader.nvml, "NVML_NVLINK_MAX_LINKS", 18))):
        state, error = reader.call("nvmlDeviceGetNvLinkState", handle, link)
        if state == UNSUPPORTED or error_code(error) == ERROR_INVALID_ARGUMENT:
            # Links are numbered from 0: the first one missing ends the list.
            return UNSUPPORTED if link == 0 else active
        if error is not None:
            reader.errors["nvlinks_active"] = str(error)
            return None
        active += 1 if state else 0
    return active


def _retired_pages(reader: Reader, handle: Any) -> Any:
    single = reader.get("retired_pages", "nvmlDeviceGetRetiredPages", handle, PAGE_RETIREMENT_SINGLE_BIT)
    if not known(single):
        return single
    double = reader.get("retired_pages", "nvmlDeviceGetRetiredPages", handle, PAGE_RETIREMENT_DOUBLE_BIT)
    pending = reader.get("retired_pages", "nvmlDeviceGetRetiredPagesPendingStatus", handle)
    # 7.352 returns a map object (written for Python 2's list-returning map).
    return {
        "single_bit_ecc": len(list(single)),
        "double_bit_ecc": len(list(double)) if known(double) else double,
        "pending": bool(pending) if known(pending) else pending,
    }


def _remapped_rows(reader: Reader, handle: Any) -> Any:
    rows = reader.get("remapped_rows", "nvmlDeviceGetRemappedRows", handle)
    if not known(rows):
        return rows
    correctable, uncorrectable, pending, failure = rows
    return {
        "correctable": correctable,
        "uncorrectable": uncorrectable,
        "pending": bool(pending),
        "failure": bool(failure),
    }


def _throttle_mask(reader: Reader, handle: Any) -> Any:
    # nvidia-ml-py 12.535+ names them "clocks event reasons"; older releases "throttle reasons".
    if hasattr(reader.nvml, "nvmlDeviceGetCurrentClocksEventReasons"):
        return reader.get("throttle_reasons", "nvmlDeviceGetCurrentClocksEventReasons", handle)
    return reader.get("throttle_reasons", "nvmlDeviceGetCurrentClocksThrottleReasons", handle)


def _device(nvml: Any, index: int) -> tuple[Reader, Any]:
    """Return a reader and the handle of GPU index (not known when NVML refused it)."""
    reader = Reader(nvml)
    return reader, reader.get("handle", "nvmlDeviceGetHandleByIndex", index)


def _watts(milliwatts: Any) -> Any:
    return round(milliwatts / 1000, 2) if known(milliwatts) else milliwatts


def _gpu_util(rates: Any) -> Any:
    return getattr(rates, "gpu", UNSUPPORTED)


def _joules(millijoules: Any) -> Any:
    return round(millijoules / 1000, 3) if known(millijoules) else millijoules


def power_fields(reader: Reader, handle: Any) -> dict[str, Any]:
    """Return draw, enforced limit, the limit's constraints and default (W), and the energy counter (J)."""
    get = reader.get
    limits = get("power_limit_range_w", "nvmlDeviceGetPowerManagementLimitConstraints", handle)
    low, high = (_watts(limits[0]), _watts(limits[1])) if known(limits) else (limits, limits)
    # Millijoules since the driver loaded; Volta and newer only (older cards: unsupported).
    energy = get("energy_total_j", "nvmlDeviceGetTotalEnergyConsumption", handle)
    default = get("power_limit_default_w", "nvmlDeviceGetPowerManagementDefaultLimit", handle)
    return {
        "power_draw_w": _watts(get("power_draw_w", "nvmlDeviceGetPowerUsage", handle)),
        "power_limit_w": _watts(get("power_limit_w", "nvmlDeviceGetEnforcedPowerLimit", handle)),
        "power_limit_default_w": _watts(default),
        "power_limit_min_w": low,
        "power_limit_max_w": high,
        "energy_total_j": _joules(energy),
    }


def probe_gpu(nvml: Any, index: int) -> dict[str, Any]:
    """Return one GPU's NVML facts."""
    reader, handle = _device(nvml, index)
    if not known(handle):
        return {"index": index, "errors": reader.errors}
    get = reader.get
    pci = get("bus_id", "nvmlDeviceGetPciInfo", handle)
    memory = get("memory_total_mib", "nvmlDeviceGetMemoryInfo", handle)
    capability = get("compute_capability", "nvmlDeviceGetCudaComputeCapability", handle)
    ecc = get("ecc_mode", "nvmlDeviceGetEccMode", handle)
    mig = get("mig_mode", "nvmlDeviceGetMigMode", handle)
    throttle = _throttle_mask(reader, handle)
    gpu = {
        "index": index,
        "name": _convert(get("name", "nvmlDeviceGetName", handle), _text),
        "uuid": _convert(get("uuid", "nvmlDeviceGetUUID", handle), _text),
        "serial": _convert(get("serial", "nvmlDeviceGetSerial", handle), _text),
        "bus_id": nvml_bus_id_to_sysfs(pci.busId) if known(pci) else pci,
        "memory_total_mib": memory.total // (1024 * 1024) if known(memory) else memory,
        "compute_capability": "{}.{}".format(*capability) if known(capability) else capability,
        "vbios_version": _convert(get("vbios_version", "nvmlDeviceGetVbiosVersion", handle), _text),
        "pcie": {
            "gen_current": get("pcie.gen_current", "nvmlDeviceGetCurrPcieLinkGeneration", handle),
            "gen_max": get("pcie.gen_max", "nvmlDeviceGetMaxPcieLinkGeneration", handle),
            "gen_gpu_max": get("pcie.gen_gpu_max", "nvmlDeviceGetGpuMaxPcieLinkGeneration", handle),
            "width_current": get("pcie.width_current", "nvmlDeviceGetCurrPcieLinkWidth", handle),
            "width_max": get("pcie.width_max", "nvmlDeviceGetMaxPcieLinkWidth", handle),
            "replay_counter": get("pcie.replay_counter", "nvmlDeviceGetPcieReplayCounter", handle),
        },
        "temperature_c": get("temperature_c", "nvmlDeviceGetTemperature", handle, TEMPERATURE_GPU),
        **power_fields(reader, handle),
        "fan_speed_pct": get("fan_speed_pct", "nvmlDeviceGetFanSpeed", handle),
        "sm_clock_mhz": get("sm_clock_mhz", "nvmlDeviceGetClockInfo", handle, CLOCK_SM),
        "sm_clock_max_mhz": get("sm_clock_max_mhz", "nvmlDeviceGetMaxClockInfo", handle, CLOCK_SM),
        "throttle_reasons": decode_throttle_reasons(throttle) if known(throttle) else throttle,
        "ecc_mode": {"current": _enabled(ecc[0]), "pending": _enabled(ecc[1])} if known(ecc) else ecc,
        "persistence_mode": _convert(get("persistence_mode", "nvmlDeviceGetPersistenceMode", handle), _enabled),
        "mig_mode": {"current": _enabled(mig[0]), "pending": _enabled(mig[1])} if known(mig) else mig,
        "nvlinks_active": _nvlinks_active(reader, handle),
        "numa_node": get("numa_node", "nvmlDeviceGetNumaNodeId", handle),
        "retired_pages": _retired_pages(reader, handle),
        "remapped_rows": _remapped_rows(reader, handle),
    }
    gpu["errors"] = reader.errors
    return gpu


def _system_driver(reader: Reader, proc_root: str) -> dict[str, Any]:
    cuda = reader.get("cuda_driver_version", "nvmlSystemGetCudaDriverVersion_v2")
    if not known(cuda):
        cuda = reader.get("cuda_driver_version", "nvmlSystemGetCudaDriverVersion")
    return driver_facts(
        "loaded",
        None,
        version=_convert(reader.get("version", "nvmlSystemGetDriverVersion"), _text),
        nvml_version=_convert(reader.get("nvml_version", "nvmlSystemGetNVMLVersion"), _text),
        # UNSUPPORTED where the binding predates the call (7.352): torch_build refuses "auto" then.
        cuda_driver_version=_convert(cuda, cuda_version_text),
        kernel_module_version=kernel_module_version(proc_root),
        kernel_module_installed=True,
        errors=reader.errors,
    )


def probe_nvml(nvml: Any, proc_root: str = "/proc", modules_root: str = "/lib/modules") -> dict[str, Any]:
    """Return {driver, count, gpus}; a node without a working driver gives count 0 and says why.
    driver.binding says which NVML binding read it (binding())."""
    try:
        with session(nvml):
            reader = Reader(nvml)
            driver = _system_driver(reader, proc_root)
            count = reader.get("count", "nvmlDeviceGetCount")
            gpus = [probe_gpu(nvml, index) for index in range(count if known(count) else 0)]
    except nvml.NVMLError as exc:
        driver = driver_state_from_error(error_code(exc), str(exc), proc_root, modules_root)
        gpus = []
    return {"driver": {**driver, "binding": binding(nvml)}, "count": len(gpus), "gpus": gpus}


# NVML constants of the health watch's reads (nvml.h): the uncorrected volatile ECC counter.
MEMORY_ERROR_TYPE_UNCORRECTED = 1
VOLATILE_ECC = 0


def _fans(reader: Reader, handle: Any) -> Any:
    """Return [{speed_pct, target_pct}] per fan, or UNSUPPORTED (a passive or water-cooled card).

    Without nvmlDeviceGetNumFans (bindings up to 11.450.51, Ubuntu 22.04's 7.352 among them, or a
    driver library without it) one fan is read with v1 nvmlDeviceGetFanSpeed, without a target: a
    stopped fan still shows. A passive card answers "not supported" to both."""
    count = reader.get("fans", "nvmlDeviceGetNumFans", handle)
    if count == UNSUPPORTED:
        speed = reader.get("fans", "nvmlDeviceGetFanSpeed", handle)
        return [{"speed_pct": speed, "target_pct": UNSUPPORTED}] if known(speed) else speed
    if not known(count):
        return count
    return [
        {
            "speed_pct": reader.get("fans", "nvmlDeviceGetFanSpeed_v2", handle, fan),
            "target_pct": reader.get("fans", "nvmlDeviceGetTargetFanSpeed", handle, fan),
        }
        for fan in range(count)
    ]


def health_gpu(nvml: Any, index: int) -> dict[str, Any]:
    """Return what the health watch reads of one GPU each pass (gpu_health's sample shape): fewer
    calls than probe_gpu, which also reads what does not change (name, VBIOS, NVLinks, NUMA)."""
    reader, handle = _device(nvml, index)
    if not known(handle):
        return {"index": index, "errors": reader.errors}
    get = reader.get
    pci = get("bus_id", "nvmlDeviceGetPciInfo", handle)
    gpu = {
        "index": index,
        "uuid": _convert(get("uuid", "nvmlDeviceGetUUID", handle), _text),
        # The metrics' modelName label (gpu_metrics); the watch's decisions do not read it.
        "name": _convert(get("name", "nvmlDeviceGetName", handle), _text),
        "bus_id": nvml_bus_id_to_sysfs(pci.busId) if known(pci) else pci,
        "temperature_c": get("temperature_c", "nvmlDeviceGetTemperature", handle, TEMPERATURE_GPU),
        "fans": _fans(reader, handle),
        "power_draw_w": _watts(get("power_draw_w", "nvmlDeviceGetPowerUsage", handle)),
        "power_limit_w": _watts(get("power_limit_w", "nvmlDeviceGetEnforcedPowerLimit", handle)),
        "energy_total_j": _joules(get("energy_total_j", "nvmlDeviceGetTotalEnergyConsumption", handle)),
        "sm_clock_mhz": get("sm_clock_mhz", "nvmlDeviceGetClockInfo", handle, CLOCK_SM),
        # Percent of the last sample period in which a kernel ran (nvidia-smi's "GPU-Util").
        "utilization_pct": _convert(get("utilization_pct", "nvmlDeviceGetUtilizationRates", handle), _gpu_util),
        "throttle_reasons": _throttle_mask(reader, handle),
        "ecc_double_bit_volatile": get(
            "ecc", "nvmlDeviceGetTotalEccErrors", handle, MEMORY_ERROR_TYPE_UNCORRECTED, VOLATILE_ECC
        ),
        "retired_pages": _retired_pages(reader, handle),
        "remapped_rows": _remapped_rows(reader, handle),
        "pcie": {
            "gen_current": get("pcie.gen_current", "nvmlDeviceGetCurrPcieLinkGeneration", handle),
            "width_current": get("pcie.width_current", "nvmlDeviceGetCurrPcieLinkWidth", handle),
            "replay_counter": get("pcie.replay_counter", "nvmlDeviceGetPcieReplayCounter", handle),
        },
    }
    gpu["errors"] = reader.errors
    return gpu


def health_sample(nvml: Any) -> dict[str, Any]:
    """Return {driver_state, gpus} for one watch pass; no GPU when NVML does not start (the driver's
    state is the probe's to report, the watch then compares nothing)."""
    try:
        with session(nvml):
            count = Reader(nvml).get("count", "nvmlDeviceGetCount")
            return {
                "driver_state": "loaded",
                "gpus": [health_gpu(nvml, i) for i in range(count if known(count) else 0)],
            }
    except nvml.NVMLError as exc:
        return {"driver_state": f"nvmlInit failed: {exc}", "gpus": []}


def energy_counters(nvml: Any) -> dict[str, float]:
    """Return {uuid: joules since the driver loaded} of every GPU with the total-energy counter (Volta
    and newer; power_fields' energy_total_j): what root records at a job's start
    (roles/torchrun/files/budgetgpu-job-record, run by budgetgpu-job-start@<job>.service). NVML failing
    to start gives {}."""
    counters = {}
    try:
        with session(nvml):
            count = Reader(nvml).get("count", "nvmlDeviceGetCount")
            for index in range(count if known(count) else 0):
                reader, handle = _device(nvml, index)
                if not known(handle):
                    continue
                uuid = reader.get("uuid", "nvmlDeviceGetUUID", handle)
                joules = _joules(reader.get("energy_total_j", "nvmlDeviceGetTotalEnergyConsumption", handle))
                if known(uuid) and known(joules):
                    counters[_text(uuid)] = joules
    except nvml.NVMLError:
        return {}
    return counters
