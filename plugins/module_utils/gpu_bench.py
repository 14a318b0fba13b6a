"""The GPU benchmark's decisions: which dtypes a card runs, which GPUs are busy, and what the
figures mean (each GPU against the median of its model across the cluster: stragglers with their
likely cause, copies held back by their PCIe link).

Plain standard-library Python, importing only the node package's device_allow: gpu-probe --bench runs it on a
node (budgetgpu_node), and the filter `gpu_bench_report` on the control node. The measuring part is
gpu_bench_measure.py.

A result is one GPU's measurement (gpu_bench_measure.measure_gpu):
{host, index, uuid, bus_id, name, device_id, compute_capability, matmul_tflops: {dtype: TFLOPS},
 memory_gbs, h2d_gbs, d2h_gbs, link: {gen, width, bandwidth_gbps, limiting_hop, capable_gen,
 capable_width}, samples: {temperature_c_max, sm_clock_mhz_median, sm_clock_max_mhz, power_w_max,
 power_limit_w, throttle_reasons}, seconds, timed_out, errors}.
"""

from __future__ import annotations

import statistics
from typing import Any

from .device_allow import gpu_minor

# A GPU more than this fraction below the median of its model is a straggler (the 15%).
DEFAULT_THRESHOLD = 0.15
# A pinned copy under this fraction of what its link carries is far below it: something other
# than the link holds it back (pageable memory, the IOMMU, a remote NUMA node).
DEFAULT_COPY_LINK_FRACTION = 0.5

# Compute capability from which the card's tensor cores run the dtype (bf16 from Ampere, 8.0);
# fp16 runs everywhere CUDA does from Maxwell 5.3, fp32 everywhere.
DTYPE_MIN_CAPABILITY = {"fp32": (0, 0), "fp16": (5, 3), "bf16": (8, 0)}

# Throttle reasons (nvml_probe.decode_throttle_reasons names) by the cause they point to.
THERMAL_REASONS = ("hw_thermal_slowdown", "sw_thermal_slowdown")
POWER_REASONS = ("sw_power_cap", "hw_power_brake_slowdown", "hw_slowdown")

COMPUTE_METRICS = ("memory_gbs",)
COPY_METRICS = ("h2d_gbs", "d2h_gbs")
METRIC_LABELS = {"memory_gbs": "memory bandwidth", "h2d_gbs": "H2D", "d2h_gbs": "D2H"}


def dtypes_for(compute_capability: Any) -> list[str]:
    """Return the matmul dtypes to measure on a card of this compute capability ("8.6")."""
    try:
        major, minor = (int(part) for part in str(compute_capability).split(".")[:2])
    except ValueError:
        return ["fp32"]
    return [dtype for dtype, floor in DTYPE_MIN_CAPABILITY.items() if (major, minor) >= floor]


def model_key(gpu: dict[str, Any]) -> str:
    """Return what identifies a GPU's model: its PCI device id (CONTRIBUTING: GPU models are compared
    by device id, not by display names, which drivers spell differently), else the name."""
    device = gpu.get("device_id")
    return str(device).lower() if device else f"name:{gpu.get('name')}"


def busy_gpus(
    gpus: list[dict[str, Any]], jobs: dict[str, set[int]], workers: dict[str, str], processes: dict[str, list[int]]
) -> dict[str, str]:
    """Return {uuid: why it is busy} for the node's GPUs: a training job holds the GPUs its unit may open (jobs:
    {unit: GPU minors}, from its DeviceAllow=, which the job model's job_gpus decided), an inference worker
    the GPU its unit names (workers: {unit: uuid}), and NVML lists the processes on a GPU (processes: {uuid: [pid]})."""
    busy = {}
    for gpu in gpus:
        uuid = gpu.get("uuid")
        reasons = [f"job {unit} holds it" for unit, minors in sorted(jobs.items()) if gpu_minor(gpu) in minors]
        reasons += [f"inference worker {unit} uses it" for unit, used in sorted(workers.items()) if used == uuid]
        pids = processes.get(uuid) or []
        if pids:
            reasons.append("processes " + ", ".join(str(pid) for pid in pids) + " use it")
        if reasons:
            busy[uuid] = "; ".join(reasons)
    return busy


