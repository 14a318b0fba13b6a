"""Energy and what it costs: kWh from NVML's total-energy counter or from power samples, the CPU's
energy from RAPL, the rest of the node as an estimate, at a price.

Plain standard-library Python with no imports from the rest of the collection (roles/probe/files/gpu-probe
and the RAPL reader, roles/node_exporter/files/budgetgpu-rapl, import it from the node package). The one
place for the arithmetic: the provisioning summary (filter gpu_energy_summary), the nightly
summary (energy_reading, energy_per_day), a job's status (job_run_energy) and gpu-probe call it.

A node's energy is its GPUs (NVML's counters, measured), its CPU (RAPL's counters, measured where
the RAPL reader runs) and the rest (board, RAM, disks, NIC, fans, PSU losses), estimated from
budgetgpu_node_base_watts: what the node draws beside its GPUs, the guide's 1.6 kW less 4 x 350 W
= 200 W by default. The CPU is part of that estimate: where RAPL measures it, the rest is the
estimate less the CPU's measured draw (never below 0), so a measured CPU refines the figure rather
than adding to it. The guide's figures are its unit test: one node of four 3090s at 350 W plus
200 W for 24 h at $0.12/kWh is 38.4 kWh, $4.608 (the guide's "$4.60/day").
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

JOULES_PER_KWH = 3_600_000
# The guide's price (budgetgpu_electricity_price_per_kwh) and how it writes money (budgetgpu_currency).
DEFAULT_PRICE_PER_KWH = 0.12
DEFAULT_CURRENCY = "$"
# What a node draws beside its GPUs, an estimate (budgetgpu_node_base_watts): the guide's "Four 3090s
# at 350W each plus system overhead equals about 1.6KW", 1600 W - 4 x 350 W.
DEFAULT_NODE_BASE_WATTS = 200.0
POWERCAP_ROOT = "/sys/class/powercap"
# The RAPL reader's state (role node_exporter's budgetgpu-rapl, root's StateDirectory): the CPU's joules
# that a job's start record and the nightly reading take (cpu_reading).
RAPL_STATE_FILE = "/var/lib/budgetgpu/rapl/energy.json"
# RAPL's zones in sysfs: intel-rapl:<package> (name package-N, or psys, the whole platform, which
# holds the packages: left out) and its subzones intel-rapl:<package>:<n> (core and uncore lie inside
# the package's count: left out; dram does not: counted).
_RAPL_ZONE = re.compile(r"^intel-rapl:\d+(:\d+)?$")


def kwh_from_joules(joules: float) -> float:
    """Return kWh from joules (NVML's counter is in millijoules: divide by 1000 first)."""
    return joules / JOULES_PER_KWH


def kwh_from_power(watts: float, hours: float) -> float:
    """Return the kWh of a steady draw: 1600 W for 24 h is 38.4 kWh."""
    return watts * hours / 1000


def kwh_from_samples(samples: Iterable[tuple[float, float]]) -> float:
    """Return kWh from (seconds, watts) power samples, by the trapezoid rule between samples.

    For cards without the energy counter (older than Volta): the draw is read at intervals and
    integrated; fewer than two samples give 0.
    """
    points = sorted(samples)
    joules = sum((t1 - t0) * (w0 + w1) / 2 for (t0, w0), (t1, w1) in zip(points, points[1:], strict=False))
    return kwh_from_joules(joules)


def cost(kwh: float, price_per_kwh: float) -> float:
    """Return what kwh costs at price_per_kwh, unrounded (round only when it is shown)."""
    return kwh * price_per_kwh


def format_money(amount: float, currency: str = DEFAULT_CURRENCY) -> str:
    """Return "$4.61" for a symbol, "4.61 EUR" for a code: to the cent, thousands separated."""
    text = f"{amount:,.2f}"
    return f"{currency}{text}" if len(currency) == 1 else f"{text} {currency}"


def gpu_kwh(gpu: Mapping[str, Any]) -> float | None:
    """Return a GPU's kWh since the driver loaded, from gpu_facts' energy_total_j; None without a counter."""
    joules = gpu.get("energy_total_j")
    if isinstance(joules, bool) or not isinstance(joules, int | float):
        return None
    return kwh_from_joules(joules)


def energy_summary(
    gpus: Iterable[Mapping[str, Any]],
    price_per_kwh: float = DEFAULT_PRICE_PER_KWH,
    currency: str = DEFAULT_CURRENCY,
) -> str:
    """Return one line: each GPU's kWh since the driver loaded, their total and its cost."""
    parts, total, without = [], 0.0, []
    for gpu in gpus:
        kwh = gpu_kwh(gpu)
        if kwh is None:
            without.append(str(gpu.get("index", "?")))
            continue
        total += kwh
        parts.append(f"GPU {gpu.get('index', '?')} {kwh:.2f} kWh")
    if not parts:
        return "energy: no GPU with an energy counter"
    price = format_money(price_per_kwh, currency)
    line = f"energy since the driver loaded: {', '.join(parts)}; {total:.2f} kWh = "
    line += f"{format_money(cost(total, price_per_kwh), currency)} at {price}/kWh"
    if without:
        line += f" (no counter on GPU {', '.join(without)}: older than Volta)"
    return line


def _job_gpu_joules(recorded: Mapping[str, Any], gpus_now: Iterable[Mapping[str, Any]]) -> tuple[float, int, list[str]]:
    """(joules, GPUs counted, GPUs left out) of the GPUs' counters now against those at the job's start."""
    total_j, counted, skipped = 0.0, 0, []
    for gpu in gpus_now:
        uuid, now = gpu.get("uuid"), gpu.get("energy_total_j")
        then = recorded.get(uuid)
        if isinstance(now, bool) or not isinstance(now, int | float) or not isinstance(then, int | float) or now < then:
            skipped.append(str(gpu.get("index", uuid)))
            continue
        total_j += now - then
        counted += 1
    return total_j, counted, skipped


def _job_rest(
    start: Mapping[str, Any], now: float | None, base_watts: float | None, cpu_now: Any
) -> tuple[float, float | None, str]:
    """(rest kWh, CPU kWh or None, the words) of the node beside its GPUs since the job's start: the CPU
    by RAPL where the start record and the reader's state now both have it, the rest estimated."""
    started = start.get("time")
    if now is None or not _finite(started) or now <= started:
        return 0.0, None, ""
    hours = (now - started) / 3600
    # The start record holds {"time", "joules"} as cpu_reading returns them; now, the reader's state.
    cpu_then, cpu_after = start.get("cpu"), cpu_reading(cpu_now)
    then_j = cpu_then.get("joules") if isinstance(cpu_then, Mapping) else None
    cpu_kwh = None
    if cpu_after and _finite(then_j) and cpu_after["joules"] >= then_j:
        cpu_kwh = kwh_from_joules(cpu_after["joules"] - then_j)
    rest_kwh, why = rest_of_node(base_watts_of(base_watts), hours, cpu_kwh)
    cpu_part = f"; CPU {cpu_kwh:.3f} kWh measured by RAPL" if cpu_kwh is not None else ""
    return rest_kwh, cpu_kwh, f"{cpu_part}; {why}: {rest_kwh:.3f} kWh over {hours:.1f} h"


def job_run_energy(
    start: Mapping[str, Any] | None,
    gpus_now: Iterable[Mapping[str, Any]],
    price_per_kwh: float = DEFAULT_PRICE_PER_KWH,
    currency: str = DEFAULT_CURRENCY,
    now: float | None = None,
    base_watts: float | None = None,
    cpu_now: Any = None,
) -> dict[str, Any]:
    """Return the energy a job run used on a node: each GPU's counter now (gpu_facts' gpus, with
    uuid and energy_total_j) against the counters recorded when the job's unit started (start:
    {"time": epoch s, "gpus": {uuid: joules}, "cpu": {"time", "joules"} (optional)}, written by
    root's budgetgpu-job-record at each start), and, given now (epoch s), the rest of the node over the run's hours
    (rest_of_node: budgetgpu_node_base_watts, less the CPU where RAPL measured it at the start and
    now, cpu_now being the RAPL reader's state).

    All its GPUs, not the job's share: the node's GPUs are the job's while it runs. A GPU whose
    counter went back (the driver reloaded since) or that has no counter is left out and named.
    Returns {"kwh" (the node's), "gpu_kwh", "cpu_kwh", "rest_kwh", "cost", "gpus" (counted), "line"};
    kwh and cost are None without a start record.
    """
    recorded = (start or {}).get("gpus") if isinstance(start, Mapping) else None
    if not isinstance(recorded, Mapping):
        return {"kwh": None, "cost": None, "gpus": 0, "line": "energy: no counters recorded at the job's start"}
    total_j, counted, skipped = _job_gpu_joules(recorded, gpus_now)
    if not counted:
        return {
            "kwh": None,
            "cost": None,
            "gpus": 0,
            "line": "energy: no GPU with an energy counter since the job's start",
        }
    gpu_kwh = kwh_from_joules(total_j)
    rest_kwh, cpu_kwh, rest_words = _job_rest(start, now, base_watts, cpu_now)
    kwh = gpu_kwh + (cpu_kwh or 0.0) + rest_kwh
    amount = cost(kwh, price_per_kwh)
    gpus = f"{counted} GPU{'s' if counted != 1 else ''}"
    head = f"{kwh:.3f} kWh (GPUs {gpu_kwh:.3f} kWh on {gpus}{rest_words})" if rest_words else f"{kwh:.3f} kWh on {gpus}"
    line = (
        f"energy since the job started: {head} = "
        f"{format_money(amount, currency)} at {format_money(price_per_kwh, currency)}/kWh"
    )
    if skipped:
        line += f" (not counted: GPU {', '.join(skipped)})"
    return {
        "kwh": kwh,
        "gpu_kwh": gpu_kwh,
        "cpu_kwh": cpu_kwh,
        "rest_kwh": rest_kwh,
        "cost": amount,
        "gpus": counted,
        "line": line,
    }


def energy_reading(
    gpus: Mapping[str, Any] | None,
    now: float,
    price_per_kwh: float | None = None,
    currency: str | None = None,
    cpu: Any = None,
    base_watts: float | None = None,
) -> dict[str, Any]:
    """Return a node's energy reading for the nightly report: {"time": now (epoch s), "gpus": {uuid: joules}
    (NVML's counters, gpu_facts' energy_total_j; GPUs without one left out), "cpu": {"time", "joules"} (the
    RAPL reader's state, cpu_reading; None without RAPL), "base_watts" (budgetgpu_node_base_watts),
    "price_per_kwh", "currency"}. The provisioning summary sets it as a fact each run; the drift report
    keeps it, so the next nightly run compares its own against it (energy_per_day)."""
    counters = {}
    for gpu in (gpus or {}).get("gpus") or []:
        joules = gpu.get("energy_total_j")
        if gpu.get("uuid") and not isinstance(joules, bool) and isinstance(joules, int | float):
            counters[str(gpu["uuid"])] = joules
    return {
        "time": round(float(now), 3),
        "gpus": counters,
        "cpu": cpu_reading(cpu),
        "base_watts": base_watts_of(base_watts),
        "price_per_kwh": DEFAULT_PRICE_PER_KWH if price_per_kwh is None else float(price_per_kwh),
        "currency": currency or DEFAULT_CURRENCY,
    }


def _gpu_growth(previous: Mapping[str, Any], current: Mapping[str, Any]) -> tuple[float, int, list[str]]:
    """(joules, GPUs counted, GPUs left out) between two readings' GPU counters."""
    total_j, counted, skipped = 0.0, 0, []
    for uuid, now in sorted(current["gpus"].items()):
        then = previous["gpus"].get(uuid)
        if not isinstance(then, int | float) or isinstance(then, bool) or now < then:
            skipped.append(uuid)
            continue
        total_j += now - then
        counted += 1
    return total_j, counted, skipped


def _cpu_kwh_per_day(previous: Mapping[str, Any], current: Mapping[str, Any]) -> float | None:
    """The CPU's kWh a day between two readings' RAPL totals (each with its own time), or None."""
    then, now = previous.get("cpu"), current.get("cpu")
    if not (isinstance(then, Mapping) and isinstance(now, Mapping)):
        return None
    hours = (now["time"] - then["time"]) / 3600
    if hours <= 0 or now["joules"] < then["joules"]:
        return None
    return kwh_from_joules(now["joules"] - then["joules"]) * 24 / hours


def energy_per_day(previous: Mapping[str, Any] | None, current: Mapping[str, Any] | None) -> dict[str, Any]:
    """Return the node's energy per day between two readings (energy_reading) of nightly runs: the GPUs'
    counters' growth since the previous reading, scaled to 24 hours by the time between the readings
    (a run that started late, or a night skipped, still gives a day's figure), the CPU's by RAPL where
    both readings have it, the rest of the node estimated (rest_of_node), and its cost at the current
    reading's price. A GPU whose counter went back (the driver reloaded: a reboot) or that one reading
    lacks is left out and named.

    Returns {"kwh" (the GPUs' over the interval), "hours", "gpu_kwh_per_day", "cpu_kwh_per_day" (None
    without RAPL), "rest_kwh_per_day", "kwh_per_day" (their sum), "cost_per_day", "gpus" (counted),
    "line"}; the numbers are None when there is nothing to compare (no earlier reading, no GPU counted,
    no time between)."""
    none = {"kwh": None, "hours": None, "kwh_per_day": None, "cost_per_day": None, "gpus": 0}
    if not isinstance(current, Mapping) or not isinstance(current.get("gpus"), Mapping):
        return {**none, "line": "energy: no reading in this run (no GPU facts)"}
    if not isinstance(previous, Mapping) or not isinstance(previous.get("gpus"), Mapping):
        return {**none, "line": "energy: no reading of an earlier nightly run yet (the next one shows kWh a day)"}
    hours = (float(current.get("time") or 0) - float(previous.get("time") or 0)) / 3600
    if hours <= 0:
        return {**none, "line": "energy: the earlier reading is not older than this one"}
    total_j, counted, skipped = _gpu_growth(previous, current)
    if not counted:
        return {**none, "hours": hours, "line": "energy: no GPU counter to compare with the earlier reading"}
    price = float(current.get("price_per_kwh", DEFAULT_PRICE_PER_KWH))
    currency = str(current.get("currency") or DEFAULT_CURRENCY)
    kwh = kwh_from_joules(total_j)
    gpu_day = kwh * 24 / hours
    cpu_day = _cpu_kwh_per_day(previous, current)
    rest_day, rest_why = rest_of_node(base_watts_of(current.get("base_watts")), 24, cpu_day)
    per_day = gpu_day + (cpu_day or 0.0) + rest_day
    amount = cost(per_day, price)
    cpu_part = f"CPU {cpu_day:.2f} kWh measured by RAPL; " if cpu_day is not None else ""
    line = (
        f"energy: {per_day:.2f} kWh a day = {format_money(amount, currency)} a day at "
        f"{format_money(price, currency)}/kWh (GPUs {gpu_day:.2f} kWh: {kwh:.2f} kWh measured on {counted} "
        f"GPU{'s' if counted != 1 else ''} over {hours:.1f} h since the last nightly run; {cpu_part}"
        f"{rest_why}: {rest_day:.2f} kWh)"
    )
    if skipped:
        line += f" (not counted, counter reset or missing: {', '.join(skipped)})"
    return {
        "kwh": kwh,
        "hours": hours,
        "gpu_kwh_per_day": gpu_day,
        "cpu_kwh_per_day": cpu_day,
        "rest_kwh_per_day": rest_day,
        "kwh_per_day": per_day,
        "cost_per_day": amount,
        "gpus": counted,
        "line": line,
    }


# --- the CPU's energy from RAPL (the RAPL reader, a root oneshot: energy_uj is root-only) ------------


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as stream:
            return int(stream.read(64).strip())
    except (OSError, ValueError):
        return None


def rapl_zones(root: str = POWERCAP_ROOT) -> dict[str, dict[str, Any]]:
    """Return the RAPL zones that count the CPU's energy once, {sysfs name: {"zone": "package-0",
    "energy_uj", "max_energy_range_uj"}}: each package (not psys, which holds them) and each package's
    dram subzone (not core or uncore, which the package holds). {} without RAPL (a VM, an ARM board)."""
    try:
        names = sorted(name for name in os.listdir(root) if _RAPL_ZONE.match(name))
    except OSError:
        return {}
    zones = {}
    for name in names:
        directory = os.path.join(root, name)
        try:
            with open(os.path.join(directory, "name"), encoding="ascii") as stream:
                label = stream.read(64).strip()
        except OSError:
            continue
        subzone = name.count(":") == 2
        if (subzone and label != "dram") or (not subzone and not label.startswith("package")):
            continue
        energy, top = (
            _read_int(os.path.join(directory, "energy_uj")),
            _read_int(os.path.join(directory, "max_energy_range_uj")),
        )
        if energy is None or top is None or top <= 0:
            continue
        package = name.split(":")[1]
        zones[name] = {
            "zone": label if not subzone else f"dram-{package}",
            "energy_uj": energy,
            "max_energy_range_uj": top,
        }
    return zones


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def rapl_update(
    state: Mapping[str, Any] | None, zones: Mapping[str, Mapping[str, Any]], now: float, boot_id: str
) -> dict[str, Any]:
    """Return the reader's new state from its last one and the zones read now: each zone's joules since
    the reader first saw it, across the counter's wraps at max_energy_range_uj (a reading lower than the
    last one has wrapped once: the reader runs far more often than a wrap, about an hour at 60 W).
    After a reboot (another boot_id) the counters restart where the hardware is: nothing is added for
    the time the node was down. {"time", "boot_id", "zones": {name: {"zone", "raw_uj", "max_uj",
    "joules"}}, "joules" (their sum)}."""
    before = state.get("zones") if isinstance(state, Mapping) and state.get("boot_id") == boot_id else None
    kept = state.get("zones") if isinstance(state, Mapping) and isinstance(state.get("zones"), Mapping) else {}
    out = {}
    for name, zone in sorted(zones.items()):
        raw, top = zone["energy_uj"], zone["max_energy_range_uj"]
        last = (before or {}).get(name) if isinstance(before, Mapping) else None
        joules = kept.get(name, {}).get("joules", 0.0) if isinstance(kept.get(name), Mapping) else 0.0
        joules = float(joules) if _finite(joules) and joules >= 0 else 0.0
        if isinstance(last, Mapping) and _finite(last.get("raw_uj")):
            step = raw - last["raw_uj"]
            joules += (step if step >= 0 else step + top) / 1e6
        out[name] = {"zone": zone["zone"], "raw_uj": raw, "max_uj": top, "joules": round(joules, 6)}
    return {
        "time": round(float(now), 3),
        "boot_id": boot_id,
        "zones": out,
        "joules": round(sum(z["joules"] for z in out.values()), 6),
    }


# The RAPL reader's metrics, {name: (type, help)}: module_utils/textfile.py writes rapl_samples under them.
RAPL_METRICS = {
    "budgetgpu_node_cpu_energy_joules_total": (
        "counter",
        "CPU energy by RAPL (package, DRAM) since the reader began.",
    ),
    "budgetgpu_node_cpu_energy_zones": (
        "gauge",
        "RAPL zones the reader counts (0: no RAPL, the CPU is in the estimate).",
    ),
    "budgetgpu_node_base_watts": ("gauge", "What the node draws beside its GPUs, CPU included (an estimate)."),
    "budgetgpu_node_cpu_energy_read_timestamp_seconds": ("gauge", "When the RAPL reader last read the counters."),
}


def rapl_samples(state: Mapping[str, Any], base_watts: float) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of the reader's state for node exporter's textfile: the CPU's energy per RAPL
    zone (a counter that never goes back: wraps and reboots are taken out) and the estimate of what the
    node draws beside its GPUs."""
    zones = sorted((state.get("zones") or {}).values(), key=lambda z: z["zone"])
    return [
        *(("budgetgpu_node_cpu_energy_joules_total", {"zone": str(z["zone"])}, float(z["joules"])) for z in zones),
        ("budgetgpu_node_cpu_energy_zones", {}, float(len(zones))),
        ("budgetgpu_node_base_watts", {}, float(base_watts)),
        ("budgetgpu_node_cpu_energy_read_timestamp_seconds", {}, float(state.get("time") or 0)),
    ]


def cpu_reading(state: Any) -> dict[str, float] | None:
    """Return {"time", "joules"} from the RAPL reader's state (energy.json, parsed or as Ansible's slurp
    returns it), or None when it has no zone, is missing, or is not what the reader writes."""
    if isinstance(state, Mapping) and state.get("encoding") == "base64":
        try:
            state = json.loads(base64.b64decode(str(state.get("content") or "")).decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            return None
    if not isinstance(state, Mapping) or not state.get("zones"):
        return None
    time_s, joules = state.get("time"), state.get("joules")
    if not (_finite(time_s) and _finite(joules)) or joules < 0:
        return None
    return {"time": float(time_s), "joules": float(joules)}


def base_watts_of(value: Any) -> float:
    """budgetgpu_node_base_watts as a number: None (unset) is the guide's 200 W."""
    return DEFAULT_NODE_BASE_WATTS if value is None else float(value)


def rest_of_node(base_watts: float, hours: float, cpu_kwh: float | None) -> tuple[float, str]:
    """Return the kWh of the node beside its GPUs and measured CPU over hours, and how it was found:
    the estimate (base_watts) less what RAPL measured of the CPU over the same hours, never below 0."""
    if cpu_kwh is None:
        return kwh_from_power(
            base_watts, hours
        ), f"rest of the node, CPU included, estimated at budgetgpu_node_base_watts {base_watts:g} W (no RAPL reading)"
    cpu_watts = cpu_kwh * 1000 / hours if hours > 0 else 0.0
    rest_watts = max(base_watts - cpu_watts, 0.0)
    why = f"rest of the node estimated at budgetgpu_node_base_watts {base_watts:g} W less the CPU's {cpu_watts:.0f} W"
    if cpu_watts > base_watts:
        why += " (the CPU alone draws more than the estimate: raise budgetgpu_node_base_watts)"
    return kwh_from_power(rest_watts, hours), why
