"""NCCL network decisions: interface, transport and P2P per node, firewall members, comm-test verdict.

Pure functions of the probe facts (`budgetgpu_net`, `budgetgpu_gpus`, `budgetgpu_pcie`) and the
inventory, so that the role, the tests and the report read one decision made in one place.
"""

from __future__ import annotations

import ipaddress
import json
import re
from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.module_utils.netinfo import endpoint

# Interfaces NCCL may carry traffic on, best first. A veth holds the address of a container node;
# a bridge is used only when the cluster address lives on nothing else (a NIC enslaved to br0).
_USABLE_KINDS = ("physical", "bond", "vlan", "infiniband", "virtual", "veth", "bridge")
_NEVER_KINDS = ("loopback", "docker")
_CONSUMER = re.compile(r"\b(GeForce|TITAN)\b", re.IGNORECASE)
_SWITCH_ROLES = ("switch_upstream", "switch_downstream")


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(str(text).split("%")[0])
    except ValueError:
        return None


def _global_addresses(iface: dict[str, Any]) -> list[str]:
    """Return the interface's addresses, IPv4 first, without link-local ones."""
    found = []
    for entry in iface.get("addresses") or []:
        address = _ip(entry.get("address", ""))
        if address is not None and not address.is_link_local and not address.is_loopback:
            found.append(address)
    return [str(a) for a in sorted(found, key=lambda a: a.version)]


def _in_subnet(address: str, subnet: str | None) -> bool:
    if not subnet:
        return False
    network = ipaddress.ip_network(subnet, strict=False)
    ip = _ip(address)
    return ip is not None and ip.version == network.version and ip in network


def _speed_text(iface: dict[str, Any]) -> str:
    speed = iface.get("speed_mbps")
    return f"{speed} Mb/s" if speed else "speed unknown"


def _rank(iface: dict[str, Any]) -> tuple[int, int, int]:
    """Sort key: link up first, then the better kind, then the faster link."""
    carrier_down = 1 if iface.get("carrier") is False or iface.get("operstate") == "down" else 0
    kind = iface.get("kind", "virtual")
    kind_rank = _USABLE_KINDS.index(kind) if kind in _USABLE_KINDS else len(_USABLE_KINDS)
    return (carrier_down, kind_rank, -(iface.get("speed_mbps") or 0))


def _kind_note(iface: dict[str, Any]) -> str:
    kind = iface.get("kind")
    if kind == "veth":
        return ", veth: this node is a container"
    if kind == "bridge":
        return ", a bridge: the only interface with the cluster address"
    return ""


def _match_request(interfaces: list[dict[str, Any]], request: str) -> list[dict[str, Any]]:
    """Return the interfaces an NCCL_SOCKET_IFNAME-style value selects (=exact, ^exclude, prefixes)."""
    request = request.strip()
    # NCCL reads "^" (exclude) first, then "=" (exact names): "^=eth0" leaves out eth0 alone.
    exclude = request.startswith("^")
    request = request[1:] if exclude else request
    exact = request.startswith("=")
    words = tuple(request[1:].split(",") if exact else request.split(","))

    def named(iface: dict[str, Any]) -> bool:
        return iface["name"] in words if exact else iface["name"].startswith(words)

    return [i for i in interfaces if named(i) != exclude]


def _no_interface(error: str) -> dict[str, Any]:
    """select_interface's answer when no interface may carry NCCL: the error says what to fix."""
    return {"interface": None, "address": None, "reason": None, "warnings": [], "errors": [error]}


