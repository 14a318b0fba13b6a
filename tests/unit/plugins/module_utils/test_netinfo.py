"""netinfo: interfaces, kinds, InfiniBand and the cluster interface on sysfs trees."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ansible_collections.budgetgpu.cluster.plugins.module_utils import netinfo

H200 = Path(__file__).resolve().parents[3] / "fixtures" / "h200-node"


def make_iface(root: Path, name: str, *, device: str | None = None, driver: str | None = None, **attrs: str) -> Path:
    """Create class/net/<name> -> devices/.../net/<name> with the given attribute files."""
    parent = root / (device or "devices/virtual") / "net" / name
    parent.mkdir(parents=True)
    for key, value in attrs.items():
        if key == "bridge":
            (parent / "bridge").mkdir()
        else:
            (parent / key).write_text(f"{value}\n")
    if device:
        (parent / "device").symlink_to(root / device)
        if driver:
            (root / "bus" / "drivers" / driver).mkdir(parents=True, exist_ok=True)
            (root / device / "driver").symlink_to(root / "bus" / "drivers" / driver)
    (root / "class" / "net").mkdir(parents=True, exist_ok=True)
    (root / "class" / "net" / name).symlink_to(parent)
    return parent


def h200_net_tree(root: Path) -> None:
    """The reference node's interfaces as net.txt lists them (speed unreadable where it says so)."""
    for line in (H200 / "net.txt").read_text().splitlines():
        name = line.split()[0]
        fields = dict(re.findall(r"(\w+)=(\S+)", line))
        attrs = {
            "mtu": fields["mtu"],
            "type": fields["type"],
            "operstate": fields["oper"],
            "ifindex": "1",
            "iflink": "1",
        }
        if fields["speed"].lstrip("-").isdigit():
            attrs["speed"] = fields["speed"]
        device = fields["dev"][len("/sys/") :] if "virtual" not in fields["dev"] else None
        make_iface(root, name, device=device, driver="virtio_net" if device else None, **attrs)


def test_reference_node_interfaces(tmp_path):
    h200_net_tree(tmp_path)
    facts = netinfo.probe_net(str(tmp_path))
    by_name = {iface["name"]: iface for iface in facts["interfaces"]}
    assert sorted(by_name) == ["eth0", "ifb0", "ifb1", "lo"]
    eth0 = by_name["eth0"]
    assert eth0["kind"] == "physical" and eth0["driver"] == "virtio_net"
    assert eth0["speed_mbps"] is None  # virtio reports -1: unknown, not an error
    assert eth0["mtu"] == 1400 and eth0["operstate"] == "up"
    assert eth0["pci_bus_id"] == "0000:00:03.0"
    assert by_name["lo"]["kind"] == "loopback" and by_name["lo"]["mtu"] == 65536
    assert by_name["ifb0"]["kind"] == "virtual" and by_name["ifb0"]["speed_mbps"] is None
    assert facts["infiniband"] == []


def test_kinds_bridge_docker_veth(tmp_path):
    make_iface(tmp_path, "enp1s0f0", device="devices/pci0000:00/0000:00:1c.0/0000:01:00.0", driver="ixgbe",
               speed="10000", carrier="1", type="1", mtu="9000", ifindex="2", iflink="2")  # fmt: skip
    make_iface(tmp_path, "br0", bridge=True, type="1", ifindex="3", iflink="3", uevent="DEVTYPE=bridge")
    make_iface(tmp_path, "docker0", bridge=True, type="1", ifindex="4", iflink="4", uevent="DEVTYPE=bridge")
    make_iface(tmp_path, "br-3f2a1b4c5d6e", bridge=True, type="1", ifindex="5", iflink="5")
    make_iface(tmp_path, "veth12ab", type="1", ifindex="6", iflink="7", uevent="INTERFACE=veth12ab")
    make_iface(tmp_path, "bond0", type="1", ifindex="8", iflink="8", uevent="DEVTYPE=bond")
    kinds = {iface["name"]: iface["kind"] for iface in netinfo.probe_net(str(tmp_path))["interfaces"]}
    assert kinds == {
        "enp1s0f0": "physical",
        "br0": "bridge",
        "docker0": "docker",
        "br-3f2a1b4c5d6e": "docker",
        "veth12ab": "veth",
        "bond0": "bond",
    }
    nic = next(iface for iface in netinfo.probe_net(str(tmp_path))["interfaces"] if iface["name"] == "enp1s0f0")
    assert (nic["speed_mbps"], nic["carrier"], nic["mtu"], nic["driver"]) == (10000, True, 9000, "ixgbe")
    assert nic["pci_bus_id"] == "0000:01:00.0"


