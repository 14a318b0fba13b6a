"""NCCL network decisions: environment, transport and P2P per node, firewall members, reachability, comm-test verdict.

Pure functions of the probe facts (`budgetgpu_net`, `budgetgpu_gpus`, `budgetgpu_pcie`) and the
inventory, so that the role, the tests and the report read one decision made in one place. The
node's interface and address are not decided here: net_facts decides them once
(module_utils/netinfo.choose_cluster_interface) and everything here reads `cluster_interface`.
The filters of plugins/filter/nccl.py call these functions.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Mapping
from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.module_utils.netinfo import (
    NEVER_KINDS,
    endpoint,
    global_addresses,
    in_subnet,
    ip_or_none,
    speed_text,
)
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils import nodes
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.jobs import (
    PORT_KEYS,
    job_hosts,
    job_master,
    job_master_addr,
)

_CONSUMER = re.compile(r"\b(GeForce|TITAN)\b", re.IGNORECASE)
_SWITCH_ROLES = ("switch_upstream", "switch_downstream")


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


def _pcie_p2p(gpus: list[dict[str, Any]]) -> dict[str, Any]:
    """Return {disable, reason}: whether P2P over PCIe is safe for these (two or more) GPUs."""
    names = sorted({g["name"] for g in gpus})
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


def decide_p2p(gpu_facts: dict[str, Any] | None, pcie_facts: dict[str, Any] | None) -> dict[str, Any]:
    """Return {disable: bool | None, reason} and, where P2P is kept to NVLink, level "NVL".

    disable None means NCCL decides (one GPU or none). NVML tells how many NVLinks each GPU has
    up, not to which peer: two or more bridged GPUs among others whose PCIe P2P is off keep P2P
    over their bridges (NCCL_P2P_LEVEL=NVL) instead of losing it with the rest.
    """
    gpus = _gpu_list(gpu_facts, pcie_facts)
    if len(gpus) < 2:
        return {"disable": None, "reason": f"{'one GPU' if gpus else 'no GPU'}, P2P not used"}
    names = sorted({g["name"] for g in gpus})
    bridged = [g for g in gpus if g["nvlinks"] > 0]
    if len(bridged) == len(gpus):
        return {"disable": False, "reason": f"{len(gpus)}x {'/'.join(names)} peer over NVLink"}
    pcie = _pcie_p2p(gpus)
    if pcie["disable"] and len(bridged) >= 2:
        return {
            "disable": False,
            "level": "NVL",
            "reason": f"{len(bridged)} of {len(gpus)} GPUs peer over NVLink, the others not over PCIe: "
            + pcie["reason"],
        }
    return pcie


def _interface(net_facts: dict[str, Any], overrides: dict[str, Any]) -> tuple[dict[str, Any] | None, list[str]]:
    """Return (the probe's cluster interface, errors): the one address decision, never made here again."""
    named = sorted(k for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME") if k in overrides)
    if named:
        return None, [
            f"nccl_network_env sets {', '.join(named)}, expected the interface rule in budgetgpu_cluster_interface "
            f"(found {named[0]}={overrides[named[0]]}): move it there, so that NCCL, gloo and the rendezvous "
            "use one interface"
        ]
    chosen = net_facts.get("cluster_interface")
    if chosen and chosen.get("name") and chosen.get("address"):
        return chosen, []
    return None, [
        net_facts.get("cluster_interface_error")
        or "budgetgpu_net has no cluster_interface: run the probe role (budgetgpu.cluster.probe) in this play first"
    ]


def _with_overrides(env: dict[str, str], overrides: dict[str, Any]) -> dict[str, str]:
    """Return env with the inventory's variables applied: they win, None removes one, true/false become 1/0."""
    env = dict(env)
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = str(int(value)) if isinstance(value, bool) else str(value)
    return env


def _p2p_env(p2p: dict[str, Any]) -> dict[str, str]:
    if p2p["disable"] is None:
        return {}
    env = {"NCCL_P2P_DISABLE": "1" if p2p["disable"] else "0"}
    if p2p.get("level"):
        env["NCCL_P2P_LEVEL"] = p2p["level"]
    return env


def _p2p_word(env: dict[str, str], p2p: dict[str, Any]) -> str:
    if env.get("NCCL_P2P_DISABLE") == "1":
        return "P2P off"
    if env.get("NCCL_P2P_LEVEL") == "NVL":
        return "P2P over NVLink only"
    return "P2P unset" if p2p["disable"] is None and "NCCL_P2P_DISABLE" not in env else "P2P on"


def nccl_env(
    net_facts: dict[str, Any],
    gpu_facts: dict[str, Any] | None = None,
    pcie_facts: dict[str, Any] | None = None,
    overrides: dict[str, Any] | None = None,
    cluster_net: dict[str, Any] | None = None,
    debug: str = "WARN",
) -> dict[str, Any]:
    """Return the node's NCCL environment and why: {env, interface, address, ..., reasons, summary, errors}.

    The interface and address are the probe's cluster_interface (budgetgpu_net), the node's one
    address decision. overrides: env vars from the inventory; they replace the decided values (None
    removes one). cluster_net: {host: budgetgpu_net} of the other nodes, so that the transport agrees.
    """
    net_facts = net_facts or {}
    overrides = dict(overrides or {})
    iface, errors = _interface(net_facts, overrides)
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
        "p2p_level": p2p.get("level"),
        "reasons": [],
        "warnings": list((iface or {}).get("warnings") or []),
        "overridden": sorted(overrides),
        "summary": errors[0] if errors else "",
        "errors": errors,
    }
    if iface is None:
        return result
    env = {"NCCL_DEBUG": debug, "NCCL_SOCKET_IFNAME": f"={iface['name']}", "GLOO_SOCKET_IFNAME": iface["name"]}
    env = _with_overrides({**env, **transport["env"], **_p2p_env(p2p)}, overrides)
    transport_name = {"IB": "IB", "Socket": "Socket"}.get(env.get("NCCL_NET", ""), "auto")
    set_here = {"NCCL_NET", "NCCL_IB_DISABLE"} & set(overrides)
    transport_reason = "set by inventory" if set_here else transport["reason"]
    p2p_reason = "set by inventory" if {"NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL"} & set(overrides) else p2p["reason"]
    p2p_word = _p2p_word(env, p2p)
    result.update(
        env=env,
        interface=iface["name"],
        address=iface["address"],
        speed_mbps=iface.get("speed_mbps"),
        kind=iface.get("kind"),
        transport=transport_name,
        reasons=[
            f"interface {iface['name']}: {iface.get('reason')}",
            f"transport {transport_name}: {transport_reason}",
            f"{p2p_word}: {p2p_reason}",
        ],
        summary=f"NCCL on {iface['name']} ({speed_text(iface)}), {transport_name} transport: {transport_reason}; "
        f"{p2p_word}: {p2p_reason}",
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
            for address in global_addresses(iface):
                nic = iface.get("kind") in ("physical", "bond", "vlan", "veth", "infiniband", "virtual")
                if (nic or in_subnet(address, subnet)) and iface.get("kind") not in NEVER_KINDS:
                    found.add(ipaddress.ip_address(address))
    for address in chosen or []:
        ip = ip_or_none(address)
        if ip is not None:
            found.add(ip)
    return {
        "ipv4": [str(a) for a in sorted(a for a in found if a.version == 4)],
        "ipv6": [str(a) for a in sorted(a for a in found if a.version == 6)],
    }


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
    """Return the members that lack fact (not probed in this run nor in the fact cache)."""
    return [host for host in members or [] if not nodes.fact(hostvars, host, fact)]


# The firewall file names each member and the addresses it may connect from, one comment line each:
# the record that a later run reads back for a member whose facts it does not have.
_MEMBER_LINE = re.compile(r"^#\s*member\s+(\S+):\s*(.*?)\s*$")


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


def nccl_member_lines(records: dict[str, dict[str, Any]]) -> list[str]:
    """Return the "member HOST: ADDR, ..." lines (without "# ") that the firewall file records, one per member
    with addresses known in this run (nccl_member_records' answer): what nccl_recorded_members reads back."""
    return [
        f"member {host}: {', '.join(list(record.get('ipv4') or []) + list(record.get('ipv6') or []))}"
        for host, record in (records or {}).items()
        if record.get("source")
    ]


def nccl_recorded_members(text: str | None) -> dict[str, dict[str, list[str]]]:
    """Return {host: {ipv4, ipv6}} from the "# member HOST: ADDR, ..." lines of a firewall file."""
    records: dict[str, dict[str, list[str]]] = {}
    for line in (text or "").splitlines():
        match = _MEMBER_LINE.match(line.strip())
        if not match:
            continue
        found = [ip for ip in (ip_or_none(word.strip()) for word in match.group(2).split(",")) if ip is not None]
        records[match.group(1)] = {
            "ipv4": [str(a) for a in sorted(a for a in found if a.version == 4)],
            "ipv6": [str(a) for a in sorted(a for a in found if a.version == 6)],
        }
    return records


def nccl_member_records(
    members: list[str], hostvars: Any, subnet: str | None = None, recorded: dict[str, Any] | None = None
) -> dict[str, dict[str, Any]]:
    """Return {host: {ipv4, ipv6, source}}: the addresses each member may connect from.

    source is "facts" (its budgetgpu_net facts and its cluster_interface in this run), "record" (no facts:
    the addresses an earlier run wrote into the firewall file, `recorded`) or None (known nowhere).
    """
    records = {}
    for host in members or []:
        net = nodes.fact(hostvars, host, "budgetgpu_net")
        if net:
            # Its cluster address (the one address decision), also where a rule put it on a docker or loopback device.
            chosen = (net.get("cluster_interface") or {}).get("address")
            addresses = nccl_member_addresses([net], subnet, [chosen] if chosen else [])
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
        ip
        for record in (records or {}).values()
        for key in ("ipv4", "ipv6")
        for ip in map(ip_or_none, record.get(key) or [])
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


# torch's default rendezvous port: closed like a job's even where no job takes it (a torchrun started by hand).
TORCH_DEFAULT_PORT = 29500


def _host_jobs(inputs: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """inputs' jobs that run on inputs' host, the removed ones left out."""
    groups, host = inputs.get("groups") or {}, inputs.get("host")
    return [job for job in inputs.get("jobs") or [] if job.get("state") != "absent" and host in job_hosts(job, groups)]


def nccl_firewall_ports(inputs: Mapping[str, Any], records: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Return the training table's entries (role _firewall's) on inputs' host, but NCCL/gloo's ephemeral range.

    One per job of the host (not removed): its port and store_port, torch c10d stores without authentication,
    reached only from its own nodes' addresses (records: nccl_member_records' answer) and nccl_network's
    allowed_sources, and from a node only by root and the job's user, to this node or to the others
    (local_to_hosts: each node of the job runs this table, so the other users of node2 do not reach node1's store).
    Then one for the other single ports (test_ports, torch's default, the ports of jobs elsewhere): every member,
    and from a node root and the test's user. inputs: host, jobs, groups, user, test_ports, allowed_sources.
    """
    jobs, groups = list(inputs.get("jobs") or []), inputs.get("groups") or {}
    allowed = [str(source) for source in inputs.get("allowed_sources") or []]
    entries = []
    for job in _host_jobs(inputs):
        hosts = job_hosts(job, groups)
        addresses = nccl_record_addresses({h: records[h] for h in hosts if h in records})
        entries.append(
            {
                "name": f"job {job.get('name')}",
                "port": [str(int(job[key])) for key in PORT_KEYS],
                "what": f"job {job.get('name')}'s rendezvous and worker store",
                "only": "its nodes only",
                "hosts": [],
                "extra": addresses["ipv4"] + addresses["ipv6"] + allowed,
                "inputs": "torchrun_jobs / nccl_network_allowed_sources",
                "verdict": "drop",
                "local": [str(job.get("user"))],
                "local_to_hosts": True,
            }
        )
    taken = {int(port) for entry in entries for port in entry["port"]}
    elsewhere = [int(job[key]) for job in jobs for key in PORT_KEYS]
    others = sorted({TORCH_DEFAULT_PORT, *map(int, inputs.get("test_ports") or []), *elsewhere} - taken)
    members = nccl_record_addresses(records)
    entries.append(
        {
            "name": "members",
            "port": [str(port) for port in others],
            "what": "reachability, comm test, iperf3 and other jobs' ports",
            "only": "members only",
            "hosts": [],
            "extra": members["ipv4"] + members["ipv6"] + allowed,
            "inputs": "nccl_network_group / nccl_network_allowed_sources",
            # Dropped, not refused: a scanner learns nothing of the job's ports.
            "verdict": "drop",
            "local": [str(inputs.get("user"))],
            "local_to_hosts": True,
        }
    )
    return entries


def _decisions(members: list[str], hostvars: Any) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Return ({host: nccl_network_decision} of members that have one with an address, [errors])."""
    decisions, errors = {}, []
    for host in members:
        decision = nodes.host_var(hostvars, host, "nccl_network_decision")
        if decision and decision.get("address"):
            decisions[host] = decision
        else:
            errors.append(f"{host}: no NCCL decision (the host failed earlier or is unreachable)")
    return decisions, errors


def _rendezvous_targets(
    jobs: list[dict[str, Any]], groups: dict[str, list[str]], decisions: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """Return [{name, master, address, port, hosts}]: each job's own master and port, and its hosts in this run.

    A job whose master is not among the checked members (left out of this run) is not planned: preflight
    reports the members a run leaves out.
    """
    targets = []
    for job in jobs or []:
        master = job_master(job, groups)
        if master not in decisions:
            continue
        hosts = [h for h in job_hosts(job, groups) if h in decisions]
        targets.append(
            {
                "name": f"{master} rendezvous of job {job.get('name')}",
                "master": master,
                "address": job_master_addr(job, groups, {master: {"address": decisions[master]["address"]}}),
                "port": int(job["port"]),
                "hosts": hosts,
            }
        )
    return targets


def nccl_reachability_plan(
    members: list[str],
    hostvars: Any,
    me: str,
    jobs: list[dict[str, Any]],
    groups: dict[str, list[str]],
    probe_port: int,
) -> dict[str, Any]:
    """Return {listen, connect, errors} for reachability.py on node `me`.

    Every node listens on its NCCL address and connects to every other member's. For each job, its
    master listens on the job's rendezvous address and port, and each host of the job connects there:
    the address and port that job's units dial (job_master, job_master_addr), not the group's first member.
    """
    decisions, errors = _decisions(members, hostvars)
    listen, connect = [], []
    if me in decisions:
        listen.append(f"{endpoint(decisions[me]['address'], probe_port)}:{len(members) - 1}")
    expected: dict[str, int] = {}
    for target in _rendezvous_targets(jobs, groups, decisions):
        where = endpoint(target["address"], target["port"])
        if me == target["master"]:
            expected[where] = expected.get(where, 0) + len(target["hosts"])
        if me in target["hosts"]:
            connect.append(f"{target['name']}={where}")
    listen += [f"{where}:{count}" for where, count in expected.items()]
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


def _absent_problems(inputs: Mapping[str, Any], host: str) -> list[str]:
    """Members without budgetgpu_net facts: refused outside safe mode; in safe mode, refused only where
    the firewall would shut them out (no address of theirs known from facts or the firewall file)."""
    absent = dict(inputs.get("absent") or {})
    absent_text = ", ".join(f"{member} ({why})" for member, why in absent.items())
    group, safe_mode = inputs.get("group"), bool(inputs.get("safe_mode"))
    if absent and not safe_mode:
        return [
            f"{host}: expected budgetgpu_net facts of every member of {group} (from this run, or the fact cache for "
            f"fact_caching_timeout seconds), found none for {absent_text}: the firewall and the reachability check "
            "need every member's addresses: run the play on the whole group with every member up (drop --limit), "
            "or in safe mode (budgetgpu_safe_mode: true, as the nightly run does) to leave them out and keep the "
            "addresses the firewall admitted for them"
        ]
    records = inputs.get("member_records") or {}
    unknown = [member for member, record in records.items() if (record or {}).get("source") is None]
    if not (safe_mode and inputs.get("firewall") and unknown):
        return []
    recorded = ", ".join(inputs.get("recorded") or {}) or "none"
    return [
        f"{host}: no address known for {', '.join(unknown)}: no budgetgpu_net facts in this run ({absent_text}) and "
        f'no "# member" line for them in {inputs.get("firewall_file")} (it names {recorded}), so the firewall would '
        f"shut them out: run playbooks/network.yml on the whole group {group} while they are up"
    ]


def nccl_network_problems(inputs: Mapping[str, Any]) -> list[str]:
    """Return every problem of role nccl_network's inputs on one node, each naming the host and the
    variable (its one input check). inputs: host, os_family, distribution, version, group, members,
    absent (nccl_absent_members' answer), safe_mode, firewall, member_records (nccl_member_records'),
    firewall_file, recorded (nccl_recorded_members'), subnet, jobs, groups, test_ports."""
    host, group, members = inputs.get("host"), inputs.get("group"), list(inputs.get("members") or [])
    problems = []
    if inputs.get("os_family") != "Debian":
        problems.append(
            f"{host}: nccl_network supports Debian and Ubuntu, found {inputs.get('distribution')} "
            f"{inputs.get('version')}"
        )
    if host not in members:
        problems.append(
            f"{host}: not in group {group} ({', '.join(members) or 'empty'}): run nccl_network on the cluster's nodes "
            "or set nccl_network_group"
        )
    problems += _absent_problems(inputs, host)
    if len(members) >= 2 and not inputs.get("subnet"):
        problems.append(
            f"{host}: the cluster has {len(members)} nodes but budgetgpu_cluster_subnet is empty: set it in "
            "group_vars/all (e.g. 192.168.1.0/24)"
        )
    return problems + _test_port_problems(inputs, host)


def _test_port_problems(inputs: Mapping[str, Any], host: str) -> list[str]:
    """A job of the host on a network test's port: the job's firewall rule would take the port from the test's user
    (nccl_firewall_ports), and the test and the job would meet on it."""
    test_ports = [int(port) for port in inputs.get("test_ports") or []]
    problems = []
    for job in _host_jobs(inputs):
        for key in PORT_KEYS:
            if job.get(key) in test_ports:
                problems.append(
                    f"{host}: job {job.get('name')}: {key}: found {job[key]}, expected a port other than the network "
                    f"tests' ({', '.join(map(str, test_ports))}: nccl_network_probe_port, nccl_network_comm_test_port, "
                    "nccl_network_iperf_port)"
                )
    return problems