def select_interface(net: dict[str, Any], subnet: str | None, request: str | None = None) -> dict[str, Any]:
    """Return {interface, address, reason, warnings, errors} for the NCCL socket interface."""
    interfaces = [i for i in net.get("interfaces") or [] if i.get("name")]
    subnet = subnet or net.get("cluster_subnet")
    warnings: list[str] = []
    if request:
        matches = sorted(
            (i for i in _match_request(interfaces, request) if i.get("kind") not in ("loopback",)),
            key=_rank,
        )
        with_address = [i for i in matches if _global_addresses(i)]
        if not with_address:
            names = ", ".join(i["name"] for i in interfaces) or "none"
            return _no_interface(
                f"inventory asks for interface '{request}', but no interface with an address "
                f"matches it (interfaces: {names}): fix nccl_network_interface"
            )
        chosen = with_address[0]
        addresses = _global_addresses(chosen)
        address = next((a for a in addresses if _in_subnet(a, subnet)), addresses[0])
        if subnet and not _in_subnet(address, subnet):
            warnings.append(
                f"{chosen['name']} ({address}) is outside the cluster subnet {subnet}: "
                "peers reach it only if they have a route to it"
            )
        return {
            "interface": chosen,
            "address": address,
            "reason": f"set by inventory (nccl_network_interface={request})",
            "warnings": warnings,
            "errors": [],
        }

    candidates = []
    refused = []
    for iface in interfaces:
        in_subnet = [a for a in _global_addresses(iface) if _in_subnet(a, subnet)]
        if not in_subnet:
            continue
        if iface.get("kind") in _NEVER_KINDS:
            refused.append(f"{iface['name']} ({iface.get('kind')})")
            continue
        candidates.append((iface, in_subnet[0]))
    if subnet and candidates:
        candidates.sort(key=lambda pair: _rank(pair[0]))
        chosen, address = candidates[0]
        reason = f"holds the cluster address {address} in {subnet}{_kind_note(chosen)}"
        others = [f"{i['name']} ({i.get('kind')})" for i, _ in candidates[1:]] + refused
        if others:
            reason += f"; passed over {', '.join(others)}"
        faster = [
            i
            for i in interfaces
            if i.get("kind") in ("physical", "bond")
            and (i.get("speed_mbps") or 0) > (chosen.get("speed_mbps") or 0)
            and i.get("carrier") is not False
            and i is not chosen
        ]
        if faster and chosen.get("speed_mbps"):
            best = max(faster, key=lambda i: i.get("speed_mbps") or 0)
            warnings.append(
                f"{best['name']} ({_speed_text(best)}) is faster than {chosen['name']} ({_speed_text(chosen)}) "
                f"but does not carry the cluster subnet {subnet}: move the cluster addresses to {best['name']} "
                "or set nccl_network_interface"
            )
        return {"interface": chosen, "address": address, "reason": reason, "warnings": warnings, "errors": []}
    if subnet:
        seen = ", ".join(
            f"{i['name']} {'/'.join(_global_addresses(i)) or 'no address'}"
            for i in interfaces
            if i.get("kind") != "loopback"
        )
        detail = f"; {', '.join(refused)} hold it but NCCL must not use them" if refused else ""
        return _no_interface(
            f"no usable interface has an address in the cluster subnet {subnet} (found: {seen or 'none'})"
            f"{detail}: fix budgetgpu_cluster_subnet or set nccl_network_interface"
        )
    # No cluster subnet (one node): the fastest NIC with an address and a link.
    usable = [i for i in interfaces if i.get("kind") not in (*_NEVER_KINDS, "bridge") and _global_addresses(i)]
    if not usable:
        return _no_interface(
            "no network interface with an address besides loopback, docker and bridges: "
            "set budgetgpu_cluster_subnet or nccl_network_interface"
        )
    chosen = sorted(usable, key=_rank)[0]
    address = _global_addresses(chosen)[0]
    reason = f"fastest interface with an address (no budgetgpu_cluster_subnet set){_kind_note(chosen)}"
    return {"interface": chosen, "address": address, "reason": reason, "warnings": warnings, "errors": []}


def active_ib_ports(net: dict[str, Any]) -> list[str]:
    """Return 'device:port' for every InfiniBand/RoCE port in state ACTIVE."""
    ports = []
    for device in net.get("infiniband") or []:
        for port in device.get("ports") or []:
            if str(port.get("state") or "").upper() == "ACTIVE":
                ports.append(f"{device['name']}:{port.get('port', 1)}")
    return ports


