"""The gateway of a service (NGINX on one node): who may reach it, the firewall's entries of a node's
workers and gateways, what a request may weigh, how many connections a client may hold, its routes."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.keys import _key_entries, _service_keys
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.services import (
    SERVICE_DEFAULTS,
    TASKS,
    _is_int,
)

# What a request may weigh, per endpoint: OpenAI's 2048 embedding inputs, at most EMBEDDING_TOKENS
# tokens in all (OpenAI's 300,000), BYTES_PER_TOKEN bytes of JSON per token (text in ASCII JSON
# takes 4 to 6 bytes per token), plus BODY_SLACK for the other fields and the chat structure.
EMBEDDING_INPUTS = 2048


EMBEDDING_TOKENS = 300_000


BYTES_PER_TOKEN = 8


BODY_SLACK = 64 * 1024


ENDPOINTS = ("/v1/embeddings", "/v1/completions", "/v1/chat/completions")


def inference_gateway_allow(
    service: Mapping[str, Any], allow: list[str] | None = None, cluster_subnet: str | None = None
) -> list[str]:
    """Return who may reach the service's gateway: its gateway.allow, else ``allow``
    (inference_gateway_allow), else the cluster's subnet; [] when none is known (preflight refuses)."""
    own = (service.get("gateway") or {}).get("allow")
    if own:
        return [str(item) for item in own]
    if allow:
        return [str(item) for item in allow]
    return [str(cluster_subnet)] if cluster_subnet else []


