"""The GPU health watch's decisions: Xid lines, the kernel log read incrementally, findings from one
sample against the previous one, and the per-GPU state with its log lines.

Plain standard-library Python, importing only the node package's pcie, nvml_probe and device_allow, for
gpu-probe and the watch that a timer runs on a node. Every function here is pure over its inputs: the caller
reads NVML (nvml_probe), sysfs and the kernel log, and writes the state file and the log lines.

One pass, as the watch runs it:

    events, cursor = read_journal(journalctl_lines, state.get("cursor"))       # or read_kern_log
    findings = pass_findings(sample, previous_sample, boot_links, events)
    state, lines = watch_state(state, findings, now)
    previous_sample = next_previous(sample, previous_sample)                   # saved for the next pass

and root's part after it (gpu-health restart-jobs): job_restarts(state, running job units) says which job
restarts on fewer GPUs.

A sample is {"gpus": [gpu, ...]}; one gpu holds what nvml_probe.probe_gpu reports (index, uuid,
bus_id, temperature_c, fan_speed_pct, throttle_reasons, retired_pages, remapped_rows, pcie with
replay_counter, width_current, gen_current) plus what the watch reads on top:
  fans: [{"speed_pct", "target_pct"}] (nvmlDeviceGetFanSpeed_v2 / nvmlDeviceGetTargetFanSpeed per
        fan), or the string "unsupported"; without it fan_speed_pct (and fan_target_pct) count as one fan;
  ecc_double_bit_volatile: nvmlDeviceGetTotalEccErrors(uncorrected, volatile), or "unsupported";
  aer: {"correctable": text or parsed, "nonfatal": ..., "fatal": ...} from the aer_dev_* sysfs files
       (the kernel notes that a link partner may count what the endpoint causes: the watch may merge the
       GPU's and its upstream port's counts, or sample the port as well).
A value NVML does not support is the string "unsupported" (nvml_probe.UNSUPPORTED); None is unknown.
Both are skipped: a fan that reports "not supported" is never a dead fan.

A finding is {gpu (uuid or None), bus_id, kind, severity ("info"|"warn"|"take_out"), detail}.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, BinaryIO

from .device_allow import gpu_minor
from .nvml_probe import UNSUPPORTED, known
from .pcie import normalize_bus_id

SEVERITIES = ("info", "warn", "take_out")

# Xid catalogue: xid -> (class, what it means). Classes: "info" (nothing to do), "restart" (restart
# the application; the GPU stays in service), "take_out" (quarantine the GPU until a person resets,
# checks and releases it). Source: NVIDIA, "Analyzing Xid Errors with the Xid Catalog"
# (https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, the catalogue of Ampere and
# newer GPUs, release 610), its "Resolution Bucket (Immediate Action)" column: IGNORE -> "info";
# RESTART_APP -> "restart"; RESET_GPU, RESTART_BM, WORKFLOW_XID_48 and the NVLink workflow ->
# "take_out". Checked on 2026-12-01 against that page (rows 1-13 in the stored copy) and a row-by-row
# transcription of the same catalogue for the rest; the Xids the catalogue marks unused on Ampere and
# newer (56, 61, 81) keep their meaning on older cards. Changed from the first draft by that check:
# 63 (the row remapping event itself: IGNORE, the pending remap is NVML's remapped_rows finding),
# 92 (excessive single-bit ECC interrupts: IGNORE, contact support if it persists) and 38, 43, 44
# (IGNORE) are info; 94 (an ECC error contained to one application) is RESTART_APP; 109 (context
# switch timeout) is RESET_GPU; 46, 110, 143 and 158 were added (RESET_GPU).
XID_CATALOGUE: dict[int, tuple[str, str]] = {
    8: ("restart", "GPU stopped processing (channel idle timeout)"),
    13: ("restart", "graphics engine exception (usually the application: out-of-range access, illegal instruction)"),
    31: ("restart", "GPU memory page fault (usually the application's illegal address)"),
    32: ("restart", "invalid or corrupted push buffer stream"),
    38: ("info", "driver firmware watchdog timeout"),
    43: ("info", "GPU stopped processing (the application's channel was reset)"),
    44: ("info", "graphics engine fault during a context switch"),
    45: ("info", "preemptive cleanup after an earlier error (follows another Xid)"),
    46: ("take_out", "GPU stopped processing (GPU timeout): reset the GPU"),
    48: ("take_out", "double-bit ECC error"),
    56: ("info", "display engine error"),
    61: ("restart", "internal micro-controller breakpoint/warning"),
    62: ("take_out", "internal micro-controller halt"),
    63: ("info", "ECC page retirement or row remapping event (applied at the next GPU reset)"),
    64: ("take_out", "ECC page retirement or row remapping failure"),
    68: ("restart", "video decoder (NVDEC) exception"),
    69: ("restart", "graphics engine class error"),
    74: ("take_out", "NVLink error"),
    79: ("take_out", "GPU has fallen off the bus"),
    81: ("info", "VGA subsystem error"),
    92: ("info", "high single-bit ECC error rate (contact support if it persists)"),
    94: ("restart", "contained ECC error (the application that hit it must restart)"),
    95: ("take_out", "uncontained ECC error"),
    109: ("take_out", "context switch timeout: reset the GPU"),
    110: ("take_out", "security fault error"),
    119: ("take_out", "GSP RPC timeout"),
    120: ("take_out", "GSP error"),
    121: ("info", "corrected C2C link error"),
    140: ("take_out", "unrecovered ECC error"),
    143: ("take_out", "GPU initialization error"),
    154: ("take_out", "GPU recovery action changed: the driver asks for a GPU reset, drain or reboot"),
    158: ("take_out", "GPU fatal timeout"),
}
_XID_SEVERITY = {"info": "info", "restart": "warn", "take_out": "take_out"}

# "NVRM: Xid (PCI:0000:01:00): 79, pid=1234, name=python3, GPU has fallen off the bus." Older drivers
# write "NVRM: Xid (0000:01:00): 13, ..." without "PCI:"; pid and name are optional.
_XID_LINE = re.compile(
    r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?)\): (\d+),?\s*(.*)"
)
_PID_NAME = re.compile(r"^(?:(?:pid|name)=(?:'[^']*'|[^,]*),\s*)+")
_JOURNAL_CURSOR = "-- cursor: "

# Clock event (throttle) reasons that the watch reports, with pynvml's constant names and values
# (nvmlClocksThrottleReason*; nvidia-ml-py 12.535+ also names them nvmlClocksEventReason*).
THROTTLE_BITS: dict[str, int] = {
    "clocksThrottleReasonSwPowerCap": 0x4,
    "clocksThrottleReasonHwSlowdown": 0x8,
    "clocksThrottleReasonSwThermalSlowdown": 0x20,
    "clocksThrottleReasonHwThermalSlowdown": 0x40,
    "clocksThrottleReasonHwPowerBrakeSlowdown": 0x80,
}
_THROTTLE_KINDS = {
    # bit: (kind, severity, words): drawing the power limit under load is normal, hence info.
    0x4: ("power_cap", "info", "power capped (software power limit)"),
    0x8: ("hw_slowdown", "warn", "hardware slowdown (too hot, or the power brake)"),
    0x20: ("thermal_throttle", "warn", "software thermal slowdown"),
    0x40: ("thermal_throttle_hw", "warn", "hardware thermal slowdown"),
    0x80: ("power_brake", "warn", "hardware power brake slowdown (external power brake)"),
}
# nvml_probe.decode_throttle_reasons names, for a sample that carries decoded names, not the mask.
_THROTTLE_NAMES = {
    "gpu_idle": 0x1,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
}
GPU_IDLE = 0x1

LIMITS: dict[str, Any] = {
    "hot_c": 70,  # a fan is judged only on a GPU at least this hot
    "fan_gap_pct": 30,  # a fan this many points below its target is dead
    "dead_fan_severity": "take_out",
    "replay_per_pass": 100,  # PCIe replays per pass above which the link is flagged
    "aer_correctable_per_pass": 10,
}


def classify_xid(xid: int) -> tuple[str, str]:
    """Return (class, description) from XID_CATALOGUE; an unknown Xid is ("restart", "unknown Xid N")."""
    return XID_CATALOGUE.get(xid, ("restart", f"unknown Xid {xid}"))


def parse_xid_line(line: str) -> dict[str, Any] | None:
    """Return {bus_id, xid, text, class, description} for a kernel log line with an NVRM Xid, else None.
    text is the driver's message without the pid=/name= fields."""
    match = _XID_LINE.search(line)
    if not match:
        return None
    xid = int(match.group(2))
    klass, description = classify_xid(xid)
    return {
        "bus_id": normalize_bus_id(match.group(1)),
        "xid": xid,
        "text": _PID_NAME.sub("", match.group(3).strip()),
        "class": klass,
        "description": description,
    }


