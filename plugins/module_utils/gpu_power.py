"""GPU power limits: which GPU gets which cap, whether the card and the node's budget allow it, and
setting it through NVML.

The one place for these rules: preflight (filter gpu_power_problems, on gpu_facts' answers), the
gpu_power_limits module (role gpu_power) and the boot-time applier roles/gpu_power/files/gpu-power all call
resolve_caps and cap_problems. Plain standard-library Python; the only import from the collection
are pcie's bus id rule and nvml_probe, which roles/gpu_power/files/gpu-power finds beside this file on sys.path.

gpu_power_limit_watts is either watts for every GPU of the node, or a mapping whose keys are
"all" (every GPU), a GPU model as NVML names it ("NVIDIA GeForce RTX 3090"), a GPU UUID
("GPU-..."), or a PCI bus id in any form pcie.normalize_bus_id takes ("01:00.0",
"00000000:01:00.0"). A GPU's own key (UUID or bus id) wins over its model, which wins over "all";
a key that matches no GPU of the node is refused, and so is one GPU named twice with two caps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .nvml_probe import Reader, known, probe_nvml, session
from .pcie import is_bus_id, normalize_bus_id

VARIABLE = "gpu_power_limit_watts"
BUDGET_VARIABLE = "gpu_power_budget_watts"
NODE_WIDE = "all"
# Lower ranks win: a GPU's own key, then its model, then the node-wide value.
_RANK = {"uuid": 0, "bus_id": 0, "model": 1, NODE_WIDE: 2}


def gpu_label(gpu: Mapping[str, Any]) -> str:
    """Return how messages name a GPU: "GPU 1 (GPU-3090..., 0000:02:00.0, NVIDIA GeForce RTX 3090)"."""
    return f"GPU {gpu.get('index', '?')} ({gpu.get('uuid', '?')}, {gpu.get('bus_id', '?')}, {gpu.get('name', '?')})"


def key_kind(key: str) -> str:
    """Return what a cap's key names: "all", "uuid", "bus_id" or "model"."""
    if key == NODE_WIDE:
        return NODE_WIDE
    if key.upper().startswith("GPU-"):
        return "uuid"
    return "bus_id" if is_bus_id(key) else "model"


def _matches(kind: str, key: str, gpu: Mapping[str, Any]) -> bool:
    if kind == NODE_WIDE:
        return True
    if kind == "uuid":
        return str(gpu.get("uuid", "")).lower() == key.lower()
    if kind == "bus_id":
        return normalize_bus_id(str(gpu.get("bus_id", ""))) == normalize_bus_id(key)
    return str(gpu.get("name", "")).lower() == key.strip().lower()


def watts_problem(value: Any) -> str | None:
    """Return why value is not watts (a number above 0), or None."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        return f"expected watts (a number above 0), found {value!r}"
    return None


def caps_shape_ok(caps: Any) -> bool:
    """Return whether caps has the shape of gpu_power_limit_watts (watts, or a mapping to watts), before
    any GPU is known: the inventory check of every host (plugin_utils inputs), driver or not."""
    if caps is None or caps == {}:
        return True
    values = caps.values() if isinstance(caps, Mapping) else [caps]
    return all(watts_problem(value) is None for value in values)


def resolve_caps(gpus: list[Mapping[str, Any]], caps: Any) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """Return ({GPU index: {watts, key}}, problems): the cap each GPU gets, by the module's rule."""
    if caps is None or caps == {}:
        return {}, []
    if not isinstance(caps, Mapping):
        caps = {NODE_WIDE: caps}
    chosen: dict[int, dict[str, Any]] = {}
    problems = []
    names = ", ".join(gpu_label(gpu) for gpu in gpus) or "none"
    for raw_key, watts in caps.items():
        key = str(raw_key)
        kind = key_kind(key)
        wrong = watts_problem(watts)
        if wrong:
            problems.append(f"{VARIABLE}[{key!r}]: {wrong}")
            continue
        matched = [gpu for gpu in gpus if _matches(kind, key, gpu)]
        if not matched and kind != NODE_WIDE:
            what = kind.replace("_", " ")
            # YAML 1.1 reads an unquoted 01:00.0 as the number 60.0 (base 60).
            quote = "" if isinstance(raw_key, str) else " (YAML read this key as a number: quote bus ids)"
            problems.append(f"{VARIABLE}[{key!r}]: this {what} matches no GPU of the node{quote} (GPUs: {names})")
        for gpu in matched:
            index, rank = int(gpu["index"]), _RANK[kind]
            held = chosen.get(index)
            if held is None or rank < held["rank"]:
                chosen[index] = {"watts": watts, "key": key, "rank": rank}
            elif rank == held["rank"] and watts != held["watts"]:
                problems.append(
                    f"{VARIABLE}: {gpu_label(gpu)} is named by {held['key']!r} ({held['watts']} W) and by "
                    f"{key!r} ({watts} W): keep one"
                )
    return {index: {"watts": cap["watts"], "key": cap["key"]} for index, cap in chosen.items()}, problems


def _range_problem(gpu: Mapping[str, Any], cap: Mapping[str, Any]) -> str | None:
    low, high = gpu.get("power_limit_min_w"), gpu.get("power_limit_max_w")
    where = f"{VARIABLE}[{cap['key']!r}]: {gpu_label(gpu)}"
    if watts_problem(low) or watts_problem(high):
        return f"{where}: the card reports no power limit range (NVML: {low}), so its limit cannot be set"
    if not low <= cap["watts"] <= high:
        return (
            f"{where}: {cap['watts']} W is outside the card's range {low:g}-{high:g} W "
            "(NVML power management limit constraints): choose a cap inside it"
        )
    return None