def decide_transport(net: dict[str, Any], cluster_net: dict[str, Any] | None = None) -> dict[str, Any]:
    """Return {name, env, reason}: IB verbs when this node and every peer have an active port, else Socket."""
    devices = net.get("infiniband") or []
    ports = active_ib_ports(net)
    socket_env = {"NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket"}
    if not devices:
        return {"name": "Socket", "env": socket_env, "reason": "no InfiniBand device"}
    if not ports:
        names = ", ".join(d["name"] for d in devices)
        return {"name": "Socket", "env": socket_env, "reason": f"InfiniBand {names} has no ACTIVE port"}
    peers_without = sorted(host for host, facts in (cluster_net or {}).items() if not active_ib_ports(facts or {}))
    if peers_without:
        return {
            "name": "Socket",
            "env": socket_env,
            "reason": f"{', '.join(peers_without)} lack an active InfiniBand port and NCCL needs one transport "
            "on every node",
        }
    kinds = {
        port.get("kind", "infiniband")
        for device in devices
        for port in device.get("ports") or []
        if f"{device['name']}:{port.get('port', 1)}" in ports
    }
    label = "RoCE" if kinds == {"roce"} else "InfiniBand"
    return {
        "name": "IB",
        "env": {"NCCL_IB_DISABLE": "0", "NCCL_NET": "IB", "NCCL_IB_HCA": "=" + ",".join(ports)},
        "reason": f"{label} {', '.join(ports)} active on every node",
    }


