"""The GPU metrics of one health watch pass, for node exporter's textfile collector: the samples and
their types and help (METRICS); the watch writes Prometheus' text format with prometheus_client.

Plain standard-library Python, importing only the node package's nvml_probe, for the watch that role
gpu_health's timer runs on a node. Pure over its inputs: the watch passes its sample
(nvml_probe.health_sample plus the AER texts), its new state (gpu_health.watch_state), the boot links
and the Xid counts.

Names: NVIDIA's dcgm-exporter names where a metric has a twin there (DCGM_FI_DEV_GPU_TEMP, ...), with
dcgm-exporter's labels (gpu, UUID, pci_bus_id in NVML's form, modelName, Hostname), so dashboards made
for dcgm-exporter work; budgetgpu_* names (Prometheus' naming rules: unit suffix, _total on counters)
for what DCGM has no field for: fans one by one with their target, the link the probe saw at boot,
AER counters, the watch's findings and quarantine.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from .nvml_probe import known

# gpu_health's status, as a number an alert compares.
STATUS_VALUES = {"ok": 0, "warn": 1, "take_out": 2}
AER_KEYS = ("correctable", "nonfatal", "fatal")
_XID_KIND = re.compile(r"^xid_(\d+)$")

# name: (type, help). The order of the output.
METRICS = {
    "DCGM_FI_DEV_GPU_TEMP": ("gauge", "GPU temperature (in C)."),
    "DCGM_FI_DEV_POWER_USAGE": ("gauge", "Power draw (in W)."),
    "DCGM_FI_DEV_POWER_MGMT_LIMIT": ("gauge", "Enforced power limit (in W)."),
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": ("counter", "Total energy consumption since the driver loaded (in mJ)."),
    "DCGM_FI_DEV_SM_CLOCK": ("gauge", "SM clock frequency (in MHz)."),
    "DCGM_FI_DEV_GPU_UTIL": ("gauge", "GPU utilization (in %)."),
    "DCGM_FI_DEV_FAN_SPEED": ("gauge", "Speed of the GPU's first fan (in %)."),
    "DCGM_FI_DEV_PCIE_LINK_GEN": ("gauge", "PCIe current link generation."),
    "DCGM_FI_DEV_PCIE_LINK_WIDTH": ("gauge", "PCIe current link width (lanes)."),
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": ("counter", "Total number of PCIe retries."),
    "DCGM_FI_DEV_XID_ERRORS": ("gauge", "Value of the last XID error encountered (0: none since the watch began)."),
    "budgetgpu_gpu_xid_errors_total": ("counter", "Xid errors the health watch read in the kernel log."),
    "budgetgpu_gpu_fan_speed_percent": ("gauge", "Speed of each fan (in %)."),
    "budgetgpu_gpu_fan_target_percent": ("gauge", "Speed the driver asks of each fan (in %)."),
    "budgetgpu_gpu_pcie_link_width_expected": ("gauge", "PCIe link width the probe saw at boot (lanes)."),
    "budgetgpu_gpu_pcie_link_gen_expected": ("gauge", "PCIe link generation the probe saw at boot."),
    "budgetgpu_gpu_pcie_aer_errors_total": ("counter", "PCIe AER errors of the GPU (sysfs aer_dev_*), by severity."),
    "budgetgpu_gpu_health_status": ("gauge", "The health watch's status of the GPU: 0 ok, 1 warn, 2 take_out."),
    "budgetgpu_gpu_health_finding": ("gauge", "1 for each finding of the watch's last pass, by kind (dead_fan, ...)."),
    "budgetgpu_gpu_quarantined": ("gauge", "1 when the GPU is out of service (taken out by the watch or listed)."),
    "budgetgpu_gpu_health_last_pass_timestamp_seconds": ("gauge", "When the health watch's last pass ran."),
    "budgetgpu_gpu_present": ("gauge", "1 when NVML lists the GPU, 0 for one the node had that is gone."),
    "budgetgpu_gpu_health_gpus": ("gauge", "GPUs the health watch's last pass saw through NVML."),
    "budgetgpu_gpu_health_gpus_expected": (
        "gauge",
        "GPUs the node had: those of its last probe and those the watch saw since, until released.",
    ),
}


def _writable(value: Any) -> bool:
    """Whether NVML gave the value (nvml_probe.known) and it is no flag: True and False are not samples."""
    return known(value) and not isinstance(value, bool)


def nvml_bus_id(bus_id: Any) -> str:
    """Return NVML's (and dcgm-exporter's) form of a bus id: 0000:03:00.0 -> 00000000:03:00.0."""
    parts = str(bus_id or "").upper().split(":")
    if len(parts) == 2:
        parts.insert(0, "0")
    if len(parts) != 3 or not all(re.fullmatch(r"[0-9A-F.]+", part) for part in parts):
        return str(bus_id or "")
    return f"{int(parts[0], 16):08X}:{parts[1]}:{parts[2]}"


def xid_counts(previous: dict[str, Any] | None, findings: Iterable[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Return {uuid: {"last": xid, "total": count}}: the previous counts with this pass's Xid findings
    added (gpu_health.xid_findings gives one per GPU and Xid number per pass). The watch keeps them in its
    state, so the counter only grows while the node is up."""
    counts = {uuid: dict(entry) for uuid, entry in (previous or {}).items()}
    for finding in findings:
        match = _XID_KIND.match(str(finding.get("kind")))
        if match and finding.get("gpu"):
            entry = counts.setdefault(str(finding["gpu"]), {"last": 0, "total": 0})
            entry["last"], entry["total"] = int(match.group(1)), entry["total"] + 1
    return counts


