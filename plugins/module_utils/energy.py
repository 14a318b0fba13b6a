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
    {"time": epoch s, "gpus": {uuid: joules}}, written by budgetgpu-job-energy).

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
