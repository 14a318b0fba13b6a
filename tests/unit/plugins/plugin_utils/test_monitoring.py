"""monitoring: Prometheus' targets at each node's cluster address, and the addresses the node exporters'
firewall lets in (every NIC address of the Prometheus hosts, the extra ones, the hosts it cannot know)."""

from __future__ import annotations

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.monitoring import (
    prometheus_url,
    scrape_targets,
    scraper_addresses,
)


def net(*addresses: str, chosen: str | None = None) -> dict:
    interfaces = [
        {"name": "eth0", "kind": "physical", "addresses": [{"address": a, "prefix": 24} for a in addresses]},
        {"name": "docker0", "kind": "bridge", "addresses": [{"address": "172.17.0.1", "prefix": 16}]},
        {"name": "lo", "kind": "loopback", "addresses": [{"address": "127.0.0.1", "prefix": 8}]},
    ]
    return {"interfaces": interfaces, "cluster_interface": {"address": chosen} if chosen else None}


HOSTVARS = {
    "node1": {"ansible_facts": {"budgetgpu_net": net("10.0.0.11", "fd00::11", chosen="10.0.0.11")}},
    "node6": {"ansible_facts": {"budgetgpu_net": net("fd00::16", chosen="fd00::16")}},
    "control": {"ansible_host": "192.168.1.5"},
}


def test_targets_are_the_cluster_addresses_labelled_with_the_inventory_name():
    assert scrape_targets(["node1", "node6", "control", "bare"], HOSTVARS, 9100) == [
        {"targets": ["10.0.0.11:9100"], "labels": {"instance": "node1"}},
        {"targets": ["[fd00::16]:9100"], "labels": {"instance": "node6"}},
        {"targets": ["192.168.1.5:9100"], "labels": {"instance": "control"}},
        {"targets": ["bare:9100"], "labels": {"instance": "bare"}},
    ]


def test_scrapers_are_every_nic_address_never_docker_or_loopback_and_unknown_hosts_are_named():
    assert scraper_addresses(["node1", "control"], HOSTVARS, ["192.168.9.0/24"]) == {
        "ipv4": ["10.0.0.11", "192.168.9.0/24"],
        "ipv6": ["fd00::11"],
        "unknown": ["control"],
    }
    assert scraper_addresses([], HOSTVARS) == {"ipv4": [], "ipv6": [], "unknown": []}


def test_the_control_node_finds_prometheus_at_its_ansible_host_else_its_cluster_address_else_its_name():
    both = {"ansible_host": "192.168.1.7", "ansible_facts": HOSTVARS["node1"]["ansible_facts"]}
    hostvars = {**HOSTVARS, "both": both}
    assert prometheus_url("control", hostvars, "0.0.0.0:9090") == "http://192.168.1.5:9090"
    assert prometheus_url("both", hostvars, "0.0.0.0:9090") == "http://192.168.1.7:9090"
    assert prometheus_url("node1", hostvars, "[::]:9091") == "http://10.0.0.11:9091"
    assert prometheus_url("node6", hostvars, ":9090") == "http://[fd00::16]:9090"
    assert prometheus_url("bare", hostvars, "0.0.0.0:9090") == "http://bare:9090"


def test_a_prometheus_on_one_address_is_asked_there():
    assert prometheus_url("control", HOSTVARS, "10.0.0.5:9095") == "http://10.0.0.5:9095"
    assert prometheus_url("control", HOSTVARS, "[fd00::5]:9090") == "http://[fd00::5]:9090"