def _aer_totals(aer: Any) -> dict[str, int]:
    """Return {severity: TOTAL_ERR_* count} from the aer_dev_* texts (or parsed dicts) the watch read."""
    totals = {}
    for key in AER_KEYS:
        value = (aer or {}).get(key)
        if isinstance(value, dict):
            total = value.get("total")
        elif isinstance(value, str):
            total = next((int(line.split()[1]) for line in value.splitlines() if line.startswith("TOTAL_ERR_")), None)
        else:
            total = None
        if _writable(total):
            totals[key] = total
    return totals


def _gpu_samples(
    gpu: dict[str, Any], labels: dict[str, Any], state: dict[str, Any], boot: dict[str, Any], xids: dict[str, Any]
) -> list[tuple[str, dict[str, Any], Any]]:
    pcie, uuid = gpu.get("pcie") or {}, gpu.get("uuid")
    energy = gpu.get("energy_total_j")
    fans = gpu.get("fans") if isinstance(gpu.get("fans"), list) else []
    entry = (state.get("gpus") or {}).get(uuid) or {}
    xid = xids.get(uuid) or {"last": 0, "total": 0}
    out = [
        ("DCGM_FI_DEV_GPU_TEMP", labels, gpu.get("temperature_c")),
        ("DCGM_FI_DEV_POWER_USAGE", labels, gpu.get("power_draw_w")),
        ("DCGM_FI_DEV_POWER_MGMT_LIMIT", labels, gpu.get("power_limit_w")),
        ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", labels, round(energy * 1000) if _writable(energy) else None),
        ("DCGM_FI_DEV_SM_CLOCK", labels, gpu.get("sm_clock_mhz")),
        ("DCGM_FI_DEV_GPU_UTIL", labels, gpu.get("utilization_pct")),
        ("DCGM_FI_DEV_FAN_SPEED", labels, fans[0].get("speed_pct") if fans else None),
        ("DCGM_FI_DEV_PCIE_LINK_GEN", labels, pcie.get("gen_current")),
        ("DCGM_FI_DEV_PCIE_LINK_WIDTH", labels, pcie.get("width_current")),
        ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", labels, pcie.get("replay_counter")),
        ("DCGM_FI_DEV_XID_ERRORS", labels, xid["last"]),
        ("budgetgpu_gpu_xid_errors_total", labels, xid["total"]),
    ]
    for number, fan in enumerate(fans):
        out.append(("budgetgpu_gpu_fan_speed_percent", {**labels, "fan": number}, fan.get("speed_pct")))
        out.append(("budgetgpu_gpu_fan_target_percent", {**labels, "fan": number}, fan.get("target_pct")))
    out.append(("budgetgpu_gpu_pcie_link_width_expected", labels, boot.get("width")))
    out.append(("budgetgpu_gpu_pcie_link_gen_expected", labels, boot.get("gen")))
    for severity, total in _aer_totals(gpu.get("aer")).items():
        out.append(("budgetgpu_gpu_pcie_aer_errors_total", {**labels, "severity": severity}, total))
    out.append(("budgetgpu_gpu_health_status", labels, STATUS_VALUES.get(entry.get("status", "ok"), 0)))
    for kind in sorted(entry.get("reasons") or {}):
        out.append(("budgetgpu_gpu_health_finding", {**labels, "kind": kind}, 1))
    out.append(("budgetgpu_gpu_quarantined", labels, int(uuid in (state.get("quarantine") or {}))))
    out.append(("budgetgpu_gpu_present", labels, 1))
    return out


