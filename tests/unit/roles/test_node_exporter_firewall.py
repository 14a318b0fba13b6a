"""Role node_exporter's nftables table, the one firewall mechanism of the metrics: node exporter's port
for the Prometheus hosts (this role) and Prometheus' port for its clients (role prometheus, entry point
firewall, a table of its own), each refused to everyone else."""

from __future__ import annotations

from pathlib import Path

import jinja2
import yaml

ROLES = Path(__file__).resolve().parents[3] / "roles"
TEMPLATE = ROLES / "node_exporter/templates/budgetgpu-metrics.nft.j2"


def render(name: str, rules: list[dict]) -> str:
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    env.filters["comment"] = lambda text: "# " + text
    return env.from_string(TEMPLATE.read_text()).render(
        ansible_managed="Ansible managed", _node_exporter_firewall_rules=rules, _node_exporter_firewall_table=name
    )


def rules_of(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip().startswith("tcp dport")]


def test_node_exporters_port_admits_the_prometheus_hosts_only():
    allow = {"ipv4": ["10.0.0.11"], "ipv6": ["fd00::11"], "unknown": []}
    rule = {"port": 9100, "what": "node exporter", "only": "Prometheus only", "hosts": ["node1"], "extra": []}
    text = render("budgetgpu_metrics", [{**rule, "allow": allow}])
    assert "table inet budgetgpu_metrics {" in text and "delete table inet budgetgpu_metrics" in text
    assert rules_of(text) == [
        "tcp dport 9100 ip saddr { 10.0.0.11 } accept",
        "tcp dport 9100 ip6 saddr { fd00::11 } accept",
        'tcp dport 9100 counter reject with tcp reset comment "budgetgpu: node exporter, Prometheus only"',
    ]


def test_prometheus_port_with_no_client_is_loopback_only():
    rule = {"port": 9090, "what": "Prometheus", "only": "its clients only", "hosts": [], "extra": []}
    text = render("budgetgpu_prometheus", [{**rule, "allow": {"ipv4": [], "ipv6": [], "unknown": []}}])
    assert rules_of(text) == [
        'tcp dport 9090 counter reject with tcp reset comment "budgetgpu: Prometheus, its clients only"'
    ]
    assert 'iifname "lo" accept' in text and "9090 (Prometheus): loopback only" in text


def test_the_prometheus_role_calls_the_same_firewall_for_its_listen_port():
    tasks = yaml.safe_load((ROLES / "prometheus/tasks/main.yml").read_text())
    firewall = next(
        task for task in tasks if task.get("ansible.builtin.include_role", {}).get("tasks_from") == "firewall"
    )
    assert firewall["ansible.builtin.include_role"]["name"] == "budgetgpu.cluster.node_exporter"
    assert firewall["vars"]["node_exporter_firewall_name"] == "prometheus"
    assert firewall["vars"]["node_exporter_firewall_ports"][0]["port"] == "{{ _prometheus_port }}"
