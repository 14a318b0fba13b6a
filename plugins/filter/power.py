"""GPU power caps and energy cost, for preflight, role gpu_power and the provisioning summary.

Thin wrappers: the rules live in plugins/module_utils/gpu_power.py (which GPU gets which cap, the
card's range, the node's budget) and plugins/module_utils/energy.py (kWh and cost), which the
gpu_power_limits module, roles/gpu_power/files/gpu-power and roles/probe/files/gpu-probe run on the nodes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.module_utils import energy, gpu_power


def gpu_power_problems(gpus_facts: Mapping[str, Any] | None, host: str, caps: Any, budget: Any = None) -> list[str]:
    """Return the problems of a node's caps and budget against its budgetgpu_gpus facts."""
    if not caps and budget is None:
        return []
    facts = gpus_facts or {}
    # Without a working driver NVML knows no GPU: a fresh node's preflight runs before the driver is
    # installed. Role gpu_power checks again after it, and the boot unit at every boot.
    if not (facts.get("driver") or {}).get("loaded"):
        return []
    return gpu_power.cap_problems(host, facts.get("gpus") or [], caps, budget)


def gpu_energy_summary(gpus_facts: Mapping[str, Any] | None, price: Any = None, currency: Any = None) -> str:
    """Return the node's energy since the driver loaded, per GPU, and what it cost (None: the guide's
    price and currency, energy.DEFAULT_PRICE_PER_KWH and DEFAULT_CURRENCY)."""
    return energy.energy_summary(
        (gpus_facts or {}).get("gpus") or [],
        energy.DEFAULT_PRICE_PER_KWH if price is None else float(price),
        energy.DEFAULT_CURRENCY if currency is None else str(currency),
    )


def gpu_energy_reading(
    gpus_facts: Mapping[str, Any] | None,
    now: Any,
    price: Any = None,
    currency: Any = None,
    cpu: Any = None,
    base_watts: Any = None,
) -> dict[str, Any]:
    """Return the node's energy reading (energy.energy_reading): the time, each GPU's counter, the CPU's
    RAPL total (the reader's energy.json, parsed or as slurp returns it), the node's base watts, the price."""
    return energy.energy_reading(
        gpus_facts,
        float(now),
        None if price is None else float(price),
        currency,
        cpu,
        None if base_watts is None else float(base_watts),
    )


class FilterModule:
    """budgetgpu power and energy filters."""

    def filters(self) -> dict[str, Any]:
        return {
            "gpu_power_problems": gpu_power_problems,
            "gpu_energy_summary": gpu_energy_summary,
            "gpu_energy_reading": gpu_energy_reading,
        }