def read_journal(lines: Iterable[str], cursor: str | None) -> tuple[list[dict[str, Any]], str | None]:
    """Return (Xid events, cursor) from `journalctl -k --show-cursor [--after-cursor=<cursor>]` output.

    The caller runs journalctl with the saved cursor (the first time with -b: this boot only); the new
    cursor is the one journalctl printed last, or the old one when nothing new came ("-- No entries --").
    """
    events = []
    for line in lines:
        if line.startswith(_JOURNAL_CURSOR):
            cursor = line[len(_JOURNAL_CURSOR) :].strip() or cursor
            continue
        event = parse_xid_line(line)
        if event:
            events.append(event)
    return events, cursor


def kern_log_start(cursor: dict[str, Any] | None, inode: int, size: int, from_start: bool = False) -> int:
    """Return the byte offset to read a kern.log file from: the saved offset; 0 after a rotation (another
    inode, or a file shorter than the offset); the end on the first pass unless from_start."""
    if not cursor:
        return 0 if from_start else size
    if cursor.get("inode") != inode or int(cursor.get("offset", 0)) > size:
        return 0
    return int(cursor.get("offset", 0))


def read_kern_log(
    source: BinaryIO, cursor: dict[str, Any] | None, inode: int, size: int, from_start: bool = False
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Return (Xid events, cursor {inode, offset}) for the lines of a plain kern.log file added since the
    cursor. source is the open file (binary), inode and size its os.fstat; a last line without its
    newline (still being written) is left for the next pass."""
    offset = kern_log_start(cursor, inode, size, from_start)
    source.seek(offset)
    events = []
    for raw in source:
        if not raw.endswith(b"\n"):
            break
        offset += len(raw)
        event = parse_xid_line(raw.decode("utf-8", "replace"))
        if event:
            events.append(event)
    return events, {"inode": inode, "offset": offset}


def parse_aer(text: str | None) -> dict[str, int]:
    """Return {error name: count} from an aer_dev_correctable/_nonfatal/_fatal file ("Bad TLP 0" lines,
    then "TOTAL_ERR_COR 2"); the total is under "total". Empty for a missing file."""
    counts: dict[str, int] = {}
    for line in (text or "").splitlines():
        name, _space, count = line.strip().rpartition(" ")
        if not name or not count.isdigit():
            continue
        counts["total" if name.startswith("TOTAL_ERR_") else name] = int(count)
    if counts and "total" not in counts:
        counts["total"] = sum(counts.values())
    return counts


def gpu_label(gpu: dict[str, Any]) -> str:
    """Return "GPU 2 (GPU-0f7beba8..., 0000:03:00.0)" for detail lines."""
    uuid = str(gpu.get("uuid") or "uuid unknown")
    short = uuid[:12] + "..." if len(uuid) > 12 else uuid
    index = gpu.get("index")
    name = "GPU" if index is None else f"GPU {index}"
    return f"{name} ({short}, {gpu.get('bus_id')})"


def _finding(gpu: dict[str, Any], kind: str, severity: str, words: str) -> dict[str, Any]:
    return {
        "gpu": gpu.get("uuid"),
        "bus_id": gpu.get("bus_id"),
        "kind": kind,
        "severity": severity,
        "detail": f"{gpu_label(gpu)}: {words}",
    }


def _fans(gpu: dict[str, Any]) -> list[dict[str, Any]]:
    fans = gpu.get("fans")
    if fans == UNSUPPORTED:
        return []
    if isinstance(fans, list):
        return fans
    return [{"speed_pct": gpu.get("fan_speed_pct"), "target_pct": gpu.get("fan_target_pct")}]


def fan_findings(gpu: dict[str, Any], limits: dict[str, Any]) -> list[dict[str, Any]]:
    """Return a dead_fan finding for each fan at 0% or far below its target on a hot GPU."""
    temp = gpu.get("temperature_c")
    if not known(temp) or temp < limits["hot_c"]:
        return []
    findings = []
    for number, fan in enumerate(_fans(gpu)):
        speed, target = fan.get("speed_pct"), fan.get("target_pct")
        if not known(speed):
            continue
        far_below = known(target) and target - speed >= limits["fan_gap_pct"]
        if speed == 0 or far_below:
            aim = f" (target {target}%)" if known(target) else ""
            which = f"fan {number}" if len(_fans(gpu)) > 1 else "fan"
            words = f"{which} {speed}%{aim} at {temp} C: fan dead?"
            findings.append(_finding(gpu, "dead_fan", limits["dead_fan_severity"], words))
    return findings


def throttle_mask(reasons: Any) -> int | None:
    """Return the throttle reasons as NVML's bit mask, from a mask or from decoded names; None if unknown."""
    if isinstance(reasons, int):
        return reasons
    if isinstance(reasons, list):
        mask = 0
        for name in reasons:
            mask |= _THROTTLE_NAMES.get(name, 0)
        return mask
    return None


def throttle_findings(gpu: dict[str, Any]) -> list[dict[str, Any]]:
    """Return one finding per thermal or power throttle reason set."""
    mask = throttle_mask(gpu.get("throttle_reasons"))
    if not mask:
        return []
    temp = gpu.get("temperature_c")
    at = f" at {temp} C" if known(temp) else ""
    return [
        _finding(gpu, kind, severity, f"{words}{at}")
        for bit, (kind, severity, words) in _THROTTLE_KINDS.items()
        if mask & bit
    ]


def _growth(now: Any, before: Any) -> int:
    """Return how much a counter grew; 0 when either is unknown or it went back (a reset or reboot)."""
    if not (known(now) and known(before)) or now < before:
        return 0
    return now - before


def memory_findings(gpu: dict[str, Any], previous: dict[str, Any]) -> list[dict[str, Any]]:
    """Return findings for double-bit ECC growth, pages pending retirement, remapped rows pending/failed."""
    findings = []
    dbe = _growth(gpu.get("ecc_double_bit_volatile"), previous.get("ecc_double_bit_volatile"))
    if dbe:
        total = gpu["ecc_double_bit_volatile"]
        findings.append(_finding(gpu, "ecc_dbe", "take_out", f"{dbe} new double-bit ECC errors ({total} since boot)"))
    pages = gpu.get("retired_pages")
    if isinstance(pages, dict) and pages.get("pending") is True:
        words = "retired pages pending: reset the GPU (or reboot) to retire them"
        findings.append(_finding(gpu, "retired_pages_pending", "warn", words))
    rows = gpu.get("remapped_rows")
    if isinstance(rows, dict) and rows.get("failure") is True:
        words = f"row remapping failed ({rows.get('uncorrectable')} uncorrectable rows): replace the card"
        findings.append(_finding(gpu, "remap_failure", "take_out", words))
    elif isinstance(rows, dict) and rows.get("pending") is True:
        words = "remapped rows pending: reset the GPU to apply them"
        findings.append(_finding(gpu, "remap_pending", "warn", words))
    return findings


def link_findings(
    gpu: dict[str, Any], previous: dict[str, Any], boot: dict[str, Any], limits: dict[str, Any]
) -> list[dict[str, Any]]:
    """Return findings for PCIe replay growth in this pass and a link below what the probe saw at boot.

    boot is {"width", "gen"} from pcie_facts' effective link. The generation is compared only while the
    GPU is busy (gpu_idle clear): GPUs lower their link's generation at idle.
    """
    pcie, before = gpu.get("pcie") or {}, previous.get("pcie") or {}
    findings = []
    replays = _growth(pcie.get("replay_counter"), before.get("replay_counter"))
    if replays > limits["replay_per_pass"]:
        words = f"PCIe replay counter +{replays} this pass ({pcie['replay_counter']} total): check the riser and slot"
        findings.append(_finding(gpu, "pcie_replays", "warn", words))
    width, boot_width = pcie.get("width_current"), boot.get("width")
    if known(width) and known(boot_width) and width < boot_width:
        words = f"PCIe link now x{width}, x{boot_width} at boot: reseat the card or riser"
        findings.append(_finding(gpu, "link_width", "warn", words))
    gen, boot_gen = pcie.get("gen_current"), boot.get("gen")
    mask = throttle_mask(gpu.get("throttle_reasons"))
    busy = mask is not None and not mask & GPU_IDLE
    if busy and known(gen) and known(boot_gen) and gen < boot_gen:
        words = f"PCIe link now gen{gen} while busy, gen{boot_gen} at boot: check the riser"
        findings.append(_finding(gpu, "link_gen", "warn", words))
    return findings


def _aer_counts(value: Any) -> dict[str, int]:
    return parse_aer(value) if isinstance(value, str) or value is None else value


def aer_findings(gpu: dict[str, Any], previous: dict[str, Any], limits: dict[str, Any]) -> list[dict[str, Any]]:
    """Return findings for AER counters that grew since the previous sample (fatal: take_out; non-fatal:
    warn; correctable: warn above the per-pass limit)."""
    aer, before = gpu.get("aer") or {}, previous.get("aer") or {}
    rules = (
        ("fatal", "aer_fatal", "take_out", 0),
        ("nonfatal", "aer_nonfatal", "warn", 0),
        ("correctable", "aer_correctable", "warn", limits["aer_correctable_per_pass"]),
    )
    findings = []
    for key, kind, severity, floor in rules:
        now, then = _aer_counts(aer.get(key)), _aer_counts(before.get(key))
        grew = _growth(now.get("total"), then.get("total"))
        if grew > floor:
            named = [f"{name} +{count - then.get(name, 0)}" for name, count in now.items() if name != "total"]
            named = [text for text in named if not text.endswith(" +0")]
            words = f"PCIe AER {key} errors +{grew} this pass ({', '.join(named) or 'unnamed'})"
            findings.append(_finding(gpu, kind, severity, words))
    return findings


def xid_findings(events: list[dict[str, Any]], gpus: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Return one finding per Xid (per GPU and Xid number) of this pass; a bus id no GPU has gives gpu None."""
    by_bus = {gpu.get("bus_id"): gpu for gpu in gpus}
    findings: dict[tuple[Any, int], dict[str, Any]] = {}
    for event in events:
        gpu = by_bus.get(event["bus_id"]) or {"uuid": None, "bus_id": event["bus_id"]}
        severity = _XID_SEVERITY[event["class"]]
        words = f"Xid {event['xid']}, {event['description']}: {event['text']}"
        findings.setdefault((gpu.get("uuid"), event["xid"]), _finding(gpu, f"xid_{event['xid']}", severity, words))
    return list(findings.values())


def pass_findings(
    sample: dict[str, Any],
    previous: dict[str, Any] | None,
    boot_links: dict[str, dict[str, Any]] | None,
    events: list[dict[str, Any]] | None = None,
    limits: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Return every finding of one pass: sample against the previous sample (same shape, matched by
    uuid), boot_links {bus_id: {width, gen}} from the probe, and the pass's Xid events."""
    limits = {**LIMITS, **(limits or {})}
    before = {gpu.get("uuid"): gpu for gpu in _remembered(previous)}
    findings = []
    for gpu in sample.get("gpus") or []:
        then = before.get(gpu.get("uuid")) or {}
        findings += fan_findings(gpu, limits)
        findings += throttle_findings(gpu)
        findings += memory_findings(gpu, then)
        findings += link_findings(gpu, then, (boot_links or {}).get(gpu.get("bus_id")) or {}, limits)
        findings += aer_findings(gpu, then, limits)
    # A GPU that fell off the bus is gone from this sample: its Xid finds it in the previous one.
    current = sample.get("gpus") or []
    present = {gpu.get("uuid") for gpu in current}
    known = current + [gpu for uuid, gpu in before.items() if uuid not in present]
    return findings + missing_findings(sample, previous) + xid_findings(events or [], known)


def missing_findings(sample: dict[str, Any], previous: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Return a take_out finding for each GPU of the previous sample that NVML no longer lists while others
    still answer (a GPU that fell off the bus). A sample without any GPU (driver not loaded, an upgrade)
    gives none: that is the driver's state, which the probe reports."""
    gpus = sample.get("gpus") or []
    if not gpus:
        return []
    present = {gpu.get("uuid") for gpu in gpus}
    return [
        _finding(gpu, "gpu_missing", "take_out", "no longer listed by NVML: fallen off the bus?")
        for gpu in _remembered(previous)
        if gpu.get("uuid") not in present
    ]


def _remembered(previous: dict[str, Any] | None) -> list[dict[str, Any]]:
    return ((previous or {}).get("gpus") or []) + ((previous or {}).get("missing") or [])


def expected_gpus(gpu_facts: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Return [{uuid, index, bus_id, name}] of the GPUs the probe listed (gpu_facts' budgetgpu_gpus): the
    GPUs the watch expects on the node (role gpu_health writes them into its config at each provision)."""
    return [
        {key: gpu.get(key) for key in ("uuid", "index", "bus_id", "name")}
        for gpu in (gpu_facts or {}).get("gpus") or []
        if isinstance(gpu, dict) and isinstance(gpu.get("uuid"), str) and gpu["uuid"]
    ]


def with_expected(previous: dict[str, Any] | None, expected: Iterable[dict[str, Any]] | None) -> dict[str, Any]:
    """Return the previous sample with each expected GPU it does not remember added under "missing": a GPU
    the probe saw and NVML no longer lists is missing from the watch's first pass on (a lost state, a card
    gone at boot), as one it saw itself is."""
    previous = dict(previous or {"gpus": []})
    known = {gpu.get("uuid") for gpu in _remembered(previous)}
    added = [dict(gpu) for gpu in expected or [] if gpu.get("uuid") and gpu.get("uuid") not in known]
    if added:
        previous["missing"] = list(previous.get("missing") or []) + added
    return previous


def gone(sample: dict[str, Any], previous: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Return the GPUs the watch remembers (previous, after next_previous) that this sample lacks: those
    off the bus, and every GPU while the driver answers with none."""
    present = {gpu.get("uuid") for gpu in sample.get("gpus") or []}
    return [gpu for gpu in _remembered(previous) if gpu.get("uuid") and gpu.get("uuid") not in present]


def next_previous(sample: dict[str, Any], previous: dict[str, Any] | None) -> dict[str, Any]:
    """Return what the caller saves as the previous sample for the next pass: this sample, with the GPUs
    that went missing kept under "missing" (so that a GPU still gone is not "cleared"); a sample without
    any GPU keeps the previous one (the counters compare again once the driver is back)."""
    gpus = sample.get("gpus") or []
    if not gpus:
        return previous or {"gpus": []}
    present = {gpu.get("uuid") for gpu in gpus}
    return {**sample, "missing": [gpu for gpu in _remembered(previous) if gpu.get("uuid") not in present]}


def _status(reasons: dict[str, dict[str, Any]], taken_out: dict[str, Any] | None) -> str:
    severities = {reason["severity"] for reason in reasons.values()}
    if taken_out or "take_out" in severities:
        return "take_out"
    return "warn" if "warn" in severities else "ok"


def _gpu_transition(
    entry: dict[str, Any], findings: list[dict[str, Any]], now: Any
) -> tuple[dict[str, Any], list[str]]:
    """Return one GPU's new state entry and its log lines."""
    old = entry.get("reasons") or {}
    reasons, lines = {}, []
    for finding in findings:
        kind = finding["kind"]
        since = old[kind]["since"] if kind in old else now
        reasons[kind] = {"severity": finding["severity"], "detail": finding["detail"], "since": since}
        if kind not in old:
            lines.append(f"{finding['severity']}: {finding['detail']}")
    lines += [f"cleared: {reason['detail']}" for kind, reason in old.items() if kind not in reasons]
    taken_out = entry.get("taken_out")
    first = next((f for f in findings if f["severity"] == "take_out"), None)
    if not taken_out and first:
        taken_out = {"since": now, "reason": first["detail"]}
    status = _status(reasons, taken_out)
    label = entry.get("label") or (findings[0]["detail"].split(": ")[0] if findings else "GPU")
    if status != entry.get("status", "ok"):
        lines.append(f"{label}: status {entry.get('status', 'ok')} -> {status}")
    new = {"label": label, "bus_id": entry.get("bus_id"), "status": status, "reasons": reasons}
    new["taken_out"] = taken_out
    new["since"] = entry.get("since", now) if status == entry.get("status") else now
    return new, lines


def watch_state(
    previous_state: dict[str, Any] | None, findings: list[dict[str, Any]], now: Any
) -> tuple[dict[str, Any], list[str]]:
    """Return (new state, log lines) after one pass.

    State: {"gpus": {key: {label, bus_id, status ok|warn|take_out, since, reasons {kind: {severity,
    detail, since}}, taken_out {since, reason} or None}}, ...the previous state's other keys (the
    caller's cursor)}; key is the GPU's uuid (its bus id when a finding has none). A new finding is
    logged once, one that persists is not, one that clears is logged once as "cleared"; a status change
    is logged; take_out stays until release().
    """
    state = dict(previous_state or {})
    gpus = dict(state.get("gpus") or {})
    grouped: dict[str, list[dict[str, Any]]] = {}
    for finding in findings:
        key = finding.get("gpu") or finding.get("bus_id") or "unknown"
        grouped.setdefault(key, []).append(finding)
    lines: list[str] = []
    for key in sorted(set(gpus) | set(grouped)):
        entry = dict(gpus.get(key) or {"status": "ok", "reasons": {}})
        entry.setdefault("bus_id", (grouped.get(key) or [{}])[0].get("bus_id"))
        gpus[key], gpu_lines = _gpu_transition(entry, grouped.get(key, []), now)
        lines += gpu_lines
    state["gpus"] = gpus
    return state, lines


def release(state: dict[str, Any], uuid: str, now: Any) -> tuple[dict[str, Any], list[str]]:
    """Return (state, log lines) with the GPU back in service: its take_out mark and take_out reasons go
    (a fault that persists is found, and logged, again on the next pass); warn reasons stay."""
    gpus = dict(state.get("gpus") or {})
    entry = gpus.get(uuid)
    if entry is None:
        return state, [f"release: {uuid} is not in the health state"]
    label = entry.get("label") or uuid
    previous = state.get("previous") or {}
    missing = previous.get("missing") or []
    if any(gpu.get("uuid") == uuid for gpu in missing):
        # A GPU gone from the node, released: taken out for good. The watch forgets it (its series go); a
        # probe that still lists it (gpu_health's config) makes it missing again at the next pass.
        previous = {**previous, "missing": [gpu for gpu in missing if gpu.get("uuid") != uuid]}
        xids = {key: value for key, value in (state.get("xids") or {}).items() if key != uuid}
        gpus.pop(uuid)
        return {**state, "gpus": gpus, "previous": previous, "xids": xids}, [f"{label}: released and forgotten (gone)"]
    reasons = {k: r for k, r in (entry.get("reasons") or {}).items() if r["severity"] != "take_out"}
    status = _status(reasons, None)
    gpus[uuid] = {**entry, "reasons": reasons, "taken_out": None, "status": status, "since": now}
    line = f"{label}: released ({entry.get('status')} -> {status})"
    return {**state, "gpus": gpus}, [line]


def boot_links(pcie_facts: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Return {bus_id: {width, gen}}: each GPU's own link as pcie_facts saw it trained (its "link"
    current width and generation, what NVML's width_current compares with)."""
    links = {}
    for gpu in (pcie_facts or {}).get("gpus") or []:
        link = gpu.get("link") or {}
        links[normalize_bus_id(str(gpu.get("bus_id")))] = {
            "width": link.get("current_width"),
            "gen": link.get("current_gen"),
        }
    return links


def quarantined(state: dict[str, Any] | None, listed: Iterable[str] = ()) -> dict[str, dict[str, Any]]:
    """Return {uuid: {reason, since, by}} of the GPUs out of service: those the watch took out
    (by "watch", until release()) and those of this node the inventory lists (by "inventory", since
    None; a list in group_vars names the GPUs of every node, each node keeps its own: those of its
    previous sample, present or missing)."""
    state = state or {}
    mine = {gpu.get("uuid") for gpu in _remembered(state.get("previous"))}
    out = {
        str(uuid): {"reason": "listed in gpu_health_quarantine", "since": None, "by": "inventory"}
        for uuid in listed
        if uuid in mine
    }
    for uuid, entry in (state.get("gpus") or {}).items():
        taken = entry.get("taken_out")
        if taken and uuid not in out:
            out[uuid] = {"reason": taken.get("reason"), "since": taken.get("since"), "by": "watch"}
    return out


def _out_words(uuid: str, why: dict[str, Any]) -> str:
    since = f" since {why['since']}" if why.get("since") else ""
    return f"{uuid} quarantined{since} ({why.get('reason')})"


def start_plan(gpus: list[str], out: dict[str, dict[str, Any]], nproc: int, fixed: bool) -> dict[str, Any]:
    """Return how a job starts on a node whose GPUs (uuids, index order) include quarantined ones (out):
    {action start|hold, nproc, visible (CUDA_VISIBLE_DEVICES uuids), left_out [words], reason}.

    nproc_per_node "gpu" (fixed false) runs one rank per GPU in service; a fixed count runs on GPUs
    0..nproc-1 as before (inference workers may hold the others) and is held when one of them is out,
    as is a job with no GPU left: a job is never started on fewer ranks than it asked for.
    """
    wanted = gpus[:nproc] if fixed else gpus
    left_out = [_out_words(uuid, out[uuid]) for uuid in wanted if uuid in out]
    visible = [uuid for uuid in wanted if uuid not in out]
    plan = {"action": "start", "nproc": len(visible), "visible": visible, "left_out": left_out, "reason": ""}
    if fixed and left_out:
        plan.update(action="hold", reason=f"nproc_per_node is fixed at {nproc} and {'; '.join(left_out)}")
    elif not visible:
        plan.update(action="hold", reason=f"no GPU left in service: {'; '.join(left_out) or 'the node lists no GPU'}")
    elif left_out:
        plan["reason"] = f"{len(visible)} of {len(wanted)} GPUs: left out {'; '.join(left_out)}"
    return plan


def fixed_size(env: dict[str, str]) -> str:
    """Return why a job runs only at the size its unit asks (start_plan's fixed), from its unit's environment
    (jobs.torchrun_environment): a number as nproc_per_node (BUDGETGPU_NPROC_FIXED, a unit without it too), or
    hsdp, whose mesh needs as many ranks on every node; "" for a job that runs one rank per GPU in service."""
    if env.get("BUDGETGPU_NPROC_FIXED", "1") != "0":
        return "nproc_per_node is fixed"
    if env.get("BUDGETGPU_PARALLELISM") == "hsdp":
        return "hsdp needs as many ranks on every node"
    return ""


def newly_quarantined(state: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Return {uuid: {reason, since, by}} of the GPUs that the pass which wrote this state took out: the
    watch's take-outs dated at the pass's time (its "updated"). The inventory's list is not new to a job:
    the launcher left those GPUs out when the job started."""
    state = state or {}
    updated = state.get("updated")
    out = state.get("quarantine") if isinstance(state.get("quarantine"), dict) else {}
    return {
        uuid: why for uuid, why in out.items() if updated and why.get("by") == "watch" and why.get("since") == updated
    }


def gpu_minors(state: dict[str, Any] | None) -> dict[str, int]:
    """Return {uuid: device minor (/dev/nvidia<minor>)} of the GPUs the watch remembers, present or missing: a
    GPU off the bus keeps the minor it had, while NVML numbers the others anew."""
    return {gpu["uuid"]: gpu_minor(gpu) for gpu in _remembered((state or {}).get("previous")) if gpu.get("uuid")}


def job_restarts(state: dict[str, Any] | None, units: dict[str, dict[str, Any]]) -> list[dict[str, str]]:
    """Return [{unit, action restart|keep, reason}] for the running training job units that hold a GPU the
    last pass took out (newly_quarantined). units: {unit: {"minors": the GPU minors its DeviceAllow= opens
    (device_allow.unit_gpu_minors), "fixed": fixed_size of its environment}} of the node's running job units.

    A job with nproc_per_node "gpu" restarts: its launcher's start_plan then runs one rank per GPU still in
    service. One of a fixed size keeps running as before (start_plan holds it at its next start). A GPU
    released restarts nothing: the job is back at its full size at its next start.
    """
    new, minors = newly_quarantined(state), gpu_minors(state)
    decisions = []
    for unit, held in sorted(units.items()):
        taken = [_out_words(uuid, why) for uuid, why in new.items() if minors.get(uuid) in held["minors"]]
        if not taken:
            continue
        words = "; ".join(taken)
        if held["fixed"]:
            reason = f"{words}; {held['fixed']}: it keeps running, and is held at its next start"
            decisions.append({"unit": unit, "action": "keep", "reason": reason})
        else:
            reason = f"{words}; nproc_per_node is gpu: it restarts on the GPUs still in service"
            decisions.append({"unit": unit, "action": "restart", "reason": reason})
    return decisions