def test_infiniband_and_roce_ports(tmp_path):
    for name, layer, state, netdev in (
        ("mlx5_0", "InfiniBand", "4: ACTIVE", "ib0"),
        ("mlx5_1", "Ethernet", "1: DOWN", "enp65s0f1"),
    ):
        port = tmp_path / "class" / "infiniband" / name / "ports" / "1"
        port.mkdir(parents=True)
        (port / "state").write_text(f"{state}\n")
        (port / "phys_state").write_text("5: LinkUp\n" if "ACTIVE" in state else "3: Disabled\n")
        (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
        (port / "link_layer").write_text(f"{layer}\n")
        (tmp_path / "class" / "infiniband" / name / "device" / "net" / netdev).mkdir(parents=True)
    ib = netinfo.probe_net(str(tmp_path))["infiniband"]
    assert ib == [
        {
            "name": "mlx5_0",
            "ports": [{"port": 1, "state": "ACTIVE", "phys_state": "LinkUp", "rate": "200 Gb/sec (4X HDR)",
                       "link_layer": "InfiniBand", "kind": "infiniband"}],
            "netdevs": ["ib0"],
        },
        {
            "name": "mlx5_1",
            "ports": [{"port": 1, "state": "DOWN", "phys_state": "Disabled", "rate": "200 Gb/sec (4X HDR)",
                       "link_layer": "Ethernet", "kind": "roce"}],
            "netdevs": ["enp65s0f1"],
        },
    ]  # fmt: skip


IP_JSON = json.dumps(
    [
        {"ifname": "lo", "addr_info": [{"family": "inet", "local": "127.0.0.1", "prefixlen": 8}]},
        {
            "ifname": "eth0",
            "addr_info": [
                {"family": "inet", "local": "10.10.0.12", "prefixlen": 24},
                {"family": "inet6", "local": "fe80::1", "prefixlen": 64},
            ],
        },
        {"ifname": "docker0", "addr_info": [{"family": "inet", "local": "172.17.0.1", "prefixlen": 16}]},
        {"ifname": "ifb0", "addr_info": []},
    ]
)


def test_cluster_interface_is_the_one_holding_an_address_in_the_subnet(tmp_path):
    h200_net_tree(tmp_path)
    addresses = netinfo.parse_ip_addr_json(IP_JSON)
    assert addresses["eth0"][1] == {"family": "ipv6", "address": "fe80::1", "prefixlen": 64}
    facts = netinfo.probe_net(str(tmp_path), addresses, "10.10.0.0/24")
    chosen = facts["cluster_interface"]
    assert {k: chosen[k] for k in ("name", "address", "prefixlen")} == {
        "name": "eth0",
        "address": "10.10.0.12",
        "prefixlen": 24,
    }
    assert netinfo.probe_net(str(tmp_path), addresses, "192.168.7.0/24")["cluster_interface"] is None
    assert netinfo.probe_net(str(tmp_path), addresses, "10.10.0.5/24")["cluster_interface"]["name"] == "eth0"


def test_fallback_reads_loopback_without_iproute2():
    addresses = netinfo.read_addresses_fallback(["lo", "no-such-if0"])
    assert {"family": "ipv4", "address": "127.0.0.1", "prefixlen": 8} in addresses["lo"]
    assert addresses["no-such-if0"] == []


def test_cluster_interface_prefers_the_nic_over_docker0_in_a_broad_subnet():
    def iface(name, kind, address):
        return {"name": name, "kind": kind, "addresses": [{"address": address, "prefixlen": 16}]}

    interfaces = [
        iface("docker0", "docker", "172.17.0.1"),
        iface("br-extra", "bridge", "172.30.0.1"),
        iface("eth0", "physical", "172.24.0.2"),
    ]
    assert netinfo.choose_cluster_interface(interfaces, "172.16.0.0/12")["interface"]["name"] == "eth0"
    assert netinfo.choose_cluster_interface(interfaces[:2], "172.16.0.0/12")["interface"]["name"] == "br-extra"


# -- the cluster interface: one decision for NCCL, gloo, the rendezvous and the firewall ------------


def nic(name, *addresses, kind="physical", speed=None, carrier=True, prefix=24):
    return {
        "name": name,
        "kind": kind,
        "speed_mbps": speed,
        "operstate": "up" if carrier else "down",
        "carrier": carrier,
        "addresses": [{"family": "ipv4", "address": a, "prefixlen": prefix} for a in addresses],
    }


SUBNET = "10.0.0.0/24"


def test_the_10g_port_beats_the_1g_port_in_the_same_subnet():
    # find_cluster_interface took the first by kind and name (eth0, 1GbE) while NCCL took the
    # 10GbE port: the rendezvous and --local-addr went over the slow link.
    interfaces = [nic("eth0", "10.0.0.5", speed=1000), nic("eth1", "10.0.0.15", speed=10000)]
    chosen = netinfo.choose_cluster_interface(interfaces, SUBNET)["interface"]
    assert (chosen["name"], chosen["address"], chosen["speed_mbps"]) == ("eth1", "10.0.0.15", 10000)
    assert chosen["reason"] == (
        "holds the cluster address 10.0.0.15 in 10.0.0.0/24, carrier up, 10000 Mb/s; "
        "passed over eth0 (physical, 1000 Mb/s)"
    )


def test_probe_net_reports_the_faster_port_as_the_cluster_interface(tmp_path):
    for index, (name, speed) in enumerate((("eth0", "1000"), ("eth1", "10000")), start=2):
        make_iface(tmp_path, name, device=f"devices/pci0000:00/0000:00:0{index}.0", speed=speed, carrier="1",
                   type="1", operstate="up", ifindex=str(index), iflink=str(index))  # fmt: skip
    addresses = {
        "eth0": [{"family": "ipv4", "address": "10.0.0.5", "prefixlen": 24}],
        "eth1": [{"family": "ipv4", "address": "10.0.0.15", "prefixlen": 24}],
    }
    facts = netinfo.probe_net(str(tmp_path), addresses, SUBNET)
    assert facts["cluster_interface"]["address"] == "10.0.0.15"
    assert facts["cluster_interface_error"] is None


def test_a_port_whose_carrier_is_down_is_never_chosen():
    # The old picker ignored link state: the only port in the subnet was taken with its cable out.
    down = nic("eth1", "10.0.0.15", speed=10000, carrier=False)
    chosen = netinfo.choose_cluster_interface([nic("eth0", "10.0.0.5", speed=1000), down], SUBNET)["interface"]
    assert chosen["name"] == "eth0"
    assert "passed over eth1 (physical, 10000 Mb/s) with its carrier down" in chosen["reason"]
    alone = netinfo.choose_cluster_interface([down], SUBNET)
    assert alone["interface"] is None
    assert "eth1 10.0.0.15 (carrier down)" in alone["error"]
    assert netinfo.choose_cluster_interface([down], SUBNET, "=eth1")["interface"] is None


def test_the_interface_rule_in_its_short_forms():
    interfaces = [
        nic("eth0", "10.0.0.5", speed=10000),
        nic("eth1", "10.0.0.6", speed=1000),
        nic("eth10", "192.168.5.6", speed=1000),
        nic("docker0", "10.0.0.1", kind="docker"),
    ]

    def name(rule):
        return (netinfo.choose_cluster_interface(interfaces, SUBNET, rule)["interface"] or {}).get("name")

    assert name(None) == "eth0"
    assert name("eth1") == "eth1"  # a prefix: eth1 and eth10; the one in the subnet wins
    assert name("=eth10") == "eth10"  # exact
    assert name("^docker,eth0") == "eth1"  # exclusion of prefixes
    assert name("^=eth0") == "eth1"  # exact exclusion: "^=eth0" is not the prefix "=eth0"
    assert name("^=eth0,eth1") == "eth10"
    assert name("=eth") is None
    chosen = netinfo.choose_cluster_interface(interfaces, SUBNET, "=eth10")["interface"]
    assert chosen["reason"].startswith("set by inventory (budgetgpu_cluster_interface==eth10), 192.168.5.6")
    assert "outside the cluster subnet 10.0.0.0/24" in chosen["warnings"][0]
    error = netinfo.choose_cluster_interface(interfaces, SUBNET, "enp")["error"]
    assert "inventory asks for interface 'enp' (budgetgpu_cluster_interface)" in error
    assert "fix budgetgpu_cluster_interface" in error


def test_probe_net_passes_the_rule_and_reports_it(tmp_path):
    for index, name in enumerate(("eth0", "eth1"), start=2):
        make_iface(tmp_path, name, device=f"devices/pci0000:00/0000:00:0{index}.0", speed="10000", carrier="1",
                   type="1", operstate="up", ifindex=str(index), iflink=str(index))  # fmt: skip
    addresses = {
        "eth0": [{"family": "ipv4", "address": "10.0.0.5", "prefixlen": 24}],
        "eth1": [{"family": "ipv4", "address": "172.30.0.5", "prefixlen": 16}],
    }
    facts = netinfo.probe_net(str(tmp_path), addresses, SUBNET, "=eth1")
    assert facts["interface_rule"] == "=eth1"
    assert (facts["cluster_interface"]["name"], facts["cluster_interface"]["prefixlen"]) == ("eth1", 16)


def test_the_ephemeral_port_range_is_the_kernels_two_numbers(tmp_path):
    path = tmp_path / "ip_local_port_range"
    path.write_text("32768\t60999\n")
    assert netinfo.ephemeral_ports(str(path)) == [32768, 60999]
    for text in ("32768\n", "low high\n"):
        path.write_text(text)
        assert netinfo.ephemeral_ports(str(path)) is None
    assert netinfo.ephemeral_ports(str(tmp_path / "missing")) is None
