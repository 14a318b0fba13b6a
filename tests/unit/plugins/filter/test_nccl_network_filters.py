"""Role nccl_network's three filters (plugins/filter/nccl.py): each one call that gives the role what the
plugin_utils/nccl.py functions (tested in tests/unit/plugins/plugin_utils/test_nccl.py) decide, and the role
calls no other filter of this collection but the NCCL decision's."""

from __future__ import annotations

import json

from ansible_collections.budgetgpu.cluster.plugins.filter.nccl import (
    nccl_network_plan,
    nccl_network_reachability,
    nccl_network_report,
)

NET = {
    "interfaces": [
        {"name": "eth0", "kind": "physical", "addresses": [{"family": "ipv4", "address": "10.9.0.2", "prefixlen": 24}]}
    ],
    "cluster_interface": {"name": "eth0", "address": "10.9.0.2"},
}
PLAN_INPUTS = {
    "host": "node1",
    "os_family": "Debian",
    "group": "gpu_nodes",
    "members": ["node1", "node2", "node3"],
    "hostvars": {"node1": {"ansible_facts": {"budgetgpu_net": NET}}, "node2": {"ansible_facts": {}}, "node3": {}},
    "play_hosts_all": ["node1", "node2"],
    "play_hosts": ["node1"],
    "safe_mode": True,
    "firewall": True,
    "firewall_file": "/etc/nftables.d/budgetgpu.nft",
    "subnet": "10.9.0.0/24",
    "record": "# member node2: 10.9.0.3, fd00::3\n",
}


def test_plan_gives_the_members_the_firewall_admits_and_the_input_problems() -> None:
    plan = nccl_network_plan(PLAN_INPUTS)
    assert plan["absent"] == {"node2": "down or failed earlier in this run", "node3": "not in this run (--limit)"}
    assert plan["recorded"] == {"node2": {"ipv4": ["10.9.0.3"], "ipv6": ["fd00::3"]}}
    assert plan["member_records"] == {
        "node1": {"ipv4": ["10.9.0.2"], "ipv6": [], "source": "facts"},
        "node2": {"ipv4": ["10.9.0.3"], "ipv6": ["fd00::3"], "source": "record"},
        "node3": {"ipv4": [], "ipv6": [], "source": None},
    }
    assert plan["member_addresses"] == {"ipv4": ["10.9.0.2", "10.9.0.3"], "ipv6": ["fd00::3"]}
    assert plan["member_lines"] == ["member node1: 10.9.0.2", "member node2: 10.9.0.3, fd00::3"]
    assert plan["absent_report"][0] == (
        "node2: down or failed earlier in this run, no facts: the firewall keeps admitting it from 10.9.0.3, "
        "fd00::3, the addresses /etc/nftables.d/budgetgpu.nft recorded; it is not checked in this run"
    )
    assert plan["problems"] == [
        "node1: no address known for node3: no budgetgpu_net facts in this run (node2 (down or failed earlier in"
        ' this run), node3 (not in this run (--limit))) and no "# member" line for them in'
        " /etc/nftables.d/budgetgpu.nft (it names node2), so the firewall would shut them out: run"
        " playbooks/network.yml on the whole group gpu_nodes while they are up"
    ]


def test_plan_without_the_firewall_says_so_for_the_absent_and_has_no_record() -> None:
    plan = nccl_network_plan({**PLAN_INPUTS, "firewall": False, "record": ""})
    assert plan["recorded"] == {}
    assert "the firewall is off here (nccl_network_firewall: false)" in plan["absent_report"][0]
    assert plan["problems"] == []


def test_reachability_plans_before_the_probe_and_names_each_miss_after() -> None:
    inputs = {
        "members": ["node1", "node2"],
        "hostvars": {
            "node1": {"nccl_network_decision": {"address": "10.0.0.2", "interface": "eth0"}},
            "node2": {"nccl_network_decision": {"address": "10.0.0.3", "interface": "eth1"}},
        },
        "host": "node2",
        "jobs": [],
        "groups": {"gpu_nodes": ["node1", "node2"]},
        "probe_port": "29499",
        "decision": {"address": "10.0.0.3", "interface": "eth1"},
    }
    plan = nccl_network_reachability(inputs)
    assert plan == {"listen": ["10.0.0.3:29499:1"], "connect": ["node1=10.0.0.2:29499"], "problems": []}
    results = [
        {"name": "node1", "address": "10.0.0.2", "port": 29499, "ok": False, "error": "timed out"},
        {"name": "node1 rendezvous", "address": "10.0.0.2", "port": 29500, "ok": True, "error": ""},
    ]
    after = nccl_network_reachability({**inputs, "members": ["node1", "node2", "node3"], "results": results})
    assert after["problems"] == [
        "node3: no NCCL decision (the host failed earlier or is unreachable)",
        "node2 (NCCL on eth1 10.0.0.3) cannot reach node1 at 10.0.0.2:29499: timed out",
    ]


def test_report_joins_the_iperf3_runs_the_floor_and_the_interfaces() -> None:
    results = {
        "backend": "gloo",
        "sizes": [{"bytes": 64 << 20, "time_us": 100000.0, "algbw_gbs": 0.67, "busbw_gbs": 0.89}],
        "pairs": [{"src": "node1", "dst": "node2", "gbs": 1.1}],
    }
    run = {"end": {"sum_received": {"bits_per_second": 8e9}, "sum_sent": {"retransmits": 3}}}
    iperf = [{"item": {"src": "node1", "dst": "node2"}, "stdout": json.dumps(run)}]
    decisions = {
        "node1": {"kind": "physical", "speed_mbps": 10000, "summary": "NCCL on eth0"},
        "node2": {"kind": "veth", "speed_mbps": 10000, "summary": "NCCL on veth0"},
    }
    comm = nccl_network_report(
        {
            "results": results,
            "iperf": iperf,
            "decisions": decisions,
            "floor_fraction": "0.4",
            "floor_fraction_virtual": 0.5,
            "floor_gbps": "auto",
            "duration_s": 12.3,
            "iperf3_streams": "4",
        }
    )
    report = comm["report"]
    # A virtual link: the floor follows iperf3 (1 GB/s), not the line rate.
    assert (report["floor_gbs"], report["passed"]) == (0.5, True)
    assert report["iperf3"][0] == {"src": "node1", "dst": "node2", "dst_addr": None, "gbs": 1.0, "retransmits": 3}
    assert report["pairs"][0]["tcp_ratio"] == 1.1
    assert (report["duration_s"], report["iperf3_streams"]) == (12.3, 4)
    assert report["interfaces"] == {"node1": "NCCL on eth0", "node2": "NCCL on veth0"}
    assert comm["table"][1].split()[-1] == "89%" and comm["table"][-1].endswith("PASS")
