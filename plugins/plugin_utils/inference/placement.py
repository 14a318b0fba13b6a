"""Where a service runs: its nodes, which GPUs of each serve it (one worker per gpus_per_worker GPUs,
around the GPUs training jobs hold: jobs.training_gpus), each worker's port and address, and the
gateway's host and upstreams.

Where a node's GPUs come from: ``budgetgpu_gpus.gpus[]`` of gpu_facts (``index``, ``uuid``,
``name``, ``memory_total_mib``, ``compute_capability``), through the node model (nodes.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.module_utils.netinfo import endpoint
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.services import (
    GPUS_PER_WORKER,
    _as_int,
    _is_int,
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


def _workers(
    service: Mapping[str, Any], hostvars: Mapping[str, Any], host: str, gpus: list[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    address, name, port = node_address(hostvars, host), str(service.get("name")), service.get("port")
    # _placement chose whole workers' worth of GPUs (or reported the list that is not).
    per_worker = _per_worker(service)
    groups = [gpus[i : i + per_worker] for i in range(0, len(gpus), per_worker)]
    return [
        {
            "service": name,
            "host": host,
            "slot": slot,
            # The first GPU names the worker (metrics' labels, the unit's comment); all of them pin it.
            "gpu_index": group[0].get("index"),
            "gpu_uuid": group[0].get("uuid"),
            "gpu_indices": [gpu.get("index") for gpu in group],
            "gpu_uuids": [gpu.get("uuid") for gpu in group],
            "port": port + slot,
            "address": address,
            "unit": unit_name(name, slot),
        }
        for slot, group in enumerate(groups)
    ]


def inference_workers(
    service: Mapping[str, Any], hostvars: Mapping[str, Any], host: str, jobs: list[Mapping[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Return the workers of the service on host, one per gpus_per_worker GPUs ([] where host is not a
    node of it): {service, host, slot, gpu_index, gpu_uuid (its first GPU's), gpu_indices, gpu_uuids,
    port, address, unit}. Slot i listens on port + i."""
    if not serves_on(service, hostvars, host):
        return []
    gpus, problems = _placement(service, hostvars, host, jobs)
    if problems:
        raise ValueError("; ".join(problems))
    return _workers(service, hostvars, host, gpus)


def inference_upstreams(
    service: Mapping[str, Any],
    hostvars: Mapping[str, Any],
    hosts: list[str],
    jobs: list[Mapping[str, Any]] | None = None,
) -> list[str]:
    """Return "address:port" of every worker of every node of the service, in inventory order."""
    return [
        endpoint(worker["address"], worker["port"])
        for host in service_hosts(service, hostvars, hosts)
        for worker in inference_workers(service, hostvars, host, jobs)
    ]
