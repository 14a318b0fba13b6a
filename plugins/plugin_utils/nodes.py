"""The node model: what the run knows of each host, read out of its hostvars. The one reader of
hostvars in the plugins: every other module asks this one for a host's facts, variables, group
membership, address and GPUs (tests/unit/test_code_shape.py holds that).

A host's facts are its ansible_facts (the probes': budgetgpu_gpus, budgetgpu_pcie, budgetgpu_net;
setup's), else the variable of that name (a fact set_fact gives lives beside them), and for the roles
that keep a local fact (python_env, gpu_health) its ansible_local. Its address is decided here once:
its cluster address (net_facts' cluster_interface), else its ansible_host, else its inventory name.

Controller-side and pure (hostvars in, dicts out; no I/O). It decides nothing else: the job model
(jobs.py), the checks (preflight.py), Slurm (slurm.py) and the service model (inference.py) read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def host_vars(hostvars: Any, host: str) -> Mapping[str, Any]:
    """Return the host's variables; {} for a host hostvars lacks (Ansible's HostVars answers an undefined
    marker for it, a dict KeyError)."""
    value = hostvars.get(host) if isinstance(hostvars, Mapping) else None
    return value if isinstance(value, Mapping) else {}


def inventory_vars(hostvars: Any, host: str) -> Mapping[str, Any]:
    """Return the host's variables untemplated (Ansible's HostVars.raw_get): the inventory's and this run's."""
    return hostvars.raw_get(host)


def host_var(hostvars: Any, host: str, name: str) -> Any:
    """Return one variable of the host (a role's fact or input), None where it has none."""
    return host_vars(hostvars, host).get(name)


def node_facts(hostvars: Any, host: str) -> Mapping[str, Any]:
    """Return the host's ansible_facts ({} without any)."""
    value = host_var(hostvars, host, "ansible_facts")
    return value if isinstance(value, Mapping) else {}


def fact(hostvars: Any, host: str, name: str) -> Any:
    """Return one fact of the host: its ansible_facts' name, else its variable name (set_fact)."""
    value = node_facts(hostvars, host).get(name)
    return host_var(hostvars, host, name) if value is None else value


def local_fact(hostvars: Any, host: str, name: str) -> Any:
    """Return the host's local fact name (ansible_local: the file a role keeps in /etc/ansible/facts.d)."""
    return (node_facts(hostvars, host).get("ansible_local") or {}).get(name)


def in_group(hostvars: Any, host: str, group: str) -> bool:
    """Whether host is in the inventory group ("all": every host)."""
    return group == "all" or group in (host_var(hostvars, host, "group_names") or [])


def cluster_address(hostvars: Any, host: str) -> str | None:
    """Return the host's cluster address (net_facts' cluster_interface), None where this run has none."""
    net = fact(hostvars, host, "budgetgpu_net")
    chosen = net.get("cluster_interface") if isinstance(net, Mapping) else None
    address = chosen.get("address") if isinstance(chosen, Mapping) else None
    return str(address) if address else None


def node_address(hostvars: Any, host: str, control: bool = False) -> str:
    """Return the address the nodes reach host at: its cluster address, else its ansible_host, else its
    name. control: the address the control node reaches it at (ansible_host first, how it already does)."""
    ansible_host = host_var(hostvars, host, "ansible_host")
    if control and ansible_host:
        return str(ansible_host)
    return cluster_address(hostvars, host) or str(ansible_host or host)


def simulated(hostvars: Any, host: str) -> bool:
    """Whether host is a simulated node (role gpu_sim; budgetgpu_simulated, as YAML or INI writes it)."""
    return str(host_var(hostvars, host, "budgetgpu_simulated")).lower() in ("true", "yes", "1", "on")


def node_gpus(hostvars: Any, host: str) -> list[dict[str, Any]] | None:
    """Return the host's GPUs from gpu_facts (None without facts), in nvidia-smi (NVML) order."""
    gpus = fact(hostvars, host, "budgetgpu_gpus")
    if not isinstance(gpus, Mapping):
        return None
    return sorted((dict(g) for g in gpus.get("gpus") or [] if isinstance(g, Mapping)), key=lambda g: g.get("index", 0))


def node_info(hostvars: Any, host: str) -> dict[str, Any]:
    """Return what the checks and units need to know about one node, from its hostvars."""
    gpus = fact(hostvars, host, "budgetgpu_gpus")
    pcie = fact(hostvars, host, "budgetgpu_pcie")
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
    setup = node_facts(hostvars, host)
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
        # python_env's facts: set in this run, else its local fact.
        "python_env": fact(hostvars, host, "budgetgpu_python_env")
        or local_fact(hostvars, host, "budgetgpu_python_env"),
        "vcpus": setup.get("processor_nproc") or setup.get("processor_vcpus"),
        "cluster_address": cluster_address(hostvars, host),
        # The kernel's ephemeral port range [low, high] (net_facts), None where the probe did not read it.
        "ephemeral_ports": (fact(hostvars, host, "budgetgpu_net") or {}).get("ephemeral_ports"),
        "address": node_address(hostvars, host),
        "simulated": simulated(hostvars, host),
        "node_rank": host_var(hostvars, host, "torchrun_node_rank"),
        # The inventory's expectations for the probe (role probe); preflight checks them itself.
        "pcie_min_width": host_var(hostvars, host, "probe_pcie_min_width"),
        "pcie_expected": host_var(hostvars, host, "probe_pcie_expected") or {},
        # Facts the preflight role sets on each node (CONTRIBUTING lists them).
        "scripts_found": host_var(hostvars, host, "budgetgpu_preflight_scripts") or {},
        "jobs_digest": host_var(hostvars, host, "budgetgpu_preflight_jobs_digest"),
        # Role gpu_health's quarantined GPUs ({uuid: {reason, since, by}}): its local fact, read by
        # preflight's setup, or the fact it sets in a run.
        "gpu_quarantine": (local_fact(hostvars, host, "budgetgpu_gpu_health") or {}).get("quarantine")
        or host_var(hostvars, host, "budgetgpu_gpu_quarantine")
        or {},
    }


def cluster_nodes(hostvars: Any, hosts: list[str], failed: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Return node_info for each of hosts, keyed by host; `failed` hosts (unreachable, or their probe
    failed in this run) count as not probed even where the fact cache still holds older facts."""
    nodes = {}
    for host in dict.fromkeys(hosts):
        nodes[host] = node_info(hostvars, host)
        if host in (failed or []):
            nodes[host]["probed"] = False
    return nodes
