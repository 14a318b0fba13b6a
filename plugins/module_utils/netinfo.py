"""Network interfaces, InfiniBand/RoCE devices and the cluster interface, from sysfs and `ip`.

Plain standard-library Python with no imports from the rest of the collection (roles/probe/files/gpu-probe
imports it from the node package). Addresses come from `ip -j addr` output that the caller collects
(the module runs it in the C locale); `read_addresses_fallback` covers nodes without iproute2.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import re
import socket
import struct
from typing import Any

# Where the kernel hands out ephemeral ports (a connection's source port, a bind to port 0): "LOW\tHIGH".
EPHEMERAL_PORTS_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
ARPHRD_INFINIBAND = 32
ARPHRD_LOOPBACK = 772
_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read().strip()
    except OSError:
        # Reading speed or carrier of a link that is down fails with EINVAL.
        return None


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def ephemeral_ports(path: str = EPHEMERAL_PORTS_FILE) -> list[int] | None:
    """Return the kernel's ephemeral port range [low, high]; None where it cannot be read."""
    words = (_read(path) or "").split()
    return [int(word) for word in words] if len(words) == 2 and all(word.isdigit() for word in words) else None


def parse_ip_addr_json(text: str) -> dict[str, list[dict[str, Any]]]:
    """Return {interface: [{family, address, prefixlen}]} from `ip -j addr` output."""
    addresses: dict[str, list[dict[str, Any]]] = {}
    for link in json.loads(text or "[]"):
        entries = addresses.setdefault(link.get("ifname", ""), [])
        for info in link.get("addr_info", []):
            if "local" in info:
                family = "ipv6" if info.get("family") == "inet6" else "ipv4"
                entries.append({"family": family, "address": info["local"], "prefixlen": info.get("prefixlen")})
    return addresses


def read_addresses_fallback(names: list[str], proc_root: str = "/proc") -> dict[str, list[dict[str, Any]]]:
    """Return addresses without iproute2: each interface's primary IPv4 (ioctl) and its IPv6 list."""
    addresses: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in names:
            request = struct.pack("256s", name.encode()[:15])
            try:
                address = socket.inet_ntoa(fcntl.ioctl(sock.fileno(), 0x8915, request)[20:24])  # SIOCGIFADDR
                netmask = socket.inet_ntoa(fcntl.ioctl(sock.fileno(), 0x891B, request)[20:24])  # SIOCGIFNETMASK
            except OSError:
                continue
            prefix = ipaddress.ip_network(f"0.0.0.0/{netmask}").prefixlen
            addresses[name].append({"family": "ipv4", "address": address, "prefixlen": prefix})
    for line in (_read(os.path.join(proc_root, "net", "if_inet6")) or "").splitlines():
        fields = line.split()
        if len(fields) == 6 and fields[5] in addresses:
            address = str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))
            addresses[fields[5]].append({"family": "ipv6", "address": address, "prefixlen": int(fields[2], 16)})
    return addresses


def interface_kind(name: str, iface_dir: str, arp_type: int | None) -> str:
    """Return physical, loopback, docker, bridge, veth, vlan, bond, infiniband or virtual."""
    if arp_type == ARPHRD_LOOPBACK:
        return "loopback"
    is_bridge = os.path.isdir(os.path.join(iface_dir, "bridge"))
    if name.startswith("docker") or (is_bridge and name.startswith("br-")):
        return "docker"
    if is_bridge:
        return "bridge"
    if arp_type == ARPHRD_INFINIBAND:
        return "infiniband"
    if os.path.exists(os.path.join(iface_dir, "device")):
        return "physical"
    devtype = re.search(r"^DEVTYPE=(\w+)", _read(os.path.join(iface_dir, "uevent")) or "", re.MULTILINE)
    if devtype and devtype.group(1) in ("vlan", "bond"):
        return devtype.group(1)
    # A veth's iflink is its peer's index; other virtual links point at themselves.
    if not devtype and _read(os.path.join(iface_dir, "iflink")) != _read(os.path.join(iface_dir, "ifindex")):
        return "veth"
    return "virtual"