def _gpu_list(gpu_facts: dict[str, Any] | None, pcie_facts: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Return [{name, nvlinks, behind_switch}] joining NVML (names, NVLink) and PCIe (paths) by bus id."""
    pcie_by_bus = {g.get("bus_id"): g for g in (pcie_facts or {}).get("gpus") or []}
    nvml = [g for g in (gpu_facts or {}).get("gpus") or [] if g.get("name")]
    gpus = []
    for gpu in nvml or list(pcie_by_bus.values()):
        pcie = pcie_by_bus.get(gpu.get("bus_id"), gpu)
        nvlinks = gpu.get("nvlinks_active")
        gpus.append(
            {
                "name": str(gpu.get("name") or "unknown GPU").replace("NVIDIA ", ""),
                "nvlinks": nvlinks if isinstance(nvlinks, int) and not isinstance(nvlinks, bool) else 0,
                "behind_switch": any(hop.get("role") in _SWITCH_ROLES for hop in pcie.get("path") or []),
            }
        )
    return gpus


def decide_p2p(gpu_facts: dict[str, Any] | None, pcie_facts: dict[str, Any] | None) -> dict[str, Any]:
    """Return {disable: bool | None, reason}; None means NCCL decides (one GPU or none)."""
    gpus = _gpu_list(gpu_facts, pcie_facts)
    if len(gpus) < 2:
        return {"disable": None, "reason": f"{'one GPU' if gpus else 'no GPU'}, P2P not used"}
    names = sorted({g["name"] for g in gpus})
    if all(g["nvlinks"] > 0 for g in gpus):
        return {"disable": False, "reason": f"{len(gpus)}x {'/'.join(names)} peer over NVLink"}
    switched = [g for g in gpus if g["behind_switch"]]
    consumer = [g for g in gpus if _CONSUMER.search(g["name"])]
    where = "behind PCIe switch" if switched else "across PCIe root ports"
    if len(names) > 1:
        return {"disable": True, "reason": f"mixed GPU models {' + '.join(names)} cannot peer ({where})"}
    if consumer:
        return {"disable": True, "reason": f"{consumer[0]['name']} {where}: GeForce cards have no PCIe P2P"}
    if switched:
        return {"disable": True, "reason": f"{switched[0]['name']} behind PCIe switch"}
    return {"disable": False, "reason": f"{len(gpus)}x {names[0]} peer over PCIe"}


def nccl_env(
    net_facts: dict[str, Any],
    gpu_facts: dict[str, Any] | None = None,
    pcie_facts: dict[str, Any] | None = None,
    overrides: dict[str, Any] | None = None,
    interface: str | None = None,
    subnet: str | None = None,
    cluster_net: dict[str, Any] | None = None,
    debug: str = "WARN",
) -> dict[str, Any]:
    """Return the node's NCCL environment and why: {env, interface, address, ..., reasons, summary, errors}.

    overrides: env vars from the inventory; they replace the decided values (None removes one).
    interface: an NCCL_SOCKET_IFNAME-style request from the inventory; it replaces the probe's pick.
    cluster_net: {host: budgetgpu_net} of the other nodes, so that the transport agrees cluster-wide.
    """
    net_facts = net_facts or {}
    overrides = dict(overrides or {})
    request = interface or None
    override_ifname = overrides.get("NCCL_SOCKET_IFNAME")
    if override_ifname and not request:
        request = str(override_ifname)
    picked = select_interface(net_facts, subnet, request)
    transport = decide_transport(net_facts, cluster_net)
    p2p = decide_p2p(gpu_facts, pcie_facts)
    result: dict[str, Any] = {
        "env": {},
        "interface": None,
        "address": None,
        "speed_mbps": None,
        "kind": None,
        "transport": transport["name"],
        "p2p_disable": p2p["disable"],
        "reasons": [],
        "warnings": picked["warnings"],
        "overridden": sorted(overrides),
        "summary": "",
        "errors": picked["errors"],
    }
    if picked["errors"]:
        result["summary"] = picked["errors"][0]
        return result
    iface = picked["interface"]
    env: dict[str, str] = {"NCCL_DEBUG": debug}
    env["NCCL_SOCKET_IFNAME"] = f"={iface['name']}"
    env["GLOO_SOCKET_IFNAME"] = iface["name"]
    env.update(transport["env"])
    if p2p["disable"] is not None:
        env["NCCL_P2P_DISABLE"] = "1" if p2p["disable"] else "0"
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = str(int(value)) if isinstance(value, bool) else str(value)
    p2p_word = "P2P off" if env.get("NCCL_P2P_DISABLE") == "1" else "P2P on"
    if p2p["disable"] is None and "NCCL_P2P_DISABLE" not in env:
        p2p_word = "P2P unset"
    interface_reason = picked["reason"]
    transport_reason = transport["reason"]
    p2p_reason = p2p["reason"]
    transport_name = "IB" if env.get("NCCL_NET") == "IB" else "Socket" if env.get("NCCL_NET") == "Socket" else "auto"
    if "NCCL_NET" in overrides or "NCCL_IB_DISABLE" in overrides:
        transport_reason = "set by inventory"
    if "NCCL_P2P_DISABLE" in overrides:
        p2p_reason = "set by inventory"
    result.update(
        env=env,
        interface=iface["name"],
        address=picked["address"],
        speed_mbps=iface.get("speed_mbps"),
        kind=iface.get("kind"),
        transport=transport_name,
        reasons=[
            f"interface {iface['name']}: {interface_reason}",
            f"transport {transport_name}: {transport_reason}",
            f"{p2p_word}: {p2p_reason}",
        ],
    )
    result["summary"] = (
        f"NCCL on {iface['name']} ({_speed_text(iface)}), {transport_name} transport: {transport_reason}; "
        f"{p2p_word}: {p2p_reason}"
    )
    return result


def nccl_env_file(env: dict[str, str]) -> str:
    """Return KEY=value lines that both systemd's EnvironmentFile= and `sh` read the same way."""
    lines = []
    for key in sorted(env):
        value = str(env[key])
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) or re.search(r"[\s'\"\\$`]", value):
            raise ValueError(f"NCCL environment {key}={value!r}: names must be identifiers, values plain words")
        lines.append(f"{key}={value}")
    return "\n".join(lines) + "\n"


