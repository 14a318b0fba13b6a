"""Energy and what it costs: kWh from NVML's total-energy counter or from power samples, at a price.

Plain standard-library Python with no imports from the rest of the collection (scripts/gpu-probe
loads this file by path). The one place for the arithmetic: the provisioning summary (filter
gpu_energy_summary) and gpu-probe call it. The guide's figures are its unit test: 1.6 kW for 24 h
at $0.12/kWh is $4.61.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

JOULES_PER_KWH = 3_600_000
# The guide's price (budgetgpu_electricity_price_per_kwh) and how it writes money (budgetgpu_currency).
DEFAULT_PRICE_PER_KWH = 0.12
DEFAULT_CURRENCY = "$"


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


def job_run_energy(
    start: Mapping[str, Any] | None,
    gpus_now: Iterable[Mapping[str, Any]],
    price_per_kwh: float = DEFAULT_PRICE_PER_KWH,
    currency: str = DEFAULT_CURRENCY,
) -> dict[str, Any]:
    """Return the energy a job run used on a node: each GPU's counter now (gpu_facts' gpus, with
    uuid and energy_total_j) against the counters recorded when the job's unit started (start:
    {"time": epoch s, "gpus": {uuid: joules}}, written by root's budgetgpu-job-record at each start).

    All its GPUs, not the job's share: the node's GPUs are the job's while it runs. A GPU whose
    counter went back (the driver reloaded since) or that has no counter is left out and named.
    Returns {"kwh", "cost", "gpus" (counted), "line"}; kwh and cost are None without a start record.
    """
    recorded = (start or {}).get("gpus") if isinstance(start, Mapping) else None
    if not isinstance(recorded, Mapping):
        return {"kwh": None, "cost": None, "gpus": 0, "line": "energy: no counters recorded at the job's start"}
    total_j, counted, skipped = 0.0, 0, []
    for gpu in gpus_now:
        uuid, now = gpu.get("uuid"), gpu.get("energy_total_j")
        then = recorded.get(uuid)
        if isinstance(now, bool) or not isinstance(now, int | float) or not isinstance(then, int | float) or now < then:
            skipped.append(str(gpu.get("index", uuid)))
            continue
        total_j += now - then
        counted += 1
    if not counted:
        return {
            "kwh": None,
            "cost": None,
            "gpus": 0,
            "line": "energy: no GPU with an energy counter since the job's start",
        }
    kwh = kwh_from_joules(total_j)
    amount = cost(kwh, price_per_kwh)
    line = (
        f"energy since the job started: {kwh:.3f} kWh on {counted} GPU{'s' if counted != 1 else ''} = "
        f"{format_money(amount, currency)} at {format_money(price_per_kwh, currency)}/kWh"
    )
    if skipped:
        line += f" (not counted: GPU {', '.join(skipped)})"
    return {"kwh": kwh, "cost": amount, "gpus": counted, "line": line}


def energy_reading(
    gpus: Mapping[str, Any] | None,
    now: float,
    price_per_kwh: float | None = None,
    currency: str | None = None,
) -> dict[str, Any]:
    """Return a node's energy reading for the nightly report: {"time": now (epoch s), "gpus": {uuid: joules}
    (NVML's counters, gpu_facts' energy_total_j; GPUs without one left out), "price_per_kwh", "currency"}.
    The provisioning summary sets it as a fact each run; the drift report keeps it, so the next nightly
    run compares its own against it (energy_per_day)."""
    counters = {}
    for gpu in (gpus or {}).get("gpus") or []:
        joules = gpu.get("energy_total_j")
        if gpu.get("uuid") and not isinstance(joules, bool) and isinstance(joules, int | float):
            counters[str(gpu["uuid"])] = joules
    return {
        "time": round(float(now), 3),
        "gpus": counters,
        "price_per_kwh": DEFAULT_PRICE_PER_KWH if price_per_kwh is None else float(price_per_kwh),
        "currency": currency or DEFAULT_CURRENCY,
    }


def energy_per_day(previous: Mapping[str, Any] | None, current: Mapping[str, Any] | None) -> dict[str, Any]:
    """Return the node's energy per day between two readings (energy_reading) of nightly runs: the GPUs'
    counters' growth since the previous reading, scaled to 24 hours by the time between the readings
    (a run that started late, or a night skipped, still gives a day's figure), and its cost at the
    current reading's price. A GPU whose counter went back (the driver reloaded: a reboot) or that one
    reading lacks is left out and named.

    Returns {"kwh", "hours", "kwh_per_day", "cost_per_day", "gpus" (counted), "line"}; the numbers are
    None when there is nothing to compare (no earlier reading, no GPU counted, no time between)."""
    none = {"kwh": None, "hours": None, "kwh_per_day": None, "cost_per_day": None, "gpus": 0}
    if not isinstance(current, Mapping) or not isinstance(current.get("gpus"), Mapping):
        return {**none, "line": "energy: no reading in this run (no GPU facts)"}
    if not isinstance(previous, Mapping) or not isinstance(previous.get("gpus"), Mapping):
        return {**none, "line": "energy: no reading of an earlier nightly run yet (the next one shows kWh a day)"}
    hours = (float(current.get("time") or 0) - float(previous.get("time") or 0)) / 3600
    if hours <= 0:
        return {**none, "line": "energy: the earlier reading is not older than this one"}
    total_j, counted, skipped = 0.0, 0, []
    for uuid, now in sorted(current["gpus"].items()):
        then = previous["gpus"].get(uuid)
        if not isinstance(then, int | float) or isinstance(then, bool) or now < then:
            skipped.append(uuid)
            continue
        total_j += now - then
        counted += 1
    if not counted:
        return {**none, "hours": hours, "line": "energy: no GPU counter to compare with the earlier reading"}
    price = float(current.get("price_per_kwh", DEFAULT_PRICE_PER_KWH))
    currency = str(current.get("currency") or DEFAULT_CURRENCY)
    kwh = kwh_from_joules(total_j)
    per_day = kwh * 24 / hours
    amount = cost(per_day, price)
    line = (
        f"energy: {per_day:.2f} kWh a day = {format_money(amount, currency)} a day at "
        f"{format_money(price, currency)}/kWh ({kwh:.2f} kWh on {counted} GPU{'s' if counted != 1 else ''} "
        f"over {hours:.1f} h since the last nightly run)"
    )
    if skipped:
        line += f" (not counted, counter reset or missing: {', '.join(skipped)})"
    return {"kwh": kwh, "hours": hours, "kwh_per_day": per_day, "cost_per_day": amount, "gpus": counted, "line": line}