def refusal(host: str, gpus: list[dict[str, Any]], busy: dict[str, str]) -> str | None:
    """Return the message that refuses a benchmark on busy GPUs, naming host and GPUs (grouped by
    reason); None when every GPU is free."""
    by_reason: dict[str, list[str]] = {}
    for gpu in gpus:
        if gpu.get("uuid") in busy:
            by_reason.setdefault(busy[gpu["uuid"]], []).append(f"GPU {gpu.get('index')} ({gpu.get('uuid')})")
    if not by_reason:
        return None
    named = [f"{', '.join(names)}: {reason}" for reason, names in by_reason.items()]
    return (
        f"{host}: will not benchmark GPUs in use, it would slow the work and measure less than the card gives: "
        + "; ".join(named)
        + ": stop them first, or set gpu_bench_force=true (gpu-probe --bench --force)"
    )


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) and value > 0 else None


def _median(values: list[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return statistics.median(known) if known else None


def _link_text(link: dict[str, Any]) -> str:
    gen, width = link.get("gen"), link.get("width")
    return f"x{width if width is not None else '?'} gen{gen if gen is not None else '?'}"


def _metrics(gpu: dict[str, Any]) -> dict[str, float | None]:
    """Return the GPU's figures by metric name: matmul_<dtype>, memory_gbs, h2d_gbs, d2h_gbs."""
    figures = {f"matmul_{dtype}": _number(value) for dtype, value in (gpu.get("matmul_tflops") or {}).items()}
    figures.update({name: _number(gpu.get(name)) for name in (*COMPUTE_METRICS, *COPY_METRICS)})
    return figures


def _label(metric: str) -> str:
    return f"{metric[7:]} matmul" if metric.startswith("matmul_") else METRIC_LABELS.get(metric, metric)


def _unit(metric: str) -> str:
    return "TFLOPS" if metric.startswith("matmul_") else "GB/s"


def straggler_cause(gpu: dict[str, Any], peers: list[dict[str, Any]], slow: list[str], threshold: float) -> str:
    """Return the likely cause of a straggler: throttle reasons seen during the run (thermal first,
    then power), a link slower than its peers' when the copies are slow, clocks below its peers'."""
    samples = gpu.get("samples") or {}
    seen = set(samples.get("throttle_reasons") or [])
    thermal = [reason for reason in THERMAL_REASONS if reason in seen]
    if thermal:
        temp = samples.get("temperature_c_max")
        hot = f", up to {temp} C" if temp is not None else ""
        return (
            f"thermal throttling ({', '.join(thermal)} during the run{hot}): check the fans, the heatsink and its "
            "thermal paste, and the airflow"
        )
    power = [reason for reason in POWER_REASONS if reason in seen]
    if power:
        draw, limit = samples.get("power_w_max"), samples.get("power_limit_w")
        drew = f", drew up to {draw:.0f} W of a {limit:.0f} W limit" if _number(draw) and _number(limit) else ""
        return f"power throttling ({', '.join(power)} during the run{drew}): check the power cap and the PSU cables"
    link = gpu.get("link") or {}
    peer_link = _median([_number((peer.get("link") or {}).get("bandwidth_gbps")) for peer in peers])
    own_link = _number(link.get("bandwidth_gbps"))
    if any(metric in COPY_METRICS for metric in slow) and own_link and peer_link and own_link < peer_link:
        return f"a slow link: {_link_text(link)} carries {own_link:.2f} GB/s, its peers' {peer_link:.2f} GB/s"
    clock = _number(samples.get("sm_clock_mhz_median"))
    peer_clock = _median([_number((peer.get("samples") or {}).get("sm_clock_mhz_median")) for peer in peers])
    if clock and peer_clock and clock < peer_clock * (1 - threshold):
        return f"low clocks: SM at {clock:.0f} MHz during the run, its peers at {peer_clock:.0f} MHz"
    return "no throttle reason, link or clock explains it: run it again, then check the card"


def link_finding(
    gpu: dict[str, Any], peer_medians: dict[str, float | None], threshold: float, fraction: float
) -> str | None:
    """Return why the GPU's copies are flagged against its link, or None: copies slow against their
    peers on a link narrower than theirs are held back by that link; copies far below what their own
    link carries are held back by something else."""
    link = gpu.get("link") or {}
    carries = _number(link.get("bandwidth_gbps"))
    figures = {metric: _number(gpu.get(metric)) for metric in COPY_METRICS}
    if carries is None:
        return None
    by_link = [
        metric
        for metric, value in figures.items()
        if value is not None
        and peer_medians.get(metric)
        and value < peer_medians[metric] * (1 - threshold)
        and carries < peer_medians[metric]
    ]
    far_below = [metric for metric, value in figures.items() if value is not None and value < carries * fraction]
    flagged = by_link or far_below
    if not flagged:
        return None
    where = f"{gpu.get('host')} GPU {gpu.get('index')} ({gpu.get('bus_id')})"
    copies = ", ".join(f"{METRIC_LABELS[metric]} {figures[metric]:.2f} GB/s" for metric in flagged)
    hop = link.get("limiting_hop")
    at = f" (limiting hop {hop})" if hop and hop != gpu.get("bus_id") else ""
    if by_link:
        capable = link.get("capable_width")
        if isinstance(capable, int) and isinstance(link.get("width"), int) and link["width"] < capable:
            advice = (
                f"the link trained at x{link['width']} although both ends support x{capable}: reseat the riser or card"
            )
        else:
            advice = "the slot or riser limits it: a wider slot or riser gives more"
        return f"{where}: {copies}, link {_link_text(link)}{at} carries {carries:.2f} GB/s: {advice}"
    return (
        f"{where}: {copies}, far below the {carries:.2f} GB/s its link {_link_text(link)}{at} carries: check that "
        "the memory is pinned, the IOMMU, and the GPU's NUMA node"
    )


def _straggler_line(entry: dict[str, Any], figures: dict[str, float | None]) -> str:
    where = f"{entry.get('host')} GPU {entry.get('index')} ({entry.get('bus_id')}, {entry.get('name')})"
    ratios, slow = entry["ratio"], entry["slow"]
    figures_text = ", ".join(
        f"{_label(name)} {figures[name]:.3g} {_unit(name)} ({(ratios[name] - 1) * 100:+.0f}%)" for name in slow
    )
    return (
        f"{where}: {(1 - ratios[slow[0]]) * 100:.0f}% slower than the median of its model ({entry['peers']} GPU(s): "
        f"{figures_text}): {entry['cause']}"
    )


def analyze(
    results: list[dict[str, Any]],
    threshold: float = DEFAULT_THRESHOLD,
    copy_link_fraction: float = DEFAULT_COPY_LINK_FRACTION,
) -> dict[str, Any]:
    """Return the report: every GPU with its figures, the peer medians of its model and their ratios,
    the stragglers with their cause, and copies flagged against their link."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for gpu in results:
        groups.setdefault(model_key(gpu), []).append(gpu)
    medians = {}
    for key, members in groups.items():
        names = sorted({name for member in members for name in _metrics(member)})
        medians[key] = {name: _median([_metrics(member).get(name) for member in members]) for name in names}
    gpus, stragglers, link_flags = [], [], []
    for gpu in results:
        key = model_key(gpu)
        peers = groups[key]
        figures = _metrics(gpu)
        ratios = {
            name: round(value / medians[key][name], 3)
            for name, value in figures.items()
            if value is not None and medians[key].get(name)
        }
        slow = sorted((name for name, ratio in ratios.items() if ratio < 1 - threshold), key=lambda name: ratios[name])
        entry = {
            **gpu,
            "model": key,
            "peers": len(peers),
            "peer_median": medians[key],
            "ratio": ratios,
            "slow": slow,
            "straggler": bool(slow),
            "cause": None,
            "link_flags": [],
        }
        if slow:
            entry["cause"] = straggler_cause(gpu, peers, slow, threshold)
            stragglers.append(_straggler_line(entry, figures))
        flag = link_finding(gpu, medians[key], threshold, copy_link_fraction)
        if flag:
            entry["link_flags"].append(flag)
            link_flags.append(flag)
        gpus.append(entry)
    return {
        "threshold": threshold,
        "copy_link_fraction": copy_link_fraction,
        "gpus": gpus,
        "stragglers": stragglers,
        "link_flags": link_flags,
        "timed_out": [f"{gpu.get('host')} GPU {gpu.get('index')}" for gpu in results if gpu.get("timed_out")],
        "passed": not stragglers and not link_flags,
    }


def _cell(value: Any, digits: int = 1) -> str:
    number = _number(value)
    return "-" if number is None else f"{number:.{digits}f}"


def _ratio_cell(entry: dict[str, Any], metric: str) -> str:
    ratio = entry["ratio"].get(metric)
    return "" if ratio is None or abs(ratio - 1) < 0.005 else f" ({(ratio - 1) * 100:+.0f}%)"


def report_table(report: dict[str, Any]) -> list[str]:
    """Return the printed table: a line per GPU (figures, against its peer median in %), then the
    stragglers and the link flags, then a verdict."""
    header = ("HOST", "GPU", "NAME", "FP32", "FP16", "BF16", "MEM GB/s", "H2D GB/s", "D2H GB/s", "LINK (GB/s)")
    header += ("TEMP", "SM MHz", "THROTTLE", "VERDICT")
    rows = [header]
    for entry in report["gpus"]:
        tflops = entry.get("matmul_tflops") or {}
        samples = entry.get("samples") or {}
        link = entry.get("link") or {}
        throttle = [reason for reason in samples.get("throttle_reasons") or [] if reason != "gpu_idle"]
        verdict = "STRAGGLER" if entry["straggler"] else ""
        verdict += (" " if verdict else "") + ("LINK" if entry["link_flags"] else "")
        rows.append(
            (
                str(entry.get("host")),
                str(entry.get("index")),
                str(entry.get("name")),
                *(
                    (_cell(tflops.get(dtype)) + _ratio_cell(entry, f"matmul_{dtype}")) if dtype in tflops else "-"
                    for dtype in ("fp32", "fp16", "bf16")
                ),
                *(_cell(entry.get(metric)) + _ratio_cell(entry, metric) for metric in ("memory_gbs", *COPY_METRICS)),
                f"{_link_text(link)} ({_cell(link.get('bandwidth_gbps'), 2)})",
                "-" if samples.get("temperature_c_max") is None else f"{samples['temperature_c_max']}C",
                _cell(samples.get("sm_clock_mhz_median"), 0),
                ",".join(throttle) or "-",
                (verdict or "ok") + (" TIMED OUT" if entry.get("timed_out") else ""),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines += [f"straggler: {line}" for line in report["stragglers"]]
    lines += [f"link: {line}" for line in report["link_flags"]]
    lines += [f"timed out (figures partial): {name}" for name in report["timed_out"]]
    count, percent = len(report["gpus"]), f"{report['threshold'] * 100:.0f}%"
    if report["passed"]:
        lines.append(f"{count} GPU(s) within {percent} of their peers' median, copies as their links allow")
    else:
        lines.append(
            f"{len(report['stragglers'])} straggler(s) and {len(report['link_flags'])} copy flag(s) among "
            f"{count} GPU(s) (threshold {percent} below the median of the same model)"
        )
    return lines