def nccl_member_addresses(
    nets: list[dict[str, Any]], subnet: str | None = None, chosen: list[str] | None = None
) -> dict[str, list[str]]:
    """Return {ipv4, ipv6}: every address the cluster's nodes may send NCCL/gloo/c10d traffic from.

    Those are the addresses on their NICs (physical, bond, vlan, veth, IPoIB), any address in the
    cluster subnet and the chosen NCCL addresses; never loopback or docker bridges.
    """
    found: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()
    for net in nets or []:
        for iface in (net or {}).get("interfaces") or []:
            for address in _global_addresses(iface):
                nic = iface.get("kind") in ("physical", "bond", "vlan", "veth", "infiniband", "virtual")
                if (nic or _in_subnet(address, subnet)) and iface.get("kind") not in _NEVER_KINDS:
                    found.add(ipaddress.ip_address(address))
    for address in chosen or []:
        ip = _ip(address)
        if ip is not None:
            found.add(ip)
    return {
        "ipv4": [str(a) for a in sorted(a for a in found if a.version == 4)],
        "ipv6": [str(a) for a in sorted(a for a in found if a.version == 6)],
    }


def nccl_busbw_factor(world_size: int) -> float:
    """Return nccl-tests' all-reduce bus bandwidth factor 2(n-1)/n."""
    n = max(int(world_size), 1)
    return 2.0 * (n - 1) / n if n > 1 else 1.0


def nccl_busbw_floor(
    link_speeds_mbps: list[Any], iperf_gbs: list[float], fraction: float, virtual_fraction: float, explicit: Any = None
) -> dict[str, Any]:
    """Return {floor_gbs, basis}: explicit, else fraction x the slowest line rate, else x the iperf3 baseline.

    Virtual links (veth, virtio) report a nominal or no speed, so their floor follows what iperf3 measured.
    """
    if explicit not in (None, "", "auto"):
        return {"floor_gbs": float(explicit), "basis": "set by nccl_network_busbw_floor_gbps"}
    speeds = [s for s in link_speeds_mbps if isinstance(s, (int, float)) and s > 0]
    if speeds and len(speeds) == len(link_speeds_mbps):
        slowest = min(speeds)
        return {
            "floor_gbs": round(fraction * slowest / 8000.0, 3),
            "basis": f"{fraction:.0%} of the slowest line rate {slowest} Mb/s",
        }
    if iperf_gbs:
        slowest_tcp = min(iperf_gbs)
        return {
            "floor_gbs": round(virtual_fraction * slowest_tcp, 3),
            "basis": f"{virtual_fraction:.0%} of the slowest iperf3 baseline {slowest_tcp:.2f} GB/s (virtual links)",
        }
    return {"floor_gbs": 0.0, "basis": "no link speed and no iperf3 baseline"}