def _budget_problem(gpus: list[Mapping[str, Any]], targets: Mapping[int, Any], budget: Any) -> str | None:
    wrong = watts_problem(budget)
    if wrong:
        return f"{BUDGET_VARIABLE}: {wrong}"
    # A GPU without a cap draws up to its default limit: the one it has again after a reboot.
    draws = [
        (gpu, targets[gpu["index"]]["watts"] if gpu["index"] in targets else gpu.get("power_limit_default_w"))
        for gpu in gpus
    ]
    if any(watts_problem(watts) for _gpu, watts in draws):
        return f"{BUDGET_VARIABLE}: a GPU without a cap reports no default limit, so the sum is unknown: cap every GPU"
    total = sum(watts for _gpu, watts in draws)
    if total <= budget:
        return None
    parts = ", ".join(f"GPU {gpu['index']} {watts:g} W" for gpu, watts in draws)
    return (
        f"{BUDGET_VARIABLE}: the GPUs' limits add up to {total:g} W ({parts}), above the budget {budget:g} W: "
        "lower the caps"
    )


def cap_problems(host: str, gpus: list[Mapping[str, Any]], caps: Any, budget: Any = None) -> list[str]:
    """Return every problem of a node's caps and budget, each naming the host, the GPU, value and range.

    gpus are gpu_facts' entries (index, uuid, bus_id, name, power_limit_min_w/max_w/default_w).
    """
    targets, problems = resolve_caps(gpus, caps)
    for gpu in gpus:
        if gpu["index"] in targets:
            problems.append(_range_problem(gpu, targets[gpu["index"]]))
    if budget is not None:
        problems.append(_budget_problem(gpus, targets, budget))
    return [f"{host}: {problem}" for problem in problems if problem]


class NvmlFailed(Exception):
    """An NVML call of apply_caps failed (or the binding lacks it): nothing after it was set."""


def _read(reader: Reader, what: str, function: str, *args: Any) -> Any:
    value, error = reader.call(function, *args)
    if value is None and error is None:
        return None  # a setter's answer
    if not known(value):
        why = error if error is not None else f"this NVML binding has no {function}"
        raise NvmlFailed(f"{what} ({function}): {why}")
    return value


def apply_caps(nvml: Any, gpus: list[Mapping[str, Any]], caps: Any, check_mode: bool = False) -> list[dict[str, Any]]:
    """Set each GPU's power management limit to its cap where it differs; return what was (or would be)
    changed: [{index, uuid, bus_id, from_w, to_w, line}]. Call it with NVML initialised and the caps
    checked by cap_problems. NvmlFailed says which call failed."""
    targets, _problems = resolve_caps(gpus, caps)
    reader = Reader(nvml)
    changes = []
    for gpu in gpus:
        if gpu["index"] not in targets:
            continue
        label = gpu_label(gpu)
        handle = _read(reader, label, "nvmlDeviceGetHandleByIndex", gpu["index"])
        now_mw = _read(reader, f"{label}: reading the power limit", "nvmlDeviceGetPowerManagementLimit", handle)
        want_mw = round(targets[gpu["index"]]["watts"] * 1000)
        if now_mw == want_mw:
            continue
        if not check_mode:
            _read(reader, f"{label}: setting the power limit", "nvmlDeviceSetPowerManagementLimit", handle, want_mw)
        changes.append(
            {
                "index": gpu["index"],
                "uuid": gpu.get("uuid"),
                "bus_id": gpu.get("bus_id"),
                "from_w": now_mw / 1000,
                "to_w": want_mw / 1000,
                "line": f"{label}: power limit {now_mw / 1000:g} W -> {want_mw / 1000:g} W",
            }
        )
    return changes


def enforce(nvml: Any, host: str, caps: Any, budget: Any = None, check_mode: bool = False) -> dict[str, Any]:
    """Read the GPUs, refuse caps with problems (changing nothing), else set the caps that differ.

    Return {failed, msg, changed, changes, drift}: drift holds a line per GPU whose limit was (or,
    in check mode, would be) corrected, for the nightly drift report.
    """
    if not caps and budget is None:
        return {"failed": False, "changed": False, "msg": "no power caps declared", "changes": [], "drift": []}
    if nvml is None:
        return {"failed": True, "changed": False, "msg": f"{host}: nvidia-ml-py (pynvml) is not installed"}
    facts = probe_nvml(nvml)
    if not facts["driver"]["loaded"]:
        reason = facts["driver"]["reason"]
        return {"failed": True, "changed": False, "msg": f"{host}: no usable NVIDIA driver: {reason}"}
    problems = cap_problems(host, facts["gpus"], caps, budget)
    if problems:
        return {"failed": True, "changed": False, "msg": "; ".join(problems), "problems": problems}
    try:
        with session(nvml):
            changes = apply_caps(nvml, facts["gpus"], caps, check_mode)
    except (NvmlFailed, nvml.NVMLError) as exc:
        return {"failed": True, "changed": False, "msg": f"{host}: setting a power limit through NVML failed: {exc}"}
    return {
        "failed": False,
        "changed": bool(changes),
        "msg": "; ".join(change["line"] for change in changes) or "every power limit as declared",
        "changes": changes,
        "drift": [change["line"] for change in changes],
    }
