"""PCIe topology of NVIDIA GPUs, read from sysfs (works before any driver is installed).

Plain standard-library Python with no imports from the rest of the collection: `roles/probe/files/gpu-probe`
imports it from the node package (budgetgpu_node) on a node without Ansible.

How links are found: `<root>/bus/pci/devices/<bdf>` links to `<root>/devices/pci<dom>:<bus>/...`;
the PCI functions in that path, root first, are the bridges above the GPU. A root port (a
bridge on the root bus) and every switch downstream port face down, a switch upstream port
and the GPU face up, so the path alternates: root port, (upstream, downstream)*, GPU. Each
pair (down-facing port, up-facing function) is one physical link; both ends report the same
trained speed and width, each end its own maximum. A path that does not alternate like this
(a bridge modelled alone) is read as one link per adjacent pair.
"""

from __future__ import annotations

import os
import re
from typing import Any

NVIDIA_VENDOR = 0x10DE
PCI_BRIDGE_CLASS = 0x0604
_BDF = re.compile(r"^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
_SPEED = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*GT/s")
_GEN_BY_GTS = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6, 128.0: 7}
# Usable GB/s per lane and direction, after line coding (8b/10b to gen2, 128b/130b from gen3).
_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563, 7: 15.125}

# Names for common device ids; anything else is shown by id (sysfs has no marketing names).
GPU_NAMES = {
    0x2204: "GeForce RTX 3090",
    0x2203: "GeForce RTX 3090 Ti",
    0x2206: "GeForce RTX 3080",
    0x2684: "GeForce RTX 4090",
    0x2704: "GeForce RTX 4080",
    0x2B85: "GeForce RTX 5090",
    0x1E07: "GeForce RTX 2080 Ti",
    0x2230: "RTX A6000",
    0x26B1: "RTX 6000 Ada",
    0x20B0: "A100 SXM4 40GB",
    0x20B2: "A100 SXM4 80GB",
    0x20B5: "A100 PCIe 80GB",
    0x2330: "H100 SXM5 80GB",
    0x2331: "H100 PCIe",
    0x2335: "H200",
    0x26B5: "L40",
    0x27B8: "L4",
}


def parse_speed(text: str | None) -> tuple[int | None, float | None]:
    """Return (generation, GT/s) for a sysfs link speed such as "32.0 GT/s PCIe" or "8 GT/s".

    "Unknown", "" or an unlisted rate give None for what cannot be known.
    """
    match = _SPEED.match(text or "")
    if not match:
        return None, None
    gts = float(match.group(1))
    return _GEN_BY_GTS.get(gts), gts


def parse_width(text: str | None) -> int | None:
    """Return a link width in lanes ("16", "x16"), or None when sysfs gives none."""
    value = (text or "").strip().lower().lstrip("x")
    return int(value) if value.isdigit() else None


def lane_bandwidth_gbps(gen: int | None, width: int | None) -> float | None:
    """Return usable GB/s in one direction for a link of this generation and width."""
    if gen is None or width is None:
        return None
    return round(_LANE_GBPS.get(gen, 0.0) * width, 3)


def _read(path: str) -> str | None:
    # os.open/os.read: a sysfs attribute is one small read, and the probe makes a few hundred.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.read(fd, 4096).decode("ascii", "replace").strip()
    except OSError:
        return None
    finally:
        os.close(fd)


def _hex(text: str | None) -> int | None:
    try:
        return int(text, 16) if text else None
    except ValueError:
        return None


def _resolve_device_dir(sysfs_root: str, link: str) -> str | None:
    """Return the real device directory that bus/pci/devices/<bdf> points to, inside sysfs_root.

    Targets are relative on a live system; absolute ones (a copied tree) are re-rooted.
    """
    try:
        target = os.readlink(link)
    except OSError:
        return link if os.path.isdir(link) else None
    if os.path.isabs(target):
        marker = target.find("/devices/")
        if marker < 0:
            return None
        return os.path.join(sysfs_root, target[marker + 1 :])
    return os.path.normpath(os.path.join(os.path.dirname(link), target))