def nccl_comm_report(results: dict[str, Any], iperf: list[dict[str, Any]], floor: dict[str, Any]) -> dict[str, Any]:
    """Return the comm test's verdict: rows per size, busbw/iperf3 ratio, the slowest pair, failures.

    results: the all-reduce script's JSON (sizes[], pairs[] of send/recv between neighbouring nodes).
    iperf: [{src, dst, src_addr, dst_addr, gbs}] TCP baselines, one per pair.
    """
    sizes = sorted(results.get("sizes") or [], key=lambda row: row["bytes"])
    tcp = {(p["src"], p["dst"]): p for p in iperf or []}
    baseline = min((p["gbs"] for p in iperf or []), default=None)
    rows = []
    for row in sizes:
        ratio = row["busbw_gbs"] / baseline if baseline else None
        rows.append({**row, "tcp_ratio": None if ratio is None else round(ratio, 3)})
    large = max(sizes, key=lambda row: row["bytes"]) if sizes else None
    pairs = []
    for pair in results.get("pairs") or []:
        tcp_pair = tcp.get((pair["src"], pair["dst"]))
        tcp_gbs = tcp_pair["gbs"] if tcp_pair else None
        pairs.append({**pair, "iperf3_gbs": tcp_gbs, "tcp_ratio": round(pair["gbs"] / tcp_gbs, 3) if tcp_gbs else None})
    slowest_pair = min(pairs, key=lambda p: p["gbs"]) if pairs else None
    slowest_tcp = min(iperf or [], key=lambda p: p["gbs"], default=None)
    failures = []
    floor_gbs = float(floor.get("floor_gbs") or 0.0)
    if large is None:
        failures.append("the all-reduce produced no measurement")
    elif large["busbw_gbs"] < floor_gbs:
        where = []
        if slowest_pair:
            where.append(
                f"slowest pair {slowest_pair['src']} -> {slowest_pair['dst']} "
                f"({slowest_pair.get('src_addr', '?')} -> {slowest_pair.get('dst_addr', '?')}): "
                f"{slowest_pair['gbs']:.3f} GB/s send/recv"
            )
        if slowest_tcp:
            where.append(
                f"slowest TCP pair {slowest_tcp['src']} -> {slowest_tcp['dst']}: {slowest_tcp['gbs']:.3f} GB/s iperf3"
            )
        failures.append(
            f"all-reduce bus bandwidth {large['busbw_gbs']:.3f} GB/s at {_size_text(large['bytes'])} is under the "
            f"floor {floor_gbs:.3f} GB/s ({floor.get('basis', '')}); " + "; ".join(where or ["no pair measured"])
        )
    return {
        "backend": results.get("backend"),
        "world_size": results.get("world_size"),
        "nodes": results.get("nodes"),
        "rows": rows,
        "pairs": pairs,
        "iperf3": iperf or [],
        "iperf3_min_gbs": baseline,
        "large_busbw_gbs": large["busbw_gbs"] if large else None,
        "large_tcp_ratio": rows[-1]["tcp_ratio"] if rows else None,
        "floor_gbs": floor_gbs,
        "floor_basis": floor.get("basis"),
        "slowest_pair": slowest_pair,
        "slowest_tcp_pair": slowest_tcp,
        "passed": not failures,
        "failures": failures,
    }


def _size_text(size: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size} B"


def nccl_report_table(report: dict[str, Any]) -> list[str]:
    """Return the report as lines of a fixed-width table, nccl-tests style."""
    lines = [f"{'size':>10} {'time us':>12} {'algbw GB/s':>11} {'busbw GB/s':>11} {'busbw/TCP':>10}"]
    for row in report.get("rows") or []:
        ratio = "-" if row.get("tcp_ratio") is None else f"{row['tcp_ratio']:.0%}"
        lines.append(
            f"{_size_text(row['bytes']):>10} {row['time_us']:>12.1f} {row['algbw_gbs']:>11.3f} "
            f"{row['busbw_gbs']:>11.3f} {ratio:>10}"
        )
    for pair in report.get("pairs") or []:
        tcp = "-" if pair.get("iperf3_gbs") is None else f"{pair['iperf3_gbs']:.3f}"
        lines.append(f"pair {pair['src']} -> {pair['dst']}: send/recv {pair['gbs']:.3f} GB/s, iperf3 {tcp} GB/s")
    lines.append(
        f"floor {report.get('floor_gbs', 0):.3f} GB/s ({report.get('floor_basis')}): "
        + ("PASS" if report.get("passed") else "FAIL")
    )
    return lines


def nccl_missing_facts(members: list[str], hostvars: Any, fact: str = "budgetgpu_net") -> list[str]:
    """Return the members whose ansible_facts lack fact (not probed in this run nor in the fact cache)."""
    missing = []
    for host in members or []:
        try:
            facts = hostvars[host].get("ansible_facts") or {}
        except KeyError:
            facts = {}
        if not facts.get(fact):
            missing.append(host)
    return missing


# The firewall file names each member and the addresses it may connect from, one comment line each:
# the record that a later run reads back for a member whose facts it does not have.
_MEMBER_LINE = re.compile(r"^#\s*member\s+(\S+):\s*(.*?)\s*$")


def _facts_of(hostvars: Any, host: str) -> dict[str, Any]:
    try:
        return hostvars[host].get("ansible_facts") or {}
    except KeyError:
        return {}