def describe_interface(sysfs_root: str, name: str, addresses: list[dict[str, Any]]) -> dict[str, Any]:
    """Return one interface's facts."""
    iface_dir = os.path.join(sysfs_root, "class", "net", name)

    def attr(key: str) -> str | None:
        return _read(os.path.join(iface_dir, key))

    arp_type = _int(attr("type"))
    speed = _int(attr("speed"))
    carrier = attr("carrier")
    driver_link = os.path.join(iface_dir, "device", "driver")
    device_path = os.path.realpath(os.path.join(iface_dir, "device"))
    pci = [part for part in device_path.split(os.sep) if _BDF.match(part)]
    numa = _int(attr("device/numa_node"))
    return {
        "name": name,
        "kind": interface_kind(name, iface_dir, arp_type),
        # Virtual NICs (virtio, veth) report -1 or nothing: the speed is unknown, not zero.
        "speed_mbps": speed if speed is not None and speed > 0 else None,
        "mtu": _int(attr("mtu")),
        "operstate": attr("operstate"),
        "carrier": None if carrier is None else carrier == "1",
        "mac": attr("address"),
        "driver": os.path.basename(os.readlink(driver_link)) if os.path.islink(driver_link) else None,
        "pci_bus_id": pci[-1] if pci else None,
        "numa_node": numa if numa is not None and numa >= 0 else None,
        "addresses": addresses,
    }


def describe_infiniband(sysfs_root: str) -> list[dict[str, Any]]:
    """Return every InfiniBand/RoCE device with its ports and network interfaces."""
    base = os.path.join(sysfs_root, "class", "infiniband")
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    devices = []
    for name in names:
        ports = []
        ports_dir = os.path.join(base, name, "ports")
        for port in sorted(os.listdir(ports_dir) if os.path.isdir(ports_dir) else [], key=lambda p: _int(p) or 0):
            port_dir = os.path.join(ports_dir, port)
            state = _read(os.path.join(port_dir, "state")) or ""
            phys_state = _read(os.path.join(port_dir, "phys_state")) or ""
            link_layer = _read(os.path.join(port_dir, "link_layer"))
            ports.append(
                {
                    "port": _int(port),
                    # sysfs writes "4: ACTIVE" and "5: LinkUp"; keep the words.
                    "state": state.split(":")[-1].strip() or None,
                    "phys_state": phys_state.split(":")[-1].strip() or None,
                    "rate": _read(os.path.join(port_dir, "rate")),
                    "link_layer": link_layer,
                    "kind": "roce" if link_layer == "Ethernet" else "infiniband",
                }
            )
        net_dir = os.path.join(base, name, "device", "net")
        netdevs = sorted(os.listdir(net_dir)) if os.path.isdir(net_dir) else []
        devices.append({"name": name, "ports": ports, "netdevs": netdevs})
    return devices


def endpoint(address: str, port: Any) -> str:
    """Return host:port for a dialer, an IPv6 address in brackets ([fd00::1]:29500)."""
    return f"[{address}]:{port}" if ":" in str(address) else f"{address}:{port}"


# The cluster interface: the one address per node that NCCL, gloo, the rendezvous, --local-addr,
# the firewall and the reachability check all use. Kinds that may carry it, best first: a veth
# holds the address of a container node; a bridge only when nothing else holds the cluster address
# (a NIC enslaved to br0). Docker's bridges carry it only when the rule names them, loopback only
# in a loopback subnet (a one-machine cluster).
USABLE_KINDS = ("physical", "bond", "vlan", "infiniband", "virtual", "veth", "bridge")
# Kinds whose addresses are not the node's own on the cluster network (firewall members leave them out).
NEVER_KINDS = ("loopback", "docker")
RULE_VARIABLE = "budgetgpu_cluster_interface"


def ip_or_none(text: Any) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(str(text).split("%", maxsplit=1)[0])
    except ValueError:
        return None


def global_addresses(iface: dict[str, Any], keep_loopback: bool = False) -> list[str]:
    """Return the interface's addresses, IPv4 first, without link-local (and loopback) ones."""
    found = [ip_or_none(entry.get("address", "")) for entry in iface.get("addresses") or []]
    usable = [a for a in found if a is not None and not a.is_link_local and (keep_loopback or not a.is_loopback)]
    return [str(a) for a in sorted(usable, key=lambda a: a.version)]


def in_subnet(address: str, subnet: str | None) -> bool:
    if not subnet:
        return False
    network = ipaddress.ip_network(subnet, strict=False)
    ip = ip_or_none(address)
    return ip is not None and ip.version == network.version and ip in network


