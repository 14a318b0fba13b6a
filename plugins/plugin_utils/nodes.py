"""What the run knows of each node: one summary per host from its hostvars (the probes' facts, the
preflight's, the health watch's quarantine, the inventory's expectations), for the cluster check, the
units, the inference placement and Slurm's batch jobs.

Controller-side and pure (hostvars in, dicts out; no I/O). It reads the facts of several roles (probe:
budgetgpu_gpus, budgetgpu_pcie, budgetgpu_net; python_env; preflight; gpu_health) and decides nothing:
the job model (jobs.py), the checks (preflight.py) and the service model (inference.py) read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _facts(hostvars: Mapping[str, Any]) -> Mapping[str, Any]:
    facts = hostvars.get("ansible_facts") or {}
    return facts if isinstance(facts, Mapping) else {}


def node_info(hostvars: Mapping[str, Any], host: str) -> dict[str, Any]:
    """Return what the checks and units need to know about one node, from its hostvars."""
    facts = _facts(hostvars)
    gpus = facts.get("budgetgpu_gpus")
    pcie = facts.get("budgetgpu_pcie")
    net = facts.get("budgetgpu_net") or {}
    driver = (gpus or {}).get("driver") or {}
    loaded = driver.get("state") == "loaded"
    # Without a loaded driver NVML sees nothing, but the GPUs are still on the PCI bus.
    if gpus is not None and loaded:
        gpu_count, models = int(gpus.get("count") or 0), [g.get("name") for g in gpus.get("gpus") or []]
    elif pcie is not None:
        gpu_count, models = int(pcie.get("count") or 0), [g.get("name") for g in pcie.get("gpus") or []]
    else:
        gpu_count, models = None, []
    pcie_gpus = (pcie or {}).get("gpus") or []
    if pcie_gpus and all(g.get("device_id") for g in pcie_gpus):
        # A model is what its PCI device id says, read from sysfs with or without a driver: NVML's
        # "NVIDIA GeForce RTX 3090" on a provisioned node and the sysfs table's "GeForce RTX 3090"
        # on a fresh one are the same card.
        models = [f"{g.get('name')} ({g['device_id']})" for g in pcie_gpus]
    cluster_if = net.get("cluster_interface") if isinstance(net, Mapping) else None
    return {
        "host": host,
        "probed": gpus is not None or pcie is not None,
        "gpu_count": gpu_count,
        "gpu_uuids": [g.get("uuid") for g in (gpus or {}).get("gpus") or [] if g.get("uuid")] if loaded else [],
        "gpu_models": [m for m in models if m],
        # NVML's view of each GPU (name, uuid, memory, compute capability) where the driver answers.
        "gpus": list((gpus or {}).get("gpus") or []) if loaded else [],
        "driver_state": driver.get("state"),
        "driver_version": driver.get("version"),
        "pcie": pcie,
        "python_env": facts.get("budgetgpu_python_env")
        or (facts.get("ansible_local") or {}).get("budgetgpu_python_env"),
        "vcpus": facts.get("processor_nproc") or facts.get("processor_vcpus"),
        "cluster_address": (cluster_if or {}).get("address"),
        "address": hostvars.get("ansible_host") or host,
        "simulated": bool(hostvars.get("budgetgpu_simulated", False)),
        "node_rank": hostvars.get("torchrun_node_rank"),
        # The inventory's expectations for the probe (role probe); preflight checks them itself.
        "pcie_min_width": hostvars.get("probe_pcie_min_width"),
        "pcie_expected": hostvars.get("probe_pcie_expected") or {},
        # Facts the preflight role sets on each node (CONTRIBUTING lists them).
        "scripts_found": hostvars.get("budgetgpu_preflight_scripts") or {},
        "jobs_digest": hostvars.get("budgetgpu_preflight_jobs_digest"),
        # Role gpu_health's quarantined GPUs ({uuid: {reason, since, by}}): its local fact, read by
        # preflight's setup, or the fact it sets in a run.
        "gpu_quarantine": ((facts.get("ansible_local") or {}).get("budgetgpu_gpu_health") or {}).get("quarantine")
        or hostvars.get("budgetgpu_gpu_quarantine")
        or {},
    }


def cluster_nodes(
    hostvars: Mapping[str, Any], hosts: list[str], failed: list[str] | None = None
) -> dict[str, dict[str, Any]]:
    """Return node_info for each of hosts, keyed by host; `failed` hosts (unreachable, or their probe
    failed in this run) count as not probed even where the fact cache still holds older facts."""
    nodes = {}
    for host in dict.fromkeys(hosts):
        nodes[host] = node_info(hostvars.get(host) or {}, host)
        if host in (failed or []):
            nodes[host]["probed"] = False
    return nodes