def nccl_absent_members(
    members: list[str], hostvars: Any, play_hosts_all: list[str], play_hosts: list[str]
) -> dict[str, str]:
    """Return {host: why} for each member without budgetgpu_net facts in this run, in member order.

    why is "not in this run" for a member the run leaves out (--limit, as ansible-pull runs with),
    "down or failed earlier in this run" for one that is in the run but no longer in the play.
    """
    absent = {}
    for host in nccl_missing_facts(members, hostvars):
        if host not in (play_hosts_all or []):
            absent[host] = "not in this run (--limit)"
        elif host not in (play_hosts or []):
            absent[host] = "down or failed earlier in this run"
        else:
            absent[host] = "not probed in this run"
    return absent


def nccl_recorded_members(text: str | None) -> dict[str, dict[str, list[str]]]:
    """Return {host: {ipv4, ipv6}} from the "# member HOST: ADDR, ..." lines of a firewall file."""
    records: dict[str, dict[str, list[str]]] = {}
    for line in (text or "").splitlines():
        match = _MEMBER_LINE.match(line.strip())
        if not match:
            continue
        found = [ip for ip in (_ip(word.strip()) for word in match.group(2).split(",")) if ip is not None]
        records[match.group(1)] = {
            "ipv4": [str(a) for a in sorted(a for a in found if a.version == 4)],
            "ipv6": [str(a) for a in sorted(a for a in found if a.version == 6)],
        }
    return records


def nccl_member_records(
    members: list[str], hostvars: Any, subnet: str | None = None, recorded: dict[str, Any] | None = None
) -> dict[str, dict[str, Any]]:
    """Return {host: {ipv4, ipv6, source}}: the addresses each member may connect from.

    source is "facts" (its budgetgpu_net facts and its NCCL decision in this run), "record" (no facts:
    the addresses an earlier run wrote into the firewall file, `recorded`) or None (known nowhere).
    """
    records = {}
    for host in members or []:
        net = _facts_of(hostvars, host).get("budgetgpu_net")
        if net:
            try:
                decision = hostvars[host].get("nccl_network_decision") or {}
            except KeyError:
                decision = {}
            addresses = nccl_member_addresses(
                [net], subnet, [decision.get("address")] if decision.get("address") else []
            )
            records[host] = {**addresses, "source": "facts"}
        elif host in (recorded or {}):
            kept = recorded[host]
            records[host] = {
                "ipv4": list(kept.get("ipv4") or []),
                "ipv6": list(kept.get("ipv6") or []),
                "source": "record",
            }
        else:
            records[host] = {"ipv4": [], "ipv6": [], "source": None}
    return records