def speed_text(iface: dict[str, Any]) -> str:
    speed = iface.get("speed_mbps")
    return f"{speed} Mb/s" if speed else "speed unknown"


def link_down(iface: dict[str, Any]) -> bool:
    """Return whether the link is known to be down (no carrier, or the kernel says down)."""
    return iface.get("carrier") is False or iface.get("operstate") == "down"


def match_interface_rule(interfaces: list[dict[str, Any]], rule: str) -> list[dict[str, Any]]:
    """Return the interfaces an NCCL_SOCKET_IFNAME-style rule selects (=exact, ^exclude, prefixes)."""
    rule = rule.strip()
    # NCCL reads "^" (exclude) first, then "=" (exact names): "^=eth0" leaves out eth0 alone.
    exclude = rule.startswith("^")
    rule = rule[1:] if exclude else rule
    exact = rule.startswith("=")
    words = tuple(w.strip() for w in (rule[1:] if exact else rule).split(",") if w.strip())

    def named(iface: dict[str, Any]) -> bool:
        return iface["name"] in words if exact else iface["name"].startswith(words)

    return [i for i in interfaces if named(i) != exclude]


def _rank(pair: tuple[dict[str, Any], str], subnet: str | None) -> tuple[int, int, int]:
    """Sort key: an address in the subnet first, then the better kind, then the faster link."""
    iface, address = pair
    kind = iface.get("kind", "virtual")
    kind_rank = USABLE_KINDS.index(kind) if kind in USABLE_KINDS else len(USABLE_KINDS)
    return (0 if in_subnet(address, subnet) else 1, kind_rank, -(iface.get("speed_mbps") or 0))


def _label(iface: dict[str, Any]) -> str:
    speed = iface.get("speed_mbps")
    down = " with its carrier down" if link_down(iface) else ""
    return f"{iface['name']} ({iface.get('kind')}{f', {speed} Mb/s' if speed else ''}){down}"


def _candidates(
    interfaces: list[dict[str, Any]], subnet: str | None, rule: str | None
) -> tuple[list[tuple[dict[str, Any], str]], list[str]]:
    """Return ([(interface, address)] that may carry the cluster address, [refused "name (why)"])."""
    candidates, refused = [], []
    # Docker's bridges (and, without a subnet, any bridge) carry it only when the rule names them.
    named = bool(rule) and not rule.strip().startswith("^")
    for iface in interfaces:
        addresses = global_addresses(iface, keep_loopback=bool(subnet))
        if subnet and not rule:
            addresses = [a for a in addresses if in_subnet(a, subnet)]
        if not addresses:
            continue
        unnamed_kind = not named and iface.get("kind") in ("docker",) + (() if subnet else ("bridge",))
        if unnamed_kind or link_down(iface):
            refused.append(_label(iface))
        else:
            address = next((a for a in addresses if in_subnet(a, subnet)), addresses[0])
            candidates.append((iface, address))
    return candidates, refused


def _kind_note(iface: dict[str, Any]) -> str:
    kind = iface.get("kind")
    if kind == "veth":
        return ", veth: this node is a container"
    if kind == "bridge":
        return ", a bridge: the only interface with the cluster address"
    return ""


def _why_none(interfaces: list[dict[str, Any]], subnet: str | None, rule: str | None, refused: list[str]) -> str:
    """Return the error when no interface may carry the cluster address: what was found, what to fix."""
    seen = ", ".join(
        f"{i['name']} {'/'.join(global_addresses(i)) or 'no address'}{' (carrier down)' if link_down(i) else ''}"
        for i in interfaces
        if i.get("kind") != "loopback"
    )
    if rule:
        return (
            f"inventory asks for interface '{rule}' ({RULE_VARIABLE}), but no interface with an address matches "
            f"it with its link up (interfaces: {seen or 'none'}): fix {RULE_VARIABLE}"
        )
    detail = f"; {', '.join(refused)} hold it but NCCL must not use them" if refused else ""
    if subnet:
        return (
            f"no usable interface has an address in the cluster subnet {subnet} (found: {seen or 'none'}){detail}: "
            f"fix budgetgpu_cluster_subnet or set {RULE_VARIABLE}"
        )
    return (
        "no network interface with an address and a link besides loopback, docker and bridges "
        f"(found: {seen or 'none'}): set budgetgpu_cluster_subnet or {RULE_VARIABLE}"
    )


