"""Who Prometheus scrapes and who may scrape: the node exporters' targets (each node's cluster address,
the one net_facts chose) and the addresses a Prometheus host may connect from (the node exporters'
firewall); and where the control node finds Prometheus' HTTP API (playbooks/report.yml). Controller
side, pure over hostvars."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference import node_address
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.nccl import nccl_member_addresses


def scrape_targets(hosts: list[str], hostvars: Mapping[str, Any], port: int) -> list[dict[str, Any]]:
    """Return Prometheus static_configs, one per host: its cluster address (else ansible_host, else its
    name) and port, labelled instance=<inventory name> (alerts name the node as the inventory does)."""
    configs = []
    for host in hosts:
        address = node_address(hostvars, host)
        target = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
        configs.append({"targets": [target], "labels": {"instance": host}})
    return configs


def scraper_addresses(hosts: list[str], hostvars: Mapping[str, Any], extra: list[str] | None = None) -> dict[str, Any]:
    """Return {ipv4, ipv6, unknown}: every address the hosts may connect from (their NICs' addresses, from
    net_facts, as the training firewall takes its members), the extra addresses or networks as given, and
    the hosts without net_facts (nothing is known of their addresses: the caller refuses them)."""
    nets, unknown = [], []
    for host in hosts:
        facts = (hostvars.get(host) or {}).get("ansible_facts") or {}
        if isinstance(facts.get("budgetgpu_net"), Mapping):
            nets.append(facts["budgetgpu_net"])
        else:
            unknown.append(host)
    found = nccl_member_addresses(nets)
    for address in extra or []:
        found["ipv6" if ":" in str(address) else "ipv4"].append(str(address))
    return {"ipv4": sorted(set(found["ipv4"])), "ipv6": sorted(set(found["ipv6"])), "unknown": unknown}


# A listen address on every interface: the control node must pick one of the host's addresses itself.
_ANY_ADDRESS = ("", "0.0.0.0", "::", "[::]", "*")


def prometheus_url(host: str, hostvars: Mapping[str, Any], listen_address: str) -> str:
    """Return http://ADDRESS:PORT of Prometheus' HTTP API on host as the control node reaches it. The port
    and, when Prometheus listens on one address, the address are prometheus_listen_address's; on every
    address: the host's ansible_host (how the control node already reaches it), else its cluster address
    (net_facts), else its inventory name."""
    listen, _sep, port = str(listen_address).rpartition(":")
    if listen not in _ANY_ADDRESS:
        address = listen.strip("[]")
    else:
        hv = hostvars.get(host) if isinstance(hostvars, Mapping) else None
        ansible_host = hv.get("ansible_host") if isinstance(hv, Mapping) else None
        address = str(ansible_host or node_address(hostvars, host))
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"
