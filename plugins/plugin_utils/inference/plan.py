"""Role inference's plan of one service on one node (filter inference_plan): its workers there, and
where this node is the service's gateway, the gateway's upstreams, address, allow list, key rates
and limits; the limits the workers' config repeats. One call a service, so that the role's tasks and
templates read the service model's answers and decide nothing themselves.

Controller-side and pure (a normalised service and hostvars in, a dict out; no I/O)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.gateway import (
    inference_body_limits,
    inference_gateway_allow,
    inference_gateway_routes,
    inference_max_conns,
    recorded_upstreams,
)
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.keys import inference_gateway_keys
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.memory import inference_context_tokens
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.placement import (
    inference_gateway_host,
    inference_rpc_servers,
    inference_upstream_servers,
    inference_workers,
)
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.services import rpc_unit_name
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.nodes import node_address


def _rates(service: Mapping[str, Any], api_keys: Any) -> dict[Any, list[str]]:
    """{requests per second: [key names]} of the gateway's API keys (the keys themselves stay out of the plan)."""
    rates: dict[Any, list[str]] = {}
    for key in sorted(inference_gateway_keys(service, api_keys), key=lambda k: k["rate_per_s"]):
        rates.setdefault(key["rate_per_s"], []).append(key["name"])
    return rates


def _stale_report(name: Any, upstreams: Mapping[str, list[str]]) -> list[str]:
    """A line for each node of the gateway's service without GPU facts in this run (inference_upstream_servers'
    stale and unknown)."""
    return [
        f"{node}: no GPU facts in this run (down or left out): the gateway of service {name} keeps the servers "
        "of its workers from the last run (stale: NGINX passes their requests to the other workers; run again once "
        "it is up)"
        for node in upstreams["stale"]
    ] + [
        f"{node}: no GPU facts in this run (down or left out) and no earlier run placed its workers of service "
        f"{name}: the gateway leaves them out until a run reaches it"
        for node in upstreams["unknown"]
    ]


def inference_plan(
    service: Mapping[str, Any],
    hostvars: Mapping[str, Any],
    host: str,
    hosts: list[str],
    jobs: list[Mapping[str, Any]] | None = None,
    api_keys: Any = None,
    allow: list[str] | None = None,
    cluster_subnet: str | None = None,
    recorded: str | None = None,
    head_rpc: bool = False,
) -> dict[str, Any]:
    """Return the service on host: {service, name, state, workers (inference_workers: those whose head is
    host), rpc_servers (inference_rpc_servers: the llama.cpp RPC servers host runs for workers headed on
    another node; with head_rpc, where host's llama-server has no GPU device, also those of its own workers
    over nodes), is_gateway, upstreams (every worker of every node: the gateway's alone, while the service is
    not absent: inference_upstream_servers, {address, node}), stale and unknown (the nodes without
    GPU facts in this run whose servers of the last run are kept, recorded: the text of the gateway config an
    earlier run wrote, and those it does not hold), report (a line for each of those nodes), model_dir,
    config_file, template, rpc_template (the unit template of its llama.cpp RPC servers), gateway_host,
    gateway_port, gateway_address (its address, nodes.node_address: what alone may reach the workers), allow
    (inference_gateway_allow), listen (gateway.listen, else the gateway's address), rates (the gateway's, as
    upstreams), body_limits, max_conns, routes, context_tokens}."""
    gateway_host = inference_gateway_host(service, hostvars, hosts)
    is_gateway = gateway_host == host
    serving = is_gateway and service.get("state") != "absent"
    gateway = service.get("gateway") or {}
    gateway_address = node_address(hostvars, gateway_host) if gateway_host else None
    upstreams = (
        inference_upstream_servers(service, hostvars, hosts, jobs, recorded_upstreams(recorded))
        if serving
        else {"servers": [], "stale": [], "unknown": []}
    )
    name = service.get("name")
    return {
        "service": service,
        "name": name,
        "state": service.get("state"),
        "workers": inference_workers(service, hostvars, host, jobs, hosts, head_rpc),
        "rpc_servers": inference_rpc_servers(service, hostvars, host, hosts, jobs, head_rpc),
        "is_gateway": is_gateway,
        "upstreams": upstreams["servers"],
        "stale": upstreams["stale"],
        "unknown": upstreams["unknown"],
        "report": _stale_report(name, upstreams),
        "model_dir": service.get("model_dir"),
        "config_file": service.get("config_file"),
        "template": service.get("unit_template"),
        "rpc_template": rpc_unit_name(str(service.get("name"))),
        "gateway_host": gateway_host,
        "gateway_port": gateway.get("port"),
        "gateway_address": gateway_address,
        "allow": inference_gateway_allow(service, allow, cluster_subnet),
        "listen": gateway.get("listen") or gateway_address,
        "rates": _rates(service, api_keys) if serving else {},
        "body_limits": inference_body_limits(service),
        "max_conns": inference_max_conns(service),
        "routes": inference_gateway_routes(service, len(upstreams["servers"])),
        "context_tokens": inference_context_tokens(service),
    }
