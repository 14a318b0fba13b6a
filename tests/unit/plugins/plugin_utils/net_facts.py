"""Hand-made net_facts of a few nodes (role probe's budgetgpu_net), shared by the tests of the modules that read a
node's cluster address: plugin_utils/firewall.py and plugin_utils/monitoring.py."""

from __future__ import annotations


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