def _warnings(chosen: dict[str, Any], address: str, interfaces: list[dict[str, Any]], subnet: str | None) -> list[str]:
    """Warn about a chosen address outside the subnet, or a faster NIC that does not carry it."""
    if subnet and not in_subnet(address, subnet):
        return [
            f"{chosen['name']} ({address}) is outside the cluster subnet {subnet}: peers reach it only if they "
            "have a route to it"
        ]
    faster = [
        i
        for i in interfaces
        if i.get("kind") in ("physical", "bond")
        and (i.get("speed_mbps") or 0) > (chosen.get("speed_mbps") or 0)
        and not link_down(i)
    ]
    if not (subnet and faster and chosen.get("speed_mbps")):
        return []
    best = max(faster, key=lambda i: i.get("speed_mbps") or 0)
    return [
        f"{best['name']} ({speed_text(best)}) is faster than {chosen['name']} ({speed_text(chosen)}) but does not "
        f"carry the cluster subnet {subnet}: move the cluster addresses to {best['name']} or set {RULE_VARIABLE}"
    ]


def choose_cluster_interface(
    interfaces: list[dict[str, Any]], subnet: str | None = None, rule: str | None = None
) -> dict[str, Any]:
    """Return {interface: {name, address, prefixlen, kind, speed_mbps, reason, warnings} or None, error}.

    rule: an NCCL_SOCKET_IFNAME-style rule (eth1, =eth1, ^docker,lo, ^=eth0, enp) that limits the
    choice; without one, the interfaces holding an address in subnet (any, without a subnet). A link
    that is down is never chosen; among the rest an address in the subnet, the kind, then the speed win.
    """
    # Loopback only where the inventory's subnet is a loopback network (a one-machine cluster).
    loopback_subnet = bool(subnet) and ipaddress.ip_network(subnet, strict=False).is_loopback
    named = [i for i in interfaces if i.get("name") and (i.get("kind") != "loopback" or loopback_subnet)]
    pool = match_interface_rule(named, rule) if rule else named
    candidates, refused = _candidates(pool, subnet, rule)
    if not candidates:
        return {"interface": None, "error": _why_none(named, subnet, rule, refused)}
    candidates.sort(key=lambda pair: _rank(pair, subnet))
    chosen, address = candidates[0]
    if rule:
        where = f"set by inventory ({RULE_VARIABLE}={rule}), {address}"
    elif subnet:
        where = f"holds the cluster address {address} in {subnet}"
    else:
        where = f"fastest interface with an address (no budgetgpu_cluster_subnet set), {address}"
    carrier = ", carrier up" if chosen.get("carrier") else ""
    others = [_label(i) for i, _rank in candidates[1:]] + refused
    passed = f"; passed over {', '.join(others)}" if others else ""
    prefixlen = next((e.get("prefixlen") for e in chosen.get("addresses") or [] if e.get("address") == address), None)
    return {
        "interface": {
            "name": chosen["name"],
            "address": address,
            "prefixlen": prefixlen,
            "kind": chosen.get("kind"),
            "speed_mbps": chosen.get("speed_mbps"),
            "reason": f"{where}{carrier}, {speed_text(chosen)}{_kind_note(chosen)}{passed}",
            "warnings": _warnings(chosen, address, interfaces, subnet),
        },
        "error": None,
    }


def probe_net(
    sysfs_root: str = "/sys",
    addresses: dict[str, list[dict[str, Any]]] | None = None,
    cluster_subnet: str | None = None,
    interface_rule: str | None = None,
) -> dict[str, Any]:
    """Return {interfaces, infiniband, cluster_subnet, interface_rule, cluster_interface, cluster_interface_error}."""
    net_dir = os.path.join(sysfs_root, "class", "net")
    try:
        names = sorted(os.listdir(net_dir))
    except OSError:
        names = []
    addresses = addresses or {}
    interfaces = [describe_interface(sysfs_root, name, addresses.get(name, [])) for name in names]
    cluster = choose_cluster_interface(interfaces, cluster_subnet, interface_rule or None)
    return {
        "interfaces": interfaces,
        "infiniband": describe_infiniband(sysfs_root),
        "cluster_subnet": cluster_subnet,
        "interface_rule": interface_rule or None,
        "cluster_interface": cluster["interface"],
        "cluster_interface_error": cluster["error"],
    }
