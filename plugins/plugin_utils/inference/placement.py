"""Where a service runs: its nodes, which GPUs of each serve it (one worker per gpus_per_worker GPUs,
around the GPUs training jobs hold: jobs.training_gpus), each worker's port and address, and the
gateway's host and upstreams. A llama.cpp worker may span nodes_per_worker nodes: its head runs
llama-server, the others llama.cpp's RPC server on their GPUs (services._bad_spanning says why so).

Where a node's GPUs come from: ``budgetgpu_gpus.gpus[]`` of gpu_facts (``index``, ``uuid``,
``name``, ``memory_total_mib``, ``compute_capability``), through the node model (nodes.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.module_utils.netinfo import endpoint
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.services import (
    GPUS_PER_WORKER,
    _as_int,
    _is_int,
    rpc_unit_name,
    unit_name,
)
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.jobs import training_gpus
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.nodes import (
    in_group,
    node_address,
    node_gpus,
)


def service_hosts(service: Mapping[str, Any], hostvars: Mapping[str, Any], hosts: list[str]) -> list[str]:
    """Return the service's nodes: the hosts it lists, or those of hosts in its group (inventory order)."""
    nodes = service.get("nodes")
    if isinstance(nodes, list):
        return list(dict.fromkeys(str(h) for h in nodes))
    return [h for h in hosts if in_group(hostvars, h, str(nodes))]


def serves_on(service: Mapping[str, Any], hostvars: Mapping[str, Any], host: str) -> bool:
    """Whether host is a node of the service."""
    nodes = service.get("nodes")
    if isinstance(nodes, list):
        return host in nodes
    return in_group(hostvars, host, str(nodes))


def inference_gateway_host(service: Mapping[str, Any], hostvars: Mapping[str, Any], hosts: list[str]) -> str | None:
    """Return the gateway's host: the one the service names, else its first node."""
    gateway = service.get("gateway") or {}
    if gateway.get("host"):
        return str(gateway["host"])
    nodes = service_hosts(service, hostvars, hosts)
    return nodes[0] if nodes else None


def _wanted_gpus(service: Mapping[str, Any], host: str) -> Any:
    gpus = service.get("gpus")
    if isinstance(gpus, Mapping):
        return gpus.get(host)
    return gpus


def _gpu_label(host: str, gpu: Mapping[str, Any]) -> str:
    return f"{host} GPU {gpu.get('index')} ({gpu.get('name') or 'unknown model'}, {gpu.get('memory_total_mib')} MiB)"


def _placement(
    service: Mapping[str, Any], hostvars: Mapping[str, Any], host: str, jobs: list[Mapping[str, Any]] | None
) -> tuple[list[dict[str, Any]], list[str]]:
    """Return (the GPUs that serve the service on host, the problems of that choice)."""
    name, gpus = service.get("name"), node_gpus(hostvars, host)
    where = f"{host}: service {name}"
    if gpus is None:
        return [], [f"{where}: gpus: found no GPU facts, expected budgetgpu_gpus from gpu_facts (run the probe first)"]
    wanted = _wanted_gpus(service, host)
    if wanted is None:
        return [], [f"{where}: gpus: found no entry for {host}, expected auto or a list of GPU indices for every node"]
    claimed, per_worker = training_gpus(jobs, hostvars, host), _per_worker(service)
    if wanted == "auto":
        free = [g for g in gpus if g.get("index") not in claimed]
        # Whole workers only: the GPUs past the last full group stay free (for training or Slurm).
        chosen = free[: len(free) - len(free) % per_worker]
        if chosen:
            return chosen, []
        if free:
            return [], [
                f"{where}: gpus_per_worker: found {per_worker}, and {len(free)} free GPU(s) on {host} "
                f"({', '.join(str(g.get('index')) for g in free)}), expected at most {len(free)}"
            ]
        if not gpus:
            return [], [f"{where}: gpus: found auto and no GPU in gpu_facts, expected a GPU (is the driver loaded?)"]
        taken = ", ".join(f"GPU {i} ({job})" for i, job in sorted(claimed.items()))
        return [], [f"{where}: gpus: found auto and no GPU left (training jobs use {taken}), expected a free GPU"]
    by_index, chosen, problems = {g.get("index"): g for g in gpus}, [], []
    for index in (_as_int(i) for i in wanted):
        if index not in by_index:
            known = ", ".join(str(i) for i in sorted(by_index)) or "none"
            problems.append(f"{where}: gpus: found GPU {index}, expected a GPU index of {host} ({known})")
        elif index in claimed:
            job = claimed[index]
            problems.append(
                f"{_gpu_label(host, by_index[index])}: service {name}: gpus: found GPU {index}, which training job "
                f"{job} uses (nproc_per_node), expected a GPU no started training job uses (or gpus: auto)"
            )
        else:
            chosen.append(by_index[index])
    if len(wanted) % per_worker:
        problems.append(
            f"{where}: gpus: found {len(wanted)} GPU(s) {list(wanted)}, expected a multiple of gpus_per_worker "
            f"{per_worker} (each worker holds {per_worker})"
        )
    return chosen, problems