def nccl_record_addresses(records: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """Return {ipv4, ipv6}: every address of nccl_member_records' answer, sorted, once each."""
    found = {
        ip for record in (records or {}).values() for key in ("ipv4", "ipv6") for ip in map(_ip, record.get(key) or [])
    }
    found.discard(None)
    return {
        "ipv4": [str(a) for a in sorted(a for a in found if a.version == 4)],
        "ipv6": [str(a) for a in sorted(a for a in found if a.version == 6)],
    }


def nccl_absent_report(
    absent: dict[str, str], records: dict[str, dict[str, Any]], firewall_file: str = ""
) -> list[str]:
    """Return one line per member without facts in this run: why, and what the firewall keeps for it."""
    lines = []
    for host, why in (absent or {}).items():
        record = (records or {}).get(host) or {}
        addresses = ", ".join(list(record.get("ipv4") or []) + list(record.get("ipv6") or []))
        if not firewall_file:
            kept = "the firewall is off here (nccl_network_firewall: false)"
        elif addresses:
            kept = f"the firewall keeps admitting it from {addresses}, the addresses {firewall_file} recorded"
        else:
            kept = f"no address of it is known (none recorded in {firewall_file})"
        lines.append(f"{host}: {why}, no facts: {kept}; it is not checked in this run")
    return lines


def nccl_reachability_plan(
    members: list[str], hostvars: Any, me: str, master: str, rendezvous_ports: list[int], probe_port: int
) -> dict[str, Any]:
    """Return {listen, connect, errors} for reachability.py on node `me`.

    Every node listens on its NCCL address (the master also on the rendezvous ports) and connects to
    the master's rendezvous ports and to every other member's NCCL address.
    """
    decisions = {}
    errors = []
    for host in members:
        try:
            decision = hostvars[host].get("nccl_network_decision")
        except KeyError:
            decision = None
        if decision and decision.get("address"):
            decisions[host] = decision
        else:
            errors.append(f"{host}: no NCCL decision (the host failed earlier or is unreachable)")
    listen, connect = [], []
    own = decisions.get(me)
    if own:
        listen.append(f"{endpoint(own['address'], probe_port)}:{len(members) - 1}")
    master_decision = decisions.get(master)
    if master_decision:
        for port in rendezvous_ports:
            if me == master:
                listen.append(f"{endpoint(master_decision['address'], port)}:{len(members)}")
            connect.append(f"{master} rendezvous={endpoint(master_decision['address'], port)}")
    for host in members:
        if host != me and host in decisions:
            connect.append(f"{host}={endpoint(decisions[host]['address'], probe_port)}")
    return {"listen": listen, "connect": connect, "errors": errors}


def nccl_unreached_message(result: dict[str, Any], me: str, decision: dict[str, Any]) -> str:
    """Return one line naming the node, its NCCL interface and address, and the target it missed."""
    return (
        f"{me} (NCCL on {decision.get('interface')} {decision.get('address')}) cannot reach {result['name']} at "
        f"{endpoint(result['address'], result['port'])}: {result['error']}"
    )


def nccl_ring(order: list[str]) -> list[dict[str, str]]:
    """Return [{src, dst}] for each node and the next one (the links a ring all-reduce uses)."""
    if len(order) < 2:
        return []
    return [{"src": src, "dst": dst} for src, dst in zip(order, order[1:] + order[:1], strict=True)]


def nccl_line_rates(decisions: list[dict[str, Any]]) -> list[int | None]:
    """Return each node's NCCL line rate in Mb/s, None where the link is virtual (veth, virtio) or unknown."""
    rates: list[int | None] = []
    for decision in decisions:
        real = decision.get("kind") in ("physical", "bond", "vlan", "infiniband")
        rates.append(decision.get("speed_mbps") if real else None)
    return rates


def nccl_iperf_results(loop_results: list[dict[str, Any]], hostvars: Any = None) -> list[dict[str, Any]]:
    """Return [{src, dst, dst_addr, gbs, retransmits}] from a loop of `iperf3 --json` client runs."""
    out = []
    for result in loop_results or []:
        item = result.get("item") or {}
        data = json.loads(result.get("stdout") or "{}")
        end = data.get("end") or {}
        received = end.get("sum_received") or {}
        bps = float(received.get("bits_per_second") or 0.0)
        out.append(
            {
                "src": item.get("src"),
                "dst": item.get("dst"),
                "dst_addr": (data.get("start") or {}).get("connecting_to", {}).get("host"),
                "gbs": round(bps / 8e9, 4),
                "retransmits": (end.get("sum_sent") or {}).get("retransmits"),
            }
        )
    return out


class FilterModule:
    """budgetgpu NCCL network filters."""

    def filters(self) -> dict[str, Any]:
        return {
            "nccl_env": nccl_env,
            "nccl_env_file": nccl_env_file,
            "nccl_member_addresses": nccl_member_addresses,
            "nccl_missing_facts": nccl_missing_facts,
            "nccl_absent_members": nccl_absent_members,
            "nccl_recorded_members": nccl_recorded_members,
            "nccl_member_records": nccl_member_records,
            "nccl_record_addresses": nccl_record_addresses,
            "nccl_absent_report": nccl_absent_report,
            "nccl_ring": nccl_ring,
            "nccl_line_rates": nccl_line_rates,
            "nccl_iperf_results": nccl_iperf_results,
            "nccl_reachability_plan": nccl_reachability_plan,
            "nccl_unreached_message": nccl_unreached_message,
            "nccl_busbw_factor": nccl_busbw_factor,
            "nccl_busbw_floor": nccl_busbw_floor,
            "nccl_comm_report": nccl_comm_report,
            "nccl_report_table": nccl_report_table,
        }