def read_function(device_dir: str) -> dict[str, Any]:
    """Return one PCI function's identity and link attributes."""

    def attr(name: str) -> str | None:
        return _read(os.path.join(device_dir, name))

    cur_gen, cur_gts = parse_speed(attr("current_link_speed"))
    max_gen, max_gts = parse_speed(attr("max_link_speed"))
    class_code = _hex(attr("class"))
    vendor = _hex(attr("vendor"))
    device = _hex(attr("device"))
    return {
        "bus_id": os.path.basename(device_dir).lower(),
        "vendor_id": None if vendor is None else f"0x{vendor:04x}",
        "device_id": None if device is None else f"0x{device:04x}",
        "class": None if class_code is None else f"0x{class_code:06x}",
        "is_bridge": class_code is not None and class_code >> 8 == PCI_BRIDGE_CLASS,
        "link": {
            "current_gen": cur_gen,
            "current_speed_gts": cur_gts,
            "current_width": parse_width(attr("current_link_width")),
            "max_gen": max_gen,
            "max_speed_gts": max_gts,
            "max_width": parse_width(attr("max_link_width")),
        },
    }


def _is_nvidia_gpu(device_dir: str) -> bool:
    if _hex(_read(os.path.join(device_dir, "vendor"))) != NVIDIA_VENDOR:
        return False
    class_code = _hex(_read(os.path.join(device_dir, "class")))
    # Base class 0x03 is a display controller (VGA 0x0300, 3D 0x0302); the HDMI audio (0x0403)
    # and USB-C (0x0c03, 0x0c80) functions of consumer cards are not GPUs.
    return class_code is not None and class_code >> 16 == 0x03


def _ancestor_dirs(sysfs_root: str, device_dir: str) -> list[str]:
    """Return the PCI function directories above device_dir, root first."""
    devices = os.path.join(sysfs_root, "devices")
    relative = os.path.relpath(device_dir, devices).split(os.sep)
    dirs = []
    current = devices
    for part in relative[:-1]:
        current = os.path.join(current, part)
        if _BDF.match(part):
            dirs.append(current)
    return dirs


def _link_ends(path: list[dict[str, Any]]) -> list[tuple[dict[str, Any] | None, dict[str, Any]]]:
    """Return (down-facing port or None, up-facing function) for every link on the path."""
    gpu_index = len(path) - 1
    if gpu_index == 0 or not path[0]["is_bridge"]:
        # The GPU sits on a root bus (a VM, an integrated endpoint): the port above is not visible.
        return [(None, path[-1])]
    # Root port at 0, then (switch upstream, switch downstream) pairs: the GPU lands on an odd index.
    if gpu_index % 2 == 1 and all(hop["is_bridge"] for hop in path[:-1]):
        for index, hop in enumerate(path[:-1]):
            hop["role"] = "root_port" if index == 0 else ("switch_upstream" if index % 2 else "switch_downstream")
        return [(path[i], path[i + 1]) for i in range(0, gpu_index, 2)]
    for index, hop in enumerate(path[:-1]):
        hop["role"] = "root_port" if index == 0 else "bridge"
    return [(path[i], path[i + 1]) for i in range(gpu_index)]


def _min_known(*values: int | None) -> int | None:
    known = [value for value in values if value is not None]
    return min(known) if known else None


def _below(current: int | None, capable: int | None) -> bool:
    return current is not None and capable is not None and current < capable


def describe_link(port: dict[str, Any] | None, function: dict[str, Any], gpu_link: bool) -> dict[str, Any]:
    """Return one link: what it trained at, what both ends support, and whether it fell short."""
    own = function["link"]
    other = port["link"] if port else {}
    width = own["current_width"] if own["current_width"] is not None else other.get("current_width")
    gen = own["current_gen"] if own["current_gen"] is not None else other.get("current_gen")
    capable_width = _min_known(own["max_width"], other.get("max_width"))
    capable_gen = _min_known(own["max_gen"], other.get("max_gen"))
    where = f"{port['bus_id']} -> {function['bus_id']}" if port else function["bus_id"]
    reasons = []
    if port is not None and width == 0:
        reasons.append(f"link {where} is down (width 0)")
    elif port is not None and _below(width, capable_width):
        reasons.append(
            f"link {where} trained at x{width} but both ends support x{capable_width}: "
            "reseat the card or riser, check the riser cable and the slot"
        )
    # GPUs lower their own link's generation when idle; any other link should run at its best.
    if port is not None and not gpu_link and _below(gen, capable_gen):
        reasons.append(
            f"link {where} trained at gen{gen} but both ends support gen{capable_gen}: "
            "check the riser or switch, and the slot's PCIe speed setting in the BIOS"
        )
    return {
        "upstream": port["bus_id"] if port else None,
        "downstream": function["bus_id"],
        "gen": gen,
        "width": width,
        "capable_gen": capable_gen,
        "capable_width": capable_width,
        "bandwidth_gbps": lane_bandwidth_gbps(gen, width),
        "downgraded": bool(reasons),
        "reasons": reasons,
    }


