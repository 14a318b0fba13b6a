"""Unit tests for the NCCL network decisions on fact-shaped dicts (budgetgpu_net, _gpus, _pcie).

budgetgpu_net's cluster_interface is filled in as net_facts does (netinfo.choose_cluster_interface),
so that these tests go through the one address decision.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from ansible_collections.budgetgpu.cluster.plugins.module_utils.netinfo import choose_cluster_interface
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils import nccl
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.nodes import node_info

SUBNET = "192.168.10.0/24"


def iface(
    name: str, kind: str, *addresses: str, speed: int | None = None, carrier: bool | None = True, prefix: int = 24
) -> dict[str, Any]:
    return {
        "name": name,
        "kind": kind,
        "speed_mbps": speed,
        "mtu": 1500,
        "operstate": "up" if carrier else "down",
        "carrier": carrier,
        "driver": None,
        "addresses": [
            {"family": "ipv6" if ":" in a else "ipv4", "address": a, "prefixlen": 64 if ":" in a else prefix}
            for a in addresses
        ],
    }


def net(
    *interfaces: dict[str, Any],
    infiniband: list[dict[str, Any]] | None = None,
    subnet: str | None = SUBNET,
    rule: str | None = None,
) -> dict[str, Any]:
    chosen = choose_cluster_interface(list(interfaces), subnet, rule)
    return {
        "interfaces": list(interfaces),
        "infiniband": infiniband or [],
        "cluster_subnet": subnet,
        "interface_rule": rule,
        "cluster_interface": chosen["interface"],
        "cluster_interface_error": chosen["error"],
    }


def with_rule(facts: dict[str, Any], rule: str) -> dict[str, Any]:
    """The same node probed with budgetgpu_cluster_interface set to rule."""
    return net(*facts["interfaces"], infiniband=facts["infiniband"], subnet=facts["cluster_subnet"], rule=rule)


def ib_device(name: str = "mlx5_0", state: str = "ACTIVE", kind: str = "infiniband") -> dict[str, Any]:
    link_layer = "Ethernet" if kind == "roce" else "InfiniBand"
    return {
        "name": name,
        "ports": [
            {
                "port": 1,
                "state": state,
                "phys_state": "LinkUp",
                "rate": "100 Gb/sec",
                "link_layer": link_layer,
                "kind": kind,
            }
        ],
        "netdevs": ["ib0"],
    }


LOOPBACK = iface("lo", "loopback", "127.0.0.1", "::1", speed=None, carrier=True, prefix=8)
DOCKER0 = iface("docker0", "docker", "172.17.0.1", carrier=False, prefix=16)
VETH_HOST = iface("veth3f2a1b", "veth", speed=10000)
BR0 = iface("br0", "bridge", "10.99.0.1")


def gpus(*names: str, nvlinks: int | str = "unsupported") -> dict[str, Any]:
    return {
        "driver": {"state": "loaded", "loaded": True},
        "count": len(names),
        "gpus": [
            {"index": i, "name": f"NVIDIA {n}", "bus_id": f"0000:0{i + 1}:00.0", "nvlinks_active": nvlinks}
            for i, n in enumerate(names)
        ],
    }


def pcie(count: int, switch: bool = False, names: list[str] | None = None) -> dict[str, Any]:
    hops = [{"bus_id": "0000:00:01.0", "role": "root_port"}]
    if switch:
        hops += [
            {"bus_id": "0000:10:00.0", "role": "switch_upstream"},
            {"bus_id": "0000:11:00.0", "role": "switch_downstream"},
        ]
    return {
        "count": count,
        "gpus": [
            {
                "bus_id": f"0000:0{i + 1}:00.0",
                "name": (names or ["GeForce RTX 3090"] * count)[i],
                "path": [*hops, {"bus_id": f"0000:0{i + 1}:00.0", "role": "gpu"}],
            }
            for i in range(count)
        ],
    }


class TestInterface:
    def test_picks_the_cluster_nic_over_docker_bridge_and_veth(self) -> None:
        facts = net(LOOPBACK, DOCKER0, VETH_HOST, BR0, iface("eno1", "physical", "192.168.10.12", speed=10000))
        decision = nccl.nccl_env(facts)
        assert decision["errors"] == []
        assert decision["interface"] == "eno1"
        assert decision["address"] == "192.168.10.12"
        assert decision["env"]["NCCL_SOCKET_IFNAME"] == "=eno1"
        assert decision["env"]["GLOO_SOCKET_IFNAME"] == "eno1"
        assert decision["summary"].startswith("NCCL on eno1 (10000 Mb/s), Socket transport: no InfiniBand device")

    def test_prefers_a_nic_over_a_bridge_holding_a_cluster_address_too(self) -> None:
        bridge = iface("br0", "bridge", "192.168.10.200", prefix=32, carrier=False)
        facts = net(bridge, iface("eth0", "veth", "192.168.10.3", speed=10000))
        decision = nccl.nccl_env(facts)
        assert decision["interface"] == "eth0"
        assert "veth: this node is a container" in decision["reasons"][0]
        assert "passed over br0 (bridge)" in decision["reasons"][0]

    def test_uses_a_bridge_only_when_nothing_else_holds_the_cluster_address(self) -> None:
        facts = net(iface("enp3s0", "physical", speed=10000), iface("br0", "bridge", "192.168.10.5"))
        decision = nccl.nccl_env(facts)
        assert decision["interface"] == "br0"
        assert "only interface with the cluster address" in decision["reasons"][0]

    def test_never_uses_docker0_or_loopback_even_in_the_subnet(self) -> None:
        facts = net(LOOPBACK, iface("docker0", "docker", "192.168.10.1"), subnet=SUBNET)
        decision = nccl.nccl_env(facts)
        assert decision["interface"] is None
        assert "docker0 (docker) hold it but NCCL must not use them" in decision["errors"][0]
        assert "fix budgetgpu_cluster_subnet" in decision["errors"][0]

    def test_1g_and_10g_node_both_in_the_subnet_takes_the_10g(self) -> None:
        facts = net(
            iface("eno1", "physical", "192.168.10.7", speed=1000),
            iface("enp5s0f0", "physical", "192.168.10.17", speed=10000),
        )
        decision = nccl.nccl_env(facts)
        assert decision["interface"] == "enp5s0f0"
        assert decision["address"] == "192.168.10.17"
        assert decision["speed_mbps"] == 10000

    def test_1g_cluster_nic_with_an_idle_10g_warns(self) -> None:
        facts = net(
            iface("eno1", "physical", "192.168.10.7", speed=1000),
            iface("enp5s0f0", "physical", "10.0.0.7", speed=10000),
        )
        decision = nccl.nccl_env(facts)
        assert decision["interface"] == "eno1"
        assert decision["warnings"] and "enp5s0f0 (10000 Mb/s) is faster than eno1" in decision["warnings"][0]

    def test_link_down_loses_to_link_up(self) -> None:
        facts = net(
            iface("enp1", "physical", "192.168.10.7", speed=10000, carrier=False),
            iface("enp2", "physical", "192.168.10.8", speed=1000),
        )
        assert nccl.nccl_env(facts)["interface"] == "enp2"

    def test_no_subnet_falls_back_to_the_fastest_nic(self) -> None:
        facts = net(
            LOOPBACK,
            DOCKER0,
            BR0,
            iface("eno1", "physical", "10.1.1.1", speed=1000),
            iface("enp5s0", "physical", "10.2.2.2", speed=25000),
            subnet=None,
        )
        decision = nccl.nccl_env(facts)
        assert decision["interface"] == "enp5s0"
        assert "no budgetgpu_cluster_subnet" in decision["reasons"][0]

    def test_missing_subnet_address_names_what_was_found(self) -> None:
        facts = net(LOOPBACK, iface("eth0", "physical", "10.0.0.5"))
        decision = nccl.nccl_env(facts)
        assert decision["errors"] and "eth0 10.0.0.5" in decision["errors"][0]
        assert decision["env"] == {}


class TestOverrides:
    FACTS = net(iface("eth0", "veth", "192.168.10.3", speed=10000), iface("eth1", "veth", "172.30.0.3", speed=10000))

    def test_inventory_interface_wins_over_the_probe(self) -> None:
        decision = nccl.nccl_env(with_rule(self.FACTS, "eth1"))
        assert decision["interface"] == "eth1"
        assert decision["address"] == "172.30.0.3"
        assert decision["env"]["NCCL_SOCKET_IFNAME"] == "=eth1"
        assert decision["env"]["GLOO_SOCKET_IFNAME"] == "eth1"
        assert "set by inventory" in decision["reasons"][0]
        assert "outside the cluster subnet" in decision["warnings"][0]

    def test_exact_form_override_resolves_the_same(self) -> None:
        assert nccl.nccl_env(with_rule(self.FACTS, "=eth1"))["interface"] == "eth1"

    def test_exact_exclusion_leaves_out_that_interface_alone(self) -> None:
        # NCCL's "^=eth0": not eth0, exactly. Read as the prefix "=eth0" it excluded nothing.
        facts = net(iface("eth0", "veth", "192.168.10.3"), iface("eth01", "veth", "172.30.0.3"))
        assert nccl.nccl_env(with_rule(facts, "^=eth0"))["interface"] == "eth01"
        assert nccl.nccl_env(with_rule(facts, "^eth0"))["errors"]  # the prefix form leaves out both

    def test_env_override_of_ifname_is_refused_naming_the_cluster_interface_rule(self) -> None:
        # It would move NCCL off the address the rendezvous and the firewall use: one rule, one place.
        decision = nccl.nccl_env(self.FACTS, overrides={"NCCL_SOCKET_IFNAME": "=eth1"})
        assert decision["env"] == {}
        assert "expected the interface rule in budgetgpu_cluster_interface" in decision["errors"][0]
        assert "found NCCL_SOCKET_IFNAME==eth1" in decision["errors"][0]

    def test_override_to_a_missing_interface_is_an_error(self) -> None:
        decision = nccl.nccl_env(with_rule(self.FACTS, "enp9s0"))
        assert "no interface with an address matches it" in decision["errors"][0]

    def test_env_overrides_win_and_none_removes(self) -> None:
        facts = net(iface("eno1", "physical", "192.168.10.2", speed=10000))
        decision = nccl.nccl_env(
            facts,
            gpus("GeForce RTX 3090", "GeForce RTX 3090"),
            pcie(2),
            overrides={"NCCL_P2P_DISABLE": 0, "NCCL_NET": None, "NCCL_DEBUG": "INFO"},
        )
        assert decision["env"]["NCCL_P2P_DISABLE"] == "0"
        assert "NCCL_NET" not in decision["env"]
        assert decision["env"]["NCCL_DEBUG"] == "INFO"
        assert "P2P on: set by inventory" in decision["summary"]


class TestTransport:
    ETH = iface("eno1", "physical", "192.168.10.2", speed=10000)

    def test_no_ib_disables_ib_and_forces_socket(self) -> None:
        env = nccl.nccl_env(net(self.ETH))["env"]
        assert env["NCCL_IB_DISABLE"] == "1"
        assert env["NCCL_NET"] == "Socket"

    def test_active_ib_everywhere_keeps_ib(self) -> None:
        facts = net(self.ETH, infiniband=[ib_device()])
        decision = nccl.nccl_env(facts, cluster_net={"node2": net(infiniband=[ib_device()])})
        assert decision["transport"] == "IB"
        assert decision["env"]["NCCL_IB_DISABLE"] == "0"
        assert decision["env"]["NCCL_IB_HCA"] == "=mlx5_0:1"
        assert "InfiniBand mlx5_0:1 active on every node" in decision["summary"]

    def test_roce_is_named(self) -> None:
        decision = nccl.nccl_env(net(self.ETH, infiniband=[ib_device(kind="roce")]))
        assert "RoCE" in decision["summary"]

    def test_ib_port_down_means_socket(self) -> None:
        decision = nccl.nccl_env(net(self.ETH, infiniband=[ib_device(state="DOWN")]))
        assert decision["env"]["NCCL_NET"] == "Socket"
        assert "has no ACTIVE port" in decision["summary"]

    def test_a_peer_without_ib_forces_socket_everywhere(self) -> None:
        facts = net(self.ETH, infiniband=[ib_device()])
        decision = nccl.nccl_env(facts, cluster_net={"node3": net(), "node2": net(infiniband=[ib_device()])})
        assert decision["env"]["NCCL_NET"] == "Socket"
        assert "node3 lack an active InfiniBand port" in decision["summary"]


class TestP2P:
    ETH = iface("eth1", "physical", "192.168.10.3", speed=10000)

    def test_issue_example_geforce_behind_switch(self) -> None:
        decision = nccl.nccl_env(net(self.ETH), gpus(*["GeForce RTX 3090"] * 4), pcie(4, switch=True))
        assert decision["env"]["NCCL_P2P_DISABLE"] == "1"
        assert decision["summary"] == (
            "NCCL on eth1 (10000 Mb/s), Socket transport: no InfiniBand device; "
            "P2P off: GeForce RTX 3090 behind PCIe switch: GeForce cards have no PCIe P2P"
        )

    def test_geforce_across_root_ports(self) -> None:
        decision = nccl.decide_p2p(gpus("GeForce RTX 4090", "GeForce RTX 4090"), pcie(2))
        assert decision == {
            "disable": True,
            "reason": "GeForce RTX 4090 across PCIe root ports: GeForce cards have no PCIe P2P",
        }

    def test_mixed_models(self) -> None:
        decision = nccl.decide_p2p(gpus("GeForce RTX 3090", "GeForce RTX 4090"), pcie(2))
        assert decision["disable"] is True
        assert "mixed GPU models GeForce RTX 3090 + GeForce RTX 4090" in decision["reason"]

    def test_datacenter_behind_switch_is_off(self) -> None:
        decision = nccl.decide_p2p(gpus("A100 PCIe 80GB", "A100 PCIe 80GB"), pcie(2, switch=True))
        assert decision == {"disable": True, "reason": "A100 PCIe 80GB behind PCIe switch"}

    def test_datacenter_on_root_ports_keeps_p2p(self) -> None:
        assert nccl.decide_p2p(gpus("RTX A6000", "RTX A6000"), pcie(2))["disable"] is False

    def test_nvlink_keeps_p2p(self) -> None:
        decision = nccl.decide_p2p(gpus("H100 SXM5 80GB", "H100 SXM5 80GB", nvlinks=18), pcie(2, switch=True))
        assert decision["disable"] is False
        assert "NVLink" in decision["reason"]

    def test_one_gpu_leaves_p2p_unset(self) -> None:
        decision = nccl.nccl_env(net(self.ETH), gpus("H200"), pcie(1, names=["H200"]))
        assert "NCCL_P2P_DISABLE" not in decision["env"]
        assert decision["summary"].endswith("P2P unset: one GPU, P2P not used")

    def test_driver_not_loaded_falls_back_to_pcie_names(self) -> None:
        no_driver = {"driver": {"state": "not_loaded"}, "count": 0, "gpus": []}
        decision = nccl.decide_p2p(no_driver, pcie(2, switch=True))
        assert decision["disable"] is True
        assert "GeForce RTX 3090 behind PCIe switch" in decision["reason"]

    def test_one_nvlink_pair_among_four_geforce_cards_keeps_p2p_on_nvlink(self) -> None:
        # Before, the two unbridged cards turned P2P off for all four (NCCL_P2P_DISABLE=1).
        facts = gpus(*["GeForce RTX 3090"] * 4)
        for gpu, links in zip(facts["gpus"], (4, 4, "unsupported", 0), strict=True):
            gpu["nvlinks_active"] = links
        decision = nccl.decide_p2p(facts, pcie(4))
        assert decision["disable"] is False and decision["level"] == "NVL"
        assert decision["reason"] == (
            "2 of 4 GPUs peer over NVLink, the others not over PCIe: "
            "GeForce RTX 3090 across PCIe root ports: GeForce cards have no PCIe P2P"
        )
        env = nccl.nccl_env(net(self.ETH), facts, pcie(4))
        assert env["env"]["NCCL_P2P_LEVEL"] == "NVL" and env["env"]["NCCL_P2P_DISABLE"] == "0"
        assert env["p2p_level"] == "NVL"
        assert "P2P over NVLink only: 2 of 4 GPUs" in env["summary"]

    def test_one_bridged_gpu_alone_is_no_pair_and_pcie_p2p_on_stays_on(self) -> None:
        facts = gpus(*["GeForce RTX 3090"] * 4)
        facts["gpus"][0]["nvlinks_active"] = 2
        assert nccl.decide_p2p(facts, pcie(4))["disable"] is True
        datacenter = gpus("RTX A6000", "RTX A6000", "RTX A6000")
        datacenter["gpus"][0]["nvlinks_active"] = datacenter["gpus"][1]["nvlinks_active"] = 4
        assert nccl.decide_p2p(datacenter, pcie(3, names=["RTX A6000"] * 3)) == {
            "disable": False,
            "reason": "3x RTX A6000 peer over PCIe",
        }


class TestOneAddressDecision:
    """nccl_env takes the interface net_facts chose (budgetgpu_net.cluster_interface), the same one
    the rendezvous endpoint and --local-addr read: it no longer ranks interfaces of its own."""

    def test_1g_and_10g_in_the_subnet_nccl_and_rendezvous_both_take_the_10g(self) -> None:
        facts = net(
            iface("eth0", "physical", "192.168.10.5", speed=1000),
            iface("eth1", "physical", "192.168.10.15", speed=10000),
        )
        decision = nccl.nccl_env(facts)
        rendezvous = node_info({"node1": {"ansible_facts": {"budgetgpu_net": facts}}}, "node1")["cluster_address"]
        assert decision["address"] == rendezvous == "192.168.10.15"
        assert decision["env"]["NCCL_SOCKET_IFNAME"] == "=eth1"

    def test_nccl_follows_the_probes_choice_even_where_it_would_rank_otherwise(self) -> None:
        facts = net(
            iface("eth0", "physical", "192.168.10.5", speed=10000),
            iface("eth1", "physical", "192.168.10.15", speed=1000),
        )
        facts["cluster_interface"] = {
            **facts["cluster_interface"],
            "name": "eth1",
            "address": "192.168.10.15",
            "reason": "r",
        }
        decision = nccl.nccl_env(facts)
        assert (decision["interface"], decision["address"]) == ("eth1", "192.168.10.15")
        assert decision["reasons"][0] == "interface eth1: r"

    def test_without_a_cluster_interface_the_probes_error_is_the_answer(self) -> None:
        facts = net(iface("eth0", "physical", "10.0.0.5", speed=1000, carrier=False))
        decision = nccl.nccl_env(facts)
        assert decision["env"] == {} and decision["errors"] == [facts["cluster_interface_error"]]
        old_facts = {"interfaces": facts["interfaces"], "infiniband": []}
        assert "run the probe role" in nccl.nccl_env(old_facts)["errors"][0]


class TestEnvFile:
    def test_renders_sorted_plain_lines(self) -> None:
        assert nccl.nccl_env_file({"NCCL_NET": "Socket", "GLOO_SOCKET_IFNAME": "eth0"}) == (
            "GLOO_SOCKET_IFNAME=eth0\nNCCL_NET=Socket\n"
        )

    @pytest.mark.parametrize("value", ["a b", "$(reboot)", "x'y"])
    def test_refuses_values_the_two_readers_disagree_on(self, value: str) -> None:
        with pytest.raises(ValueError, match="plain words"):
            nccl.nccl_env_file({"NCCL_DEBUG": value})


class TestMembers:
    def test_member_addresses_skip_loopback_docker_and_foreign_bridges(self) -> None:
        node1 = net(LOOPBACK, DOCKER0, BR0, iface("eth0", "veth", "192.168.10.2"), iface("eth1", "veth", "172.30.0.2"))
        node2 = net(
            LOOPBACK,
            iface("br0", "bridge", "192.168.10.203", prefix=32),
            iface("eno1", "physical", "192.168.10.3", "fe80::1", "fd00::3"),
        )
        members = nccl.nccl_member_addresses([node1, node2], SUBNET)
        assert members == {
            "ipv4": ["172.30.0.2", "192.168.10.2", "192.168.10.3", "192.168.10.203"],
            "ipv6": ["fd00::3"],
        }


class TestReport:
    RESULTS = {
        "backend": "gloo",
        "world_size": 3,
        "nodes": ["node1", "node2", "node3"],
        "sizes": [
            {"bytes": 1024, "time_us": 200.0, "algbw_gbs": 0.005, "busbw_gbs": 0.007},
            {"bytes": 64 << 20, "time_us": 100000.0, "algbw_gbs": 0.67, "busbw_gbs": 0.89},
        ],
        "pairs": [
            {"src": "node1", "dst": "node2", "src_addr": "10.0.0.2", "dst_addr": "10.0.0.3", "gbs": 1.1},
            {"src": "node2", "dst": "node3", "src_addr": "10.0.0.3", "dst_addr": "10.0.0.4", "gbs": 0.6},
        ],
    }
    IPERF = [{"src": "node1", "dst": "node2", "gbs": 1.2}, {"src": "node2", "dst": "node3", "gbs": 1.0}]

    def test_floor_from_line_rate_is_the_guides_half_gb_on_10gbe(self) -> None:
        floor = nccl.nccl_busbw_floor([10000, 10000], [1.1], 0.4, 0.1)
        assert floor["floor_gbs"] == 0.5
        assert "40% of the slowest line rate 10000 Mb/s" in floor["basis"]

    def test_floor_on_virtual_links_follows_iperf3(self) -> None:
        floor = nccl.nccl_busbw_floor([None, 10000], [2.0, 1.5], 0.4, 0.1)
        assert floor["floor_gbs"] == 0.15

    def test_explicit_floor_wins(self) -> None:
        assert nccl.nccl_busbw_floor([10000], [1.0], 0.4, 0.1, explicit="0.9")["floor_gbs"] == 0.9

    def test_passes_above_the_floor_and_reports_the_ratio(self) -> None:
        report = nccl.nccl_comm_report(self.RESULTS, self.IPERF, {"floor_gbs": 0.5, "basis": "x"})
        assert report["passed"] is True
        assert report["iperf3_min_gbs"] == 1.0
        assert report["large_tcp_ratio"] == 0.89
        assert report["pairs"][1]["tcp_ratio"] == 0.6

    def test_fails_under_the_floor_naming_the_slowest_pair(self) -> None:
        report = nccl.nccl_comm_report(self.RESULTS, self.IPERF, {"floor_gbs": 5.0, "basis": "set"})
        assert report["passed"] is False
        assert "0.890 GB/s at 64 MB is under the floor 5.000 GB/s" in report["failures"][0]
        assert "slowest pair node2 -> node3 (10.0.0.3 -> 10.0.0.4)" in report["failures"][0]

    def test_table_lists_every_size_and_the_verdict(self) -> None:
        report = nccl.nccl_comm_report(self.RESULTS, self.IPERF, {"floor_gbs": 0.5, "basis": "b"})
        lines = nccl.nccl_report_table(report)
        assert "1 KB" in lines[1] and "64 MB" in lines[2] and "89%" in lines[2]
        assert lines[-1].endswith("PASS")


def test_missing_facts_names_unprobed_members() -> None:
    hostvars = {"node1": {"ansible_facts": {"budgetgpu_net": {"interfaces": []}}}, "node2": {"ansible_facts": {}}}
    assert nccl.nccl_missing_facts(["node1", "node2", "node3"], hostvars) == ["node2", "node3"]


class TestReachability:
    HOSTVARS = {
        "node1": {"nccl_network_decision": {"address": "10.0.0.2", "interface": "eth0"}},
        "node2": {"nccl_network_decision": {"address": "10.0.0.3", "interface": "eth1"}},
        "node3": {},
    }

    GROUPS = {"gpu_nodes": ["node1", "node2"], "pair": ["node2", "node1"]}

    @staticmethod
    def job(name: str = "main", nodes: str = "gpu_nodes", port: int = 29500, **more: Any) -> dict[str, Any]:
        return {"name": name, "nodes": nodes, "master": None, "master_addr": None, "port": port, **more}

    def test_master_listens_on_rendezvous_ports_and_everyone_connects(self) -> None:
        jobs = [self.job()]
        plan = nccl.nccl_reachability_plan(["node1", "node2"], self.HOSTVARS, "node1", jobs, self.GROUPS, 29499)
        assert plan == {
            "listen": ["10.0.0.2:29499:1", "10.0.0.2:29500:2"],
            "connect": ["node1 rendezvous of job main=10.0.0.2:29500", "node2=10.0.0.3:29499"],
            "errors": [],
        }
        peer = nccl.nccl_reachability_plan(["node1", "node2"], self.HOSTVARS, "node2", jobs, self.GROUPS, 29499)
        assert peer["listen"] == ["10.0.0.3:29499:1"]
        assert peer["connect"] == ["node1 rendezvous of job main=10.0.0.2:29500", "node1=10.0.0.2:29499"]

    def test_each_job_is_dialled_at_its_own_master_and_port(self) -> None:
        # Before, every node dialled the group's first member (node1) on every rendezvous port: a job
        # whose master is node2 (first of its group, or named) was never proved where its units dial.
        jobs = [self.job(), self.job("second", nodes="pair", port=29600), self.job("named", port=29700, master="node2")]
        members = ["node1", "node2"]
        master2 = nccl.nccl_reachability_plan(members, self.HOSTVARS, "node2", jobs, self.GROUPS, 29499)
        assert master2["listen"] == ["10.0.0.3:29499:1", "10.0.0.3:29600:2", "10.0.0.3:29700:2"]
        node1 = nccl.nccl_reachability_plan(members, self.HOSTVARS, "node1", jobs, self.GROUPS, 29499)
        assert node1["listen"] == ["10.0.0.2:29499:1", "10.0.0.2:29500:2"]
        assert node1["connect"] == [
            "node1 rendezvous of job main=10.0.0.2:29500",
            "node2 rendezvous of job second=10.0.0.3:29600",
            "node2 rendezvous of job named=10.0.0.3:29700",
            "node2=10.0.0.3:29499",
        ]

    def test_master_addr_is_dialled_where_the_job_sets_it(self) -> None:
        jobs = [self.job(master_addr="10.9.9.9")]
        plan = nccl.nccl_reachability_plan(["node1", "node2"], self.HOSTVARS, "node2", jobs, self.GROUPS, 29499)
        assert plan["connect"][0] == "node1 rendezvous of job main=10.9.9.9:29500"

    def test_a_job_whose_master_is_not_in_this_run_is_not_planned(self) -> None:
        plan = nccl.nccl_reachability_plan(["node2"], self.HOSTVARS, "node2", [self.job()], self.GROUPS, 29499)
        assert plan == {"listen": ["10.0.0.3:29499:0"], "connect": [], "errors": []}

    def test_a_member_without_decision_is_named(self) -> None:
        plan = nccl.nccl_reachability_plan(["node1", "node3"], self.HOSTVARS, "node1", [self.job()], self.GROUPS, 29499)
        assert plan["errors"] == ["node3: no NCCL decision (the host failed earlier or is unreachable)"]

    def test_unreached_message_names_node_interface_and_target(self) -> None:
        result = {"name": "node1 rendezvous", "address": "10.0.0.2", "port": 29500, "error": "timed out"}
        message = nccl.nccl_unreached_message(result, "node2", {"interface": "eth1", "address": "10.0.0.3"})
        assert message == "node2 (NCCL on eth1 10.0.0.3) cannot reach node1 rendezvous at 10.0.0.2:29500: timed out"


class TestCommTestHelpers:
    def test_line_rates_ignore_virtual_links(self) -> None:
        decisions = [{"kind": "physical", "speed_mbps": 10000}, {"kind": "veth", "speed_mbps": 10000}]
        assert nccl.nccl_line_rates(decisions) == [10000, None]

    def test_iperf_results_read_the_received_rate(self) -> None:
        stdout = json.dumps(
            {
                "start": {"connecting_to": {"host": "10.0.0.3"}},
                "end": {"sum_received": {"bits_per_second": 9.4e9}, "sum_sent": {"retransmits": 3}},
            }
        )
        loop = [{"item": {"src": "node1", "dst": "node2"}, "stdout": stdout}]
        assert nccl.nccl_iperf_results(loop) == [
            {"src": "node1", "dst": "node2", "dst_addr": "10.0.0.3", "gbs": 1.175, "retransmits": 3}
        ]


class TestMembersWithoutFacts:
    """A member without facts in a run (down, its cache expired; or left out by ansible-pull's
    --limit) keeps the addresses that an earlier run wrote into the firewall file."""

    NODE1 = net(LOOPBACK, DOCKER0, iface("eno1", "physical", "192.168.10.2"))
    FIREWALL = (
        "#!/usr/sbin/nft -f\n"
        "# member node1: 192.168.10.2\n"
        "#   member node2: 192.168.10.3, fd00::3\n"
        "# member node3:\n"
        "table inet budgetgpu {\n"
    )

    def hostvars(self) -> dict[str, Any]:
        return {
            "node1": {
                "ansible_facts": {"budgetgpu_net": self.NODE1},
                "nccl_network_decision": {"address": "192.168.10.2"},
            },
            "node2": {"ansible_facts": {}},
            "node3": {},
        }

    def test_absent_members_say_why(self) -> None:
        absent = nccl.nccl_absent_members(["node1", "node2", "node3"], self.hostvars(), ["node1", "node2"], ["node1"])
        assert absent == {"node2": "down or failed earlier in this run", "node3": "not in this run (--limit)"}

    def test_recorded_members_read_the_firewall_files_member_lines(self) -> None:
        assert nccl.nccl_recorded_members(self.FIREWALL) == {
            "node1": {"ipv4": ["192.168.10.2"], "ipv6": []},
            "node2": {"ipv4": ["192.168.10.3"], "ipv6": ["fd00::3"]},
            "node3": {"ipv4": [], "ipv6": []},
        }
        assert nccl.nccl_recorded_members(None) == {}

    def test_facts_win_the_record_fills_in_and_an_unknown_member_has_no_source(self) -> None:
        recorded = {"node1": {"ipv4": ["192.168.10.99"], "ipv6": []}, "node2": {"ipv4": ["192.168.10.3"], "ipv6": []}}
        records = nccl.nccl_member_records(["node1", "node2", "node3"], self.hostvars(), SUBNET, recorded)
        assert records == {
            "node1": {"ipv4": ["192.168.10.2"], "ipv6": [], "source": "facts"},
            "node2": {"ipv4": ["192.168.10.3"], "ipv6": [], "source": "record"},
            "node3": {"ipv4": [], "ipv6": [], "source": None},
        }
        assert nccl.nccl_record_addresses(records) == {"ipv4": ["192.168.10.2", "192.168.10.3"], "ipv6": []}

    def test_records_of_probed_members_equal_the_cluster_wide_addresses(self) -> None:
        node2 = net(iface("eno1", "physical", "192.168.10.3", "fd00::3"))
        hostvars = {
            "node1": {"ansible_facts": {"budgetgpu_net": self.NODE1}},
            "node2": {"ansible_facts": {"budgetgpu_net": node2}},
        }
        records = nccl.nccl_member_records(["node1", "node2"], hostvars, SUBNET)
        assert nccl.nccl_record_addresses(records) == nccl.nccl_member_addresses([self.NODE1, node2], SUBNET)


def test_nccl_network_input_problems_name_host_and_variable() -> None:
    from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.nccl import nccl_network_problems

    good = {
        "host": "node1",
        "os_family": "Debian",
        "group": "gpu_nodes",
        "members": ["node1", "node2"],
        "absent": {},
        "safe_mode": False,
        "firewall": True,
        "member_records": {"node1": {"source": "facts"}, "node2": {"source": "facts"}},
        "firewall_file": "/etc/nftables.d/budgetgpu.nft",
        "recorded": {},
        "subnet": "10.0.0.0/24",
    }
    assert nccl_network_problems(good) == []
    bad = {**good, "host": "node3", "os_family": "RedHat", "distribution": "Rocky", "version": "9", "subnet": ""}
    assert nccl_network_problems(bad) == [
        "node3: nccl_network supports Debian and Ubuntu, found Rocky 9",
        "node3: not in group gpu_nodes (node1, node2): run nccl_network on the cluster's nodes or set"
        " nccl_network_group",
        "node3: the cluster has 2 nodes but budgetgpu_cluster_subnet is empty: set it in group_vars/all (e.g. "
        "192.168.1.0/24)",
    ]
    # A member down in safe mode whose addresses the firewall file records: the run goes on.
    down = {**good, "absent": {"node2": "unreachable"}, "safe_mode": True, "recorded": {"node2": {}}}
    assert (
        nccl_network_problems({**down, "member_records": {"node1": {"source": "facts"}, "node2": {"source": "record"}}})
        == []
    )
    # Without the firewall, nothing would shut it out.
    assert nccl_network_problems({**down, "firewall": False, "member_records": {"node2": {"source": None}}}) == []


def test_a_job_on_a_network_tests_port_is_refused_on_its_nodes() -> None:
    from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.nccl import nccl_network_problems

    inputs = {
        "host": "node1",
        "os_family": "Debian",
        "group": "gpu_nodes",
        "members": ["node1"],
        "member_records": {"node1": {"source": "facts"}},
        "test_ports": [29499, 29510, 5201],
        "groups": {"gpu_nodes": ["node1", "node2"], "other": ["node2"]},
        "jobs": [
            {"name": "a", "nodes": "gpu_nodes", "port": 29510, "store_port": 30510},
            {"name": "b", "nodes": "gpu_nodes", "port": 29600, "store_port": 5201},
            {"name": "gone", "nodes": "gpu_nodes", "port": 29499, "store_port": 30499, "state": "absent"},
            {"name": "elsewhere", "nodes": "other", "port": 29499, "store_port": 30499},
        ],
    }
    tests = "the network tests' (29499, 29510, 5201: nccl_network_probe_port, nccl_network_comm_test_port, "
    assert nccl_network_problems(inputs) == [
        f"node1: job a: port: found 29510, expected a port other than {tests}nccl_network_iperf_port)",
        f"node1: job b: store_port: found 5201, expected a port other than {tests}nccl_network_iperf_port)",
    ]