def _gone_samples(
    labels: dict[str, Any], state: dict[str, Any], xids: dict[str, Any]
) -> list[tuple[str, dict[str, Any], Any]]:
    """The series a GPU that is gone keeps: its last Xid and their count, the watch's status and findings,
    its quarantine, present 0 (no reading of NVML: those series go stale)."""
    uuid = labels["UUID"]
    entry = (state.get("gpus") or {}).get(uuid) or {}
    xid = xids.get(uuid) or {"last": 0, "total": 0}
    out = [
        ("DCGM_FI_DEV_XID_ERRORS", labels, xid["last"]),
        ("budgetgpu_gpu_xid_errors_total", labels, xid["total"]),
        ("budgetgpu_gpu_health_status", labels, STATUS_VALUES.get(entry.get("status", "ok"), 0)),
    ]
    out += [
        ("budgetgpu_gpu_health_finding", {**labels, "kind": kind}, 1) for kind in sorted(entry.get("reasons") or {})
    ]
    out.append(("budgetgpu_gpu_quarantined", labels, int(uuid in (state.get("quarantine") or {}))))
    out.append(("budgetgpu_gpu_present", labels, 0))
    return out


def _gpu_labels(gpu: dict[str, Any], host: str) -> dict[str, Any]:
    return {
        "gpu": gpu.get("index"),
        "UUID": gpu.get("uuid"),
        "pci_bus_id": nvml_bus_id(gpu.get("bus_id")),
        "modelName": gpu.get("name") if _writable(gpu.get("name")) else "",
        "Hostname": host,
    }


def samples(
    sample: dict[str, Any],
    state: dict[str, Any],
    host: str,
    boot_links: dict[str, dict[str, Any]] | None = None,
    xids: dict[str, dict[str, int]] | None = None,
    now_seconds: float | None = None,
    gone: list[dict[str, Any]] | None = None,
) -> list[tuple[str, dict[str, str], float]]:
    """Return (name, labels, value) of one pass, a sample per known value (an unsupported or unknown value
    is left out, as dcgm-exporter leaves out a field the GPU lacks); the watch writes them with
    prometheus_client under METRICS' types and help. gone: the GPUs the node had that this sample lacks
    (gpu_health.gone), each with the series it keeps, under the labels it had."""
    out: list[tuple[str, dict[str, Any], Any]] = []
    present = [gpu for gpu in sample.get("gpus") or [] if gpu.get("uuid")]
    for gpu in present:
        boot = (boot_links or {}).get(str(gpu.get("bus_id"))) or {}
        out += _gpu_samples(gpu, _gpu_labels(gpu, host), state, boot, xids or {})
    for gpu in gone or []:
        out += _gone_samples(_gpu_labels(gpu, host), state, xids or {})
    node = {"Hostname": host}
    out.append(("budgetgpu_gpu_health_gpus", node, len(sample.get("gpus") or [])))
    out.append(("budgetgpu_gpu_health_gpus_expected", node, len(present) + len(gone or [])))
    if now_seconds is not None:
        out.append(("budgetgpu_gpu_health_last_pass_timestamp_seconds", node, round(now_seconds, 3)))
    return [
        (name, {key: str(value) for key, value in labels.items()}, float(value))
        for name, labels, value in out
        if _writable(value)
    ]
