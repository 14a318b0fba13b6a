"""Network interfaces, InfiniBand/RoCE devices and the cluster interface, from sysfs and `ip`.

Plain standard-library Python with no imports from the rest of the collection (scripts/gpu-probe
loads this file by path). Addresses come from `ip -j addr` output that the caller collects
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


_CLUSTER_PREFERENCE = {"veth": 1, "bridge": 2, "docker": 3, "loopback": 4}


def endpoint(address: str, port: Any) -> str:
    """Return host:port for a dialer, an IPv6 address in brackets ([fd00::1]:29500)."""
    return f"[{address}]:{port}" if ":" in str(address) else f"{address}:{port}"


def find_cluster_interface(interfaces: list[dict[str, Any]], subnet: str) -> dict[str, Any] | None:
    """Return {name, address, prefixlen} of the interface holding an address in subnet, or None."""
    network = ipaddress.ip_network(subnet, strict=False)
    # A broad subnet (172.16.0.0/12) can also hold docker0's or a bridge's address: the NIC
    # that carries the cluster address wins over them, loopback comes last.
    for iface in sorted(interfaces, key=lambda i: _CLUSTER_PREFERENCE.get(i["kind"], 0)):
        for entry in iface["addresses"]:
            address = ipaddress.ip_address(entry["address"].split("%")[0])
            if address.version == network.version and address in network:
                return {"name": iface["name"], "address": entry["address"], "prefixlen": entry["prefixlen"]}
    return None


def probe_net(
    sysfs_root: str = "/sys",
    addresses: dict[str, list[dict[str, Any]]] | None = None,
    cluster_subnet: str | None = None,
) -> dict[str, Any]:
    """Return {interfaces, infiniband, cluster_subnet, cluster_interface}."""
    net_dir = os.path.join(sysfs_root, "class", "net")
    try:
        names = sorted(os.listdir(net_dir))
    except OSError:
        names = []
    addresses = addresses or {}
    interfaces = [describe_interface(sysfs_root, name, addresses.get(name, [])) for name in names]
    cluster = find_cluster_interface(interfaces, cluster_subnet) if cluster_subnet else None
    return {
        "interfaces": interfaces,
        "infiniband": describe_infiniband(sysfs_root),
        "cluster_subnet": cluster_subnet,
        "cluster_interface": cluster,
    }