def _per_worker(service: Mapping[str, Any]) -> int:
    value = _as_int(service.get("gpus_per_worker"))
    return value if _is_int(value) and value in GPUS_PER_WORKER else 1


def _per_node(service: Mapping[str, Any]) -> int:
    value = _as_int(service.get("nodes_per_worker"))
    return value if _is_int(value) and value >= 1 else 1


def _gpu_groups(service: Mapping[str, Any], gpus: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """A node's GPUs of the service in workers' groups of gpus_per_worker (a rest serves no worker)."""
    per_worker = _per_worker(service)
    return [gpus[i : i + per_worker] for i in range(0, len(gpus) - len(gpus) % per_worker, per_worker)]


def worker_node_groups(service: Mapping[str, Any], hostvars: Mapping[str, Any], hosts: list[str]) -> list[list[str]]:
    """Return the service's nodes in groups of nodes_per_worker, in the service's order: each group's
    workers span it, its first node is their head. Nodes past the last whole group serve no worker
    (spanning_problems names them)."""
    nodes, size = service_hosts(service, hostvars, hosts), _per_node(service)
    return [nodes[i : i + size] for i in range(0, len(nodes) - len(nodes) % size, size)]


def worker_layouts(
    service: Mapping[str, Any], hostvars: Mapping[str, Any], group: list[str], jobs: list[Mapping[str, Any]] | None
) -> list[list[tuple[str, list[dict[str, Any]]]]]:
    """Return each worker of a group of nodes as [(node, its GPUs of the worker)], head first: worker k
    takes the k-th gpus_per_worker GPUs the service gets on every node of the group (as many workers
    as the node with the fewest gives; spanning_problems names a difference)."""
    groups = {host: _gpu_groups(service, _placement(service, hostvars, host, jobs)[0]) for host in group}
    count = min((len(found) for found in groups.values()), default=0)
    return [[(host, groups[host][slot]) for host in group] for slot in range(count)]


def llamacpp_devices(layout: list[tuple[str, list[dict[str, Any]]]]) -> list[tuple[str, dict[str, Any]]]:
    """Return a llama.cpp worker's GPUs as (node, GPU) in llama-server's device order, the order of
    --tensor-split and of its layers: the RPC nodes' GPUs in node order, then the head's own (llama.cpp
    puts RPC devices first, "to minimize network transfers": the last layers and the output stay local)."""
    return [(host, gpu) for host, gpus in [*layout[1:], *layout[:1]] for gpu in gpus]


def llamacpp_tensor_split(service: Mapping[str, Any], gpus: list[Mapping[str, Any]]) -> list[Any]:
    """Return each GPU's share of a llama.cpp worker's layers, in device order: the service's
    tensor_split, else each GPU's memory in the smallest whole numbers (llama.cpp's own default is each
    device's free memory; a GPU that preflight gives one worker alone has nearly all of it free)."""
    split = service.get("tensor_split")
    if isinstance(split, list) and len(split) == len(gpus):
        return list(split)
    memory = [gpu.get("memory_total_mib") if _is_int(gpu.get("memory_total_mib")) else 0 for gpu in gpus]
    if not all(memory):
        return [1] * len(gpus)
    divisor = math.gcd(*memory)
    return [mib // divisor for mib in memory]


def spanning_problems(
    service: Mapping[str, Any],
    hostvars: Mapping[str, Any],
    hosts: list[str],
    jobs: list[Mapping[str, Any]] | None,
    unprobed_ok: bool = False,
) -> list[str]:
    """Return why the service's nodes do not form whole workers of nodes_per_worker nodes: fewer nodes
    than a worker spans, nodes past the last whole worker, a node of a worker that gives it fewer GPUs
    than another (none: a node without GPUs for the service). unprobed_ok: a node without GPU facts is
    left out of the comparison (safe mode)."""
    size, name, nodes = _per_node(service), service.get("name"), service_hosts(service, hostvars, hosts)
    if size == 1:
        return []
    where = f"all: service {name}: nodes_per_worker"
    if len(nodes) < size:
        return [
            f"{where}: found {size}, and the service has {len(nodes)} node(s) ({', '.join(nodes) or 'none'} of "
            f"nodes {service.get('nodes')!r}), expected at most {len(nodes)}"
        ]
    problems = []
    if len(nodes) % size:
        problems.append(
            f"{where}: found {size}, and {len(nodes)} nodes ({', '.join(nodes)}), expected a multiple of {size}: "
            f"{', '.join(nodes[len(nodes) - len(nodes) % size :])} would serve no worker"
        )
    for group in worker_node_groups(service, hostvars, hosts):
        probed = [h for h in group if not (unprobed_ok and node_gpus(hostvars, h) is None)]
        counts = {h: len(_gpu_groups(service, _placement(service, hostvars, h, jobs)[0])) for h in probed}
        if len(set(counts.values())) > 1:
            fewest = min(counts, key=counts.get)
            problems.append(
                f"{fewest}: service {name}: nodes_per_worker: found {fewest} with GPUs for {counts[fewest]} worker(s) "
                f"in a worker of nodes {', '.join(group)} (gpus_per_worker {_per_worker(service)} each: "
                f"{', '.join(f'{h} {c}' for h, c in counts.items())}), expected the same number on every node of a "
                "worker: each worker takes gpus_per_worker GPUs of each of its nodes"
            )
    return problems


# Where a head's own llama.cpp RPC server listens (head_rpc): loopback, so that no other node can reach it
# whatever the firewall holds; the firewall admits the head's own user there (gateway._rpc_entries).
HEAD_RPC_ADDRESS = "127.0.0.1"


def spans_llamacpp(service: Mapping[str, Any]) -> bool:
    """Whether the service's workers are llama.cpp workers over several nodes (a head and RPC nodes)."""
    return service.get("engine") == "llamacpp" and _per_node(service) > 1


def head_rpc_ports(service: Mapping[str, Any], head_gpus: int) -> list[int]:
    """Return the ports of a head's own RPC servers (head_rpc), one per worker slot: after the service's
    port .. port + GPUs - 1 on the head (its workers'), port + GPUs + slot, on loopback. Preflight reserves
    them on every head of a llama.cpp worker over nodes whatever its build (checks._port_owners): the ports do
    not move when the build does."""
    return [int(service["port"]) + head_gpus + slot for slot in range(head_gpus // _per_worker(service))]


def _workers(
    service: Mapping[str, Any],
    hostvars: Mapping[str, Any],
    layouts: list[list[tuple[str, list[dict[str, Any]]]]],
    head_rpc: bool = False,
) -> list[dict[str, Any]]:
    """The workers of worker_layouts on their head; a llama.cpp worker also names its RPC servers (on
    each other node: port + slot, that node's GPUs of it; with head_rpc, the head's own last, on
    head_rpc_ports) and its tensor_split (llamacpp_tensor_split)."""
    name, port = str(service.get("name")), service.get("port")
    own_ports = head_rpc_ports(service, len(layouts) * _per_worker(service)) if head_rpc else []
    workers = []
    for slot, layout in enumerate(layouts):
        host, group = layout[0]
        worker = {
            "service": name,
            "host": host,
            "slot": slot,
            # The first GPU names the worker (metrics' labels, the unit's comment); all of them pin it.
            "gpu_index": group[0].get("index"),
            "gpu_uuid": group[0].get("uuid"),
            "gpu_indices": [gpu.get("index") for gpu in group],
            "gpu_uuids": [gpu.get("uuid") for gpu in group],
            "port": port + slot,
            "address": node_address(hostvars, host),
            "unit": unit_name(name, slot),
        }
        if service.get("engine") == "llamacpp":
            worker["rpc_servers"] = [
                {
                    "host": node,
                    "slot": slot,
                    "address": node_address(hostvars, node),
                    "port": port + slot,
                    "gpu_indices": [gpu.get("index") for gpu in gpus],
                    "gpu_uuids": [gpu.get("uuid") for gpu in gpus],
                    "unit": rpc_unit_name(name, slot),
                }
                for node, gpus in layout[1:]
            ]
            if own_ports and worker["rpc_servers"]:
                # Last in --rpc: llama-server's devices keep the order of a head with GPUs of its own (the RPC
                # nodes', then the head's), which tensor_split and preflight's arithmetic count in.
                worker["rpc_servers"].append(
                    {
                        "host": host,
                        "slot": slot,
                        "address": HEAD_RPC_ADDRESS,
                        "port": own_ports[slot],
                        "gpu_indices": worker["gpu_indices"],
                        "gpu_uuids": worker["gpu_uuids"],
                        "unit": rpc_unit_name(name, slot),
                    }
                )
            worker["tensor_split"] = llamacpp_tensor_split(service, [gpu for _node, gpu in llamacpp_devices(layout)])
        workers.append(worker)
    return workers


def rpc_node_gpus(
    service: Mapping[str, Any],
    hostvars: Mapping[str, Any],
    host: str,
    jobs: list[Mapping[str, Any]] | None,
    hosts: list[str],
) -> list[dict[str, Any]]:
    """Return the GPUs host gives the RPC servers of the service's workers that span nodes ([] on a head or a
    node that is no worker's): its whole workers' GPUs from its own facts alone, so that they are known (and
    held from Slurm) while the head is down."""
    if not any(host in group[1:] for group in worker_node_groups(service, hostvars, hosts)):
        return []
    return [gpu for gpus in _gpu_groups(service, _placement(service, hostvars, host, jobs)[0]) for gpu in gpus]


def inference_workers(
    service: Mapping[str, Any],
    hostvars: Mapping[str, Any],
    host: str,
    jobs: list[Mapping[str, Any]] | None = None,
    hosts: list[str] | None = None,
    head_rpc: bool = False,
) -> list[dict[str, Any]]:
    """Return the workers of the service whose head is host, one per gpus_per_worker GPUs ([] where host
    is not a node of it, or only an RPC node): {service, host, slot, gpu_index, gpu_uuid (its first
    GPU's), gpu_indices, gpu_uuids, port, address, unit}; engine llamacpp adds rpc_servers ([{host, slot,
    address, port, gpu_indices, gpu_uuids, unit}], the other nodes of a worker that spans nodes_per_worker
    nodes, in llama-server's --rpc order, else []) and tensor_split (each GPU's share, in llama-server's
    device order). Slot i listens on port + i.
    hosts: the inventory's hosts, which order a group of nodes (default: hostvars' order).
    head_rpc: the head's llama-server has no GPU device of its own (a build without a GPU backend,
    engines.llamacpp_head_rpc): a worker over nodes reaches the head's GPUs through an RPC server on the head,
    the last of its rpc_servers (on loopback, head_rpc_ports)."""
    if not serves_on(service, hostvars, host):
        return []
    if _per_node(service) == 1:
        gpus, problems = _placement(service, hostvars, host, jobs)
        if problems:
            raise ValueError("; ".join(problems))
        return _workers(service, hostvars, [[(host, group)] for group in _gpu_groups(service, gpus)])
    hosts = list(hosts or hostvars)
    group = next((g for g in worker_node_groups(service, hostvars, hosts) if host in g), [])
    # A node without facts in another worker's group is that worker's (inference_upstream_servers keeps its
    # servers of the last run): it stops no other group; one in this group does (its GPUs are not known).
    problems = spanning_problems(service, hostvars, hosts, jobs, unprobed_ok=True)
    problems += [p for node in group for p in _placement(service, hostvars, node, jobs)[1]]
    if problems:
        raise ValueError("; ".join(problems))
    if not group or group[0] != host:
        return []
    return _workers(service, hostvars, worker_layouts(service, hostvars, group, jobs), head_rpc)


def inference_rpc_servers(
    service: Mapping[str, Any],
    hostvars: Mapping[str, Any],
    host: str,
    hosts: list[str],
    jobs: list[Mapping[str, Any]] | None = None,
    head_rpc: bool = False,
) -> list[dict[str, Any]]:
    """Return the llama.cpp RPC servers host runs for the service's workers that span nodes: {host, slot,
    address, port, gpu_indices, gpu_uuids, unit (rpc_unit_name), service, head, head_address} (head: the
    worker's head node, which alone connects to it); [] on a node of a worker of one node, and on a head
    unless head_rpc (inference_workers: its own, where host is the head)."""
    groups = worker_node_groups(service, hostvars, hosts) if spans_llamacpp(service) else []
    group = next((g for g in groups if host in (g if head_rpc else g[1:])), None)
    if group is None:
        return []
    return [
        {**server, "service": worker["service"], "head": worker["host"], "head_address": worker["address"]}
        for worker in inference_workers(service, hostvars, group[0], jobs, hosts, head_rpc)
        for server in worker["rpc_servers"]
        if server["host"] == host
    ]


def inference_upstream_servers(
    service: Mapping[str, Any],
    hostvars: Mapping[str, Any],
    hosts: list[str],
    jobs: list[Mapping[str, Any]] | None = None,
    recorded: Mapping[str, list[str]] | None = None,
) -> dict[str, Any]:
    """Return {servers, stale, unknown} of the service's gateway. servers: {address ("address:port"), node (the
    worker's head)} of every worker of every node, in inventory order. A node without GPU facts in this run (down,
    its cached facts expired, or left out by --limit) keeps the servers of the last configuration (recorded: {head:
    ["address:port"]}, gateway.recorded_upstreams; a worker that spans nodes keeps its head's while any of them has
    none) and is named in stale: NGINX finds them failing and passes their requests to the others, and one node down
    does not stop the configuration of the others. One that recorded does not hold is named in unknown and left out.
    A node with facts whose placement fails raises, as inference_workers does."""
    servers, stale, unknown = [], [], []
    for group in worker_node_groups(service, hostvars, hosts):
        head, down = group[0], [node for node in group if node_gpus(hostvars, node) is None]
        if down:
            kept = list((recorded or {}).get(head) or [])
            servers += [{"address": address, "node": head} for address in kept]
            (stale if kept else unknown).extend(down)
            continue
        servers += [
            {"address": endpoint(worker["address"], worker["port"]), "node": head}
            for worker in inference_workers(service, hostvars, head, jobs, hosts)
        ]
    return {"servers": servers, "stale": list(dict.fromkeys(stale)), "unknown": list(dict.fromkeys(unknown))}