def _limiting(links: list[dict[str, Any]]) -> dict[str, Any]:
    """Return the link with the least bandwidth (the one nearest the GPU on a tie)."""

    def key(link: dict[str, Any]) -> float:
        bandwidth = link["bandwidth_gbps"]
        return float("inf") if bandwidth is None else bandwidth

    return min(reversed(links), key=key)


def describe_gpu(sysfs_root: str, device_dir: str, cache: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Return one GPU's PCIe facts: its path from the root port, links, effective link, verdicts.

    cache maps device directories to read_function results, so that GPUs behind one switch
    read the switch once.
    """
    cache = {} if cache is None else cache

    def function_at(directory: str) -> dict[str, Any]:
        if directory not in cache:
            cache[directory] = read_function(directory)
        return dict(cache[directory])

    gpu = function_at(device_dir)
    path = [function_at(d) for d in _ancestor_dirs(sysfs_root, device_dir)] + [gpu]
    gpu["role"] = "gpu"
    ends = _link_ends(path)
    links = [describe_link(port, function, function is gpu) for port, function in ends]
    gen_now = _min_known(*(link["gen"] for link in links))
    width_now = _min_known(*(link["width"] for link in links))
    gen_capable = _min_known(*(link["capable_gen"] for link in links))
    width_capable = _min_known(*(link["capable_width"] for link in links))
    limiting = _limiting(links)
    device_id = _hex(gpu["device_id"])
    numa = _read(os.path.join(device_dir, "numa_node"))
    numa_node = int(numa) if numa and numa.lstrip("-").isdigit() and int(numa) >= 0 else None
    reasons = [reason for link in links for reason in link["reasons"]]
    return {
        "bus_id": gpu["bus_id"],
        "vendor_id": gpu["vendor_id"],
        "device_id": gpu["device_id"],
        "name": GPU_NAMES.get(device_id or -1, f"NVIDIA device {gpu['device_id']}"),
        "class": gpu["class"],
        "link": gpu["link"],
        "path": [
            {key: hop[key] for key in ("bus_id", "role", "vendor_id", "device_id", "class", "link")} for hop in path
        ],
        "links": links,
        "effective": {
            "gen": gen_now,
            "width": width_now,
            "bandwidth_gbps": lane_bandwidth_gbps(gen_now, width_now),
        },
        "capable": {
            "gen": gen_capable,
            "width": width_capable,
            "bandwidth_gbps": lane_bandwidth_gbps(gen_capable, width_capable),
        },
        "limiting_hop": limiting["upstream"] or limiting["downstream"],
        "downgraded": bool(reasons),
        "downgrade_reasons": reasons,
        "gen_below_max": _below(gen_now, gen_capable),
        "width_below_max": _below(width_now, width_capable),
        "numa_node": numa_node,
        "local_cpus": _read(os.path.join(device_dir, "local_cpulist")),
    }


def gpu_device_dirs(sysfs_root: str) -> list[str]:
    """Return the device directories of all NVIDIA GPU functions, in bus id order."""
    bus = os.path.join(sysfs_root, "bus", "pci", "devices")
    try:
        names = sorted(os.listdir(bus))
    except OSError:
        return []
    dirs = []
    for name in names:
        device_dir = _resolve_device_dir(sysfs_root, os.path.join(bus, name))
        if device_dir and _is_nvidia_gpu(device_dir):
            dirs.append(device_dir)
    return dirs


def probe_pcie(sysfs_root: str = "/sys") -> dict[str, Any]:
    """Return {count, gpus} for every NVIDIA GPU under sysfs_root."""
    cache: dict[str, dict[str, Any]] = {}
    gpus = [describe_gpu(sysfs_root, d, cache) for d in gpu_device_dirs(sysfs_root)]
    return {"sysfs_root": sysfs_root, "count": len(gpus), "gpus": gpus}


def _fmt_link(gen: int | None, width: int | None) -> str:
    return f"gen{gen if gen is not None else '?'} x{width if width is not None else '?'}"


# What to check when a GPU misses the inventory's expectation (pcie_facts and preflight say the same).
_HINTS = {
    "present": "check the card, its power and riser",
    "width": "reseat the card or riser, check the riser cable and that the slot is wired for that width",
    "gen": "check the riser (many only hold gen1-3) and the slot speed in the BIOS",
}


def _gpu_findings(gpu: dict[str, Any], min_width: int | None, want: dict[str, Any]) -> list[dict[str, Any]]:
    bus_id = gpu.get("bus_id")
    eff = gpu.get("effective") or {}
    now = _fmt_link(eff.get("gen"), eff.get("width"))
    hop = gpu.get("limiting_hop")
    where = f" (limiting hop {hop})" if hop not in (None, bus_id) else ""
    findings = []
    floors = [width for width in (min_width, want.get("width")) if width]
    if floors and (eff.get("width") is None or eff["width"] < max(floors)):
        findings.append(
            {"bus_id": bus_id, "check": "width", "found": now + where, "expected": f"x{max(floors)} or wider"}
        )
    gen_floor = want.get("gen")
    # The GPU's own link drops its generation at idle: count it at what both its ends support, and
    # every link above it at the generation it trained at.
    links = gpu.get("links") or []
    reachable = _min_known((gpu.get("capable") or {}).get("gen"), *(link.get("gen") for link in links[:-1]))
    if gen_floor and (reachable is None or reachable < gen_floor):
        found = f"gen{reachable} (now {now}){where}"
        findings.append({"bus_id": bus_id, "check": "gen", "found": found, "expected": f"gen{gen_floor}"})
    return findings


def expectation_findings(
    facts: dict[str, Any], min_width: int | None = None, expected: dict[str, dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Return every miss of the expected PCIe links, as {bus_id, check, found, expected, hint}; check is
    "present" (an expected GPU is not on the bus), "width" or "gen". The one PCIe rule: the pcie_facts
    module and preflight both use it. expected is keyed by bus id in any form normalize_bus_id takes."""
    want = {normalize_bus_id(str(bus_id)): value for bus_id, value in (expected or {}).items()}
    gpus = {gpu.get("bus_id"): gpu for gpu in facts.get("gpus") or []}
    findings = [
        {"bus_id": bus_id, "check": "present", "found": "not on the PCI bus", "expected": "a GPU"}
        for bus_id in sorted(set(want) - set(gpus))
    ]
    for bus_id, gpu in sorted(gpus.items(), key=lambda item: str(item[0])):
        findings += _gpu_findings(gpu, min_width, want.get(bus_id) or {})
    return [{**finding, "hint": _HINTS[finding["check"]]} for finding in findings]


def check_expectations(
    facts: dict[str, Any], host: str, min_width: int | None = None, expected: dict[str, dict[str, int]] | None = None
) -> list[str]:
    """Return one message per GPU that misses its expected width/generation (empty when all meet them)."""
    templates = {
        "present": "{host}: GPU {bus_id} is expected but not on the PCI bus: {hint}",
        "width": "{host}: GPU {bus_id} runs PCIe {found}, expected {expected}: {hint}",
        "gen": "{host}: GPU {bus_id} can reach at best PCIe {found}, expected {expected}: {hint}",
    }
    return [
        templates[finding["check"]].format(host=host, **finding)
        for finding in expectation_findings(facts, min_width, expected)
    ]


def normalize_bus_id(bus_id: str) -> str:
    """Return a bus id in sysfs form ("0000:01:00.0") from NVML's "00000000:01:00.0", a short "01:00.0" or
    an Xid line's "0000:01:00" without a function, which is function 0 (the one rule for bus ids: the
    pcie_facts module, preflight, the power caps and the health watch use it)."""
    text = bus_id.strip().lower()
    parts = text.split(":")
    if len(parts) == 2:
        parts.insert(0, "0000")
    if len(parts) != 3:
        return text
    try:
        # At least 4 hex digits as sysfs writes them; more where the domain needs them (Intel
        # VMD puts its devices in domains from 0x10000 on: "10000:e1:00.0"), never cut.
        domain = format(int(parts[0], 16), "04x")
    except ValueError:
        return text
    device = parts[2] if "." in parts[2] else f"{parts[2]}.0"
    return f"{domain}:{parts[1]}:{device}"


def is_bus_id(text: str) -> bool:
    """Return whether text is a PCI bus id in one of the forms normalize_bus_id takes."""
    return _BDF.match(normalize_bus_id(text)) is not None
