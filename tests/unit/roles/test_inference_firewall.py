"""Role inference's nftables table: the worker ports admit their gateway and the Prometheus hosts (for
the workers' own /metrics), and refuse everyone else; without a Prometheus host, the gateway only."""

from __future__ import annotations

import re
from pathlib import Path

import jinja2

TEMPLATE = Path(__file__).resolve().parents[3] / "roles/inference/templates/budgetgpu-inference.nft.j2"
PLAN = [
    {
        "name": "chat",
        "state": "started",
        "gateway_host": "node1",
        "gateway_address": "10.0.0.11",
        "workers": [{"port": 8100}, {"port": 8101}],
    }
]


def render(allow: dict, scrapers: list[str], gateways: list | None = None) -> str:
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    env.filters["comment"] = lambda text: "# " + text
    env.tests["search"] = lambda value, pattern: re.search(pattern, str(value)) is not None
    return env.from_string(TEMPLATE.read_text()).render(
        ansible_managed="Ansible managed",
        _inference_plan=PLAN,
        _inference_gateways=gateways or [],
        _inference_scrapers_allow=allow,
        inference_scrapers=scrapers,
        inference_scrapers_extra=[],
    )


def rules(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip().startswith("tcp dport")]


def test_the_workers_admit_the_gateway_and_the_prometheus_hosts_then_refuse():
    text = render({"ipv4": ["10.0.0.13"], "ipv6": ["fd00::13"], "unknown": []}, ["monitor"])
    assert rules(text) == [
        "tcp dport 8100-8101 ip saddr 10.0.0.11 accept",
        "tcp dport 8100-8101 ip saddr { 10.0.0.13 } accept",
        "tcp dport 8100-8101 ip6 saddr { fd00::13 } accept",
        "tcp dport 8100-8101 counter reject with tcp reset comment"
        ' "budgetgpu: chat workers, gateway and Prometheus only"',
    ]
    assert "the Prometheus hosts (monitor)" in text


def test_without_a_prometheus_host_only_the_gateway_reaches_the_workers():
    text = render({"ipv4": [], "ipv6": [], "unknown": []}, [])
    assert [rule.split(" saddr ")[0] for rule in rules(text) if "accept" in rule] == ["tcp dport 8100-8101 ip"]


def test_a_gateway_admits_its_allow_list_and_an_empty_list_admits_no_one():
    gateway = {"name": "chat", "state": "started", "gateway_port": 8080, "allow": ["10.0.0.0/24", "fd00::/64"]}
    empty = {"name": "embed", "state": "started", "gateway_port": 8081, "allow": []}
    text = render({"ipv4": [], "ipv6": [], "unknown": []}, [], [gateway, empty])
    gateway_rules = [rule for rule in rules(text) if rule.startswith(("tcp dport 8080", "tcp dport 8081"))]
    assert gateway_rules == [
        "tcp dport 8080 ip saddr { 10.0.0.0/24 } accept",
        "tcp dport 8080 ip6 saddr { fd00::/64 } accept",
        'tcp dport 8080 counter reject with tcp reset comment "budgetgpu: chat gateway"',
        # Preflight refuses an empty list; were it to get here, nobody is admitted, not everybody.
        'tcp dport 8081 counter reject with tcp reset comment "budgetgpu: embed gateway"',
    ]