def inference_firewall_ports(
    plan: list[Mapping[str, Any]],
    gateways: list[Mapping[str, Any]],
    scrapers: list[str],
    scrapers_extra: list[str],
    rpc_plan: list[Mapping[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Return the entries of a node's inference firewall table (role firewall, filter firewall_rules):
    each service's workers, which answer anyone (no authentication), from its gateway and the
    Prometheus hosts (their /metrics) only; each gateway port from its allow list, from no one when
    that is empty; on a gateway's node, its services' workers on other nodes (client_only: only NGINX and
    Prometheus of this node reach them); on a llama.cpp head, its RPC servers on other nodes (client_only: only
    the service's user of this node reaches them); the llama.cpp RPC servers of each worker over several nodes
    from that worker's head alone (every address of it, and its cluster address), from no local user but root (the
    head is another node), a head's own (head_rpc) from its service's user alone. ``plan``, ``gateways`` and
    ``rpc_plan`` (those with rpc_servers here) are role inference's entries of this node."""
    entries = []
    for svc in plan:
        ports = sorted(int(worker["port"]) for worker in svc.get("workers") or [])
        if svc.get("state") == "absent" or not ports:
            continue
        entries += _remote_rpc_entries(svc)
        entries.append(
            {
                # Each port, not a range: a range would open the ports between to this gateway too.
                "port": ports,
                "what": f"{svc['name']} workers",
                "only": "gateway and Prometheus only",
                "hosts": list(scrapers or []),
                "extra": [str(svc["gateway_address"])] + list(scrapers_extra or []),
                "inputs": "inference_scrapers / inference_scrapers_extra",
            }
        )
    for svc in gateways:
        if svc.get("state") != "absent":
            entries.append(
                {
                    "port": int(svc["gateway_port"]),
                    "what": f"{svc['name']} gateway",
                    "only": "its allow list only",
                    "hosts": [],
                    "extra": list(svc.get("allow") or []),
                    "inputs": f"service {svc['name']}: gateway.allow",
                }
            )
            entries += _remote_worker_entries(svc)
    return entries + [entry for svc in rpc_plan or [] if svc.get("state") != "absent" for entry in _rpc_entries(svc)]


def _client_entries(servers: list[tuple[str, str, int]], what: str, only: str, inputs: str) -> list[dict[str, Any]]:
    """client_only entries (this node serves nothing on the ports; the caller adds the users who may connect) for
    servers [(node, address, port)] on other nodes: one per node, its own ports to its own address, so that no
    port of one node is checked against another's users."""
    nodes: dict[str, dict[str, set]] = {}
    for node, address, port in servers:
        found = nodes.setdefault(node, {"addresses": set(), "ports": set()})
        found["addresses"].add(address)
        found["ports"].add(port)
    return [
        {
            "port": sorted(found["ports"]),
            "what": what.format(node=node),
            "only": only,
            "hosts": [],
            "extra": sorted(found["addresses"]),
            "inputs": inputs,
            "client_only": True,
        }
        for node, found in sorted(nodes.items())
    ]


def _remote_rpc_entries(svc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A llama.cpp head's RPC servers on other nodes, as its own node's users reach them: those nodes admit the
    head's addresses, whichever process sends from them, and an RPC server runs whatever tensors it is sent on its
    GPUs; so from the head only the service's user (its llama-server) and root connect to them."""
    servers = [
        (str(server["host"]), str(server["address"]), int(server["port"]))
        for worker in svc.get("workers") or []
        for server in worker.get("rpc_servers") or []
        if server["host"] != worker["host"]
    ]
    what, only = f"{svc['name']} RPC servers on {{node}}", "its llama-server from here only"
    entries = _client_entries(servers, what, only, f"service {svc['name']}: nodes and nodes_per_worker")
    return [{**entry, "local": [str(svc["service"]["user"])]} for entry in entries]


def _remote_worker_entries(svc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The gateway's workers on other nodes, as its own node's users reach them: those nodes admit the gateway's
    address, whichever process sends from it, so the gateway's node itself lets only NGINX (and Prometheus where
    it runs) connect to them (its caller adds those users: the entries' `what` ends in " workers")."""
    servers = []
    for server in svc.get("upstreams") or []:
        if server["node"] != svc.get("gateway_host"):
            address, _sep, port = str(server["address"]).rpartition(":")
            servers.append((str(server["node"]), address.strip("[]"), int(port)))
    what, only = f"{svc['name']} {{node}}'s workers", "NGINX and Prometheus from here only"
    return _client_entries(servers, what, only, f"service {svc['name']}: nodes")


def _rpc_entries(svc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The firewall entries of a service's llama.cpp RPC servers on a node, one per worker's head: the RPC
    server has no authentication (whoever reaches it runs tensors on its GPUs), so its head alone. A head's
    own RPC servers (placement.head_rpc_ports, on loopback) admit no other host, and of the node's own users
    the service's, which its llama-server runs as (and root)."""
    heads: dict[str, list[Mapping[str, Any]]] = {}
    for server in svc.get("rpc_servers") or []:
        heads.setdefault(str(server["head"]), []).append(server)
    inputs = f"service {svc['name']}: nodes and nodes_per_worker (a worker's head is its first node)"
    return [
        {
            "port": sorted(int(server["port"]) for server in servers),
            "what": f"{svc['name']} own RPC servers of {head}",
            "only": f"the head {head}'s own llama-server only",
            "hosts": [],
            "extra": [],
            "inputs": inputs,
            "local": [str(svc["service"]["user"])],
        }
        if all(server["host"] == head for server in servers)
        else {
            "port": sorted(int(server["port"]) for server in servers),
            "what": f"{svc['name']} RPC servers of {head}",
            "only": f"the head {head} only",
            "hosts": [head],
            "extra": sorted({str(server["head_address"]) for server in servers}),
            "inputs": inputs,
            "local": [],
        }
        for head, servers in heads.items()
    ]


def gateway_problems(
    services: list[Mapping[str, Any]],
    api_keys: Any = None,
    allow: list[str] | None = None,
    cluster_subnet: str | None = None,
) -> list[str]:
    """Return what stops the services' gateways from being closed to strangers: an allow list that
    resolves to empty (the firewall would then admit everyone), no API key, bad keys."""
    entries, problems = _key_entries(api_keys)
    for service in (s for s in services or [] if s.get("state") != "absent"):
        if not inference_gateway_allow(service, allow, cluster_subnet):
            problems.append(
                f"all: service {service.get('name')}: gateway.allow: found an empty allow list (no gateway.allow, "
                "no inference_gateway_allow, no budgetgpu_cluster_subnet), expected the CIDRs of the clients"
            )
        problems += _service_keys(service, entries)[1]
    return problems


def inference_body_limits(service: Mapping[str, Any]) -> dict[str, int]:
    """Return the largest request body in bytes per endpoint ("other": every other path), the same in
    NGINX (client_max_body_size) and in the worker (413 before parsing)."""
    tokens = int(service.get("max_input_tokens") or SERVICE_DEFAULTS["max_input_tokens"])
    generation = tokens * BYTES_PER_TOKEN + BODY_SLACK
    embeddings = min(EMBEDDING_INPUTS * tokens, EMBEDDING_TOKENS) * BYTES_PER_TOKEN + BODY_SLACK
    return {
        "/v1/embeddings": embeddings,
        "/v1/completions": generation,
        "/v1/chat/completions": generation,
        "other": BODY_SLACK,
    }


def inference_max_conns(service: Mapping[str, Any]) -> int:
    """Return how many requests the gateway sends one worker at a time: what the worker runs and
    queues. Past that, the gateway sheds (503 with Retry-After) instead of queueing in NGINX."""
    return int(service.get("concurrency") or 1) + int(service.get("queue") or 0)


# What the gateway passes to a service's workers, whatever the engine: the OpenAI paths of its task
# (every engine serves these; llama.cpp's and vLLM's own paths such as /slots, /props, /tokenize,
# /v1/stream, /v1/messages, /v1/responses, /pause never pass) and /health; and of the client's
# headers only Content-Type (the JSON body). NGINX sets Host, Content-Length and X-Request-Id itself;
# Authorization (the gateway's key) and everything else, X-Conversation-Id (which makes llama-server
# go on generating after the client left) included, stay at the gateway.
GATEWAY_PATHS = {
    "embeddings": ("/v1/models", "/v1/embeddings"),
    "generation": ("/v1/models", "/v1/completions", "/v1/chat/completions"),
}


GATEWAY_CLIENT_HEADERS = ("Content-Type",)
# The methods each path takes, as OpenAI's API does: the model list and the health check are read, the rest is
# posted. Any other method is a 405 at NGINX (issue 40): no engine sees a DELETE or a GET where it expects a POST.
GATEWAY_METHODS = {
    "/health": ("GET", "HEAD"),
    "/v1/models": ("GET", "HEAD"),
    "/v1/embeddings": ("POST",),
    "/v1/completions": ("POST",),
    "/v1/chat/completions": ("POST",),
}


def inference_gateway_routes(service: Mapping[str, Any], workers: int) -> dict[str, Any]:
    """Return what the service's gateway passes and how much one key may hold: {paths: the OpenAI
    paths of its task, methods: {path: the methods it takes} (those paths and /health), headers: the
    client headers passed (all others are dropped), conns_per_key: the requests at a time one API key
    may have in the gateway: gateway.conns_per_key, else half of what its ``workers`` workers admit
    together (concurrency + queue each), at least 1}. Past it NGINX answers 429, so that one key cannot
    take every worker's slots and starve the other keys."""
    task = service.get("task")
    if task not in GATEWAY_PATHS:
        raise ValueError(f"service {service.get('name')}: task: found {task!r}, expected one of {', '.join(TASKS)}")
    own = (service.get("gateway") or {}).get("conns_per_key")
    admitted = max(int(workers or 0), 0) * inference_max_conns(service)
    paths = list(GATEWAY_PATHS[task])
    return {
        "paths": paths,
        "methods": {path: list(GATEWAY_METHODS[path]) for path in ["/health", *paths]},
        "headers": list(GATEWAY_CLIENT_HEADERS),
        "conns_per_key": int(own) if _is_int(own) and own > 0 else max(1, admitted // 2),
    }


# A server of the upstream block roles/inference/templates/nginx.conf.j2 writes, with the comment that names
# the node of its worker (a worker that spans nodes: its head): "server ADDRESS:PORT ...; # node NAME".
_UPSTREAM_SERVER = re.compile(r"^[ \t]*server[ \t]+(\S+)[ \t][^;#\n]*;[ \t]*#[ \t]*node[ \t]+(\S+)", re.MULTILINE)


def recorded_upstreams(config: str | None) -> dict[str, list[str]]:
    """Return {node: ["address:port"]} of the upstream servers in the gateway config an earlier run wrote (its
    text; {} without one): each node's workers as they were last known, which a node without GPU facts in this run
    keeps (placement.inference_upstream_servers)."""
    recorded: dict[str, list[str]] = {}
    for address, node in _UPSTREAM_SERVER.findall(config or ""):
        recorded.setdefault(node, []).append(address)
    return recorded
