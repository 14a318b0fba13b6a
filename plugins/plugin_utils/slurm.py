"""What Slurm is told about the nodes (role slurm): each node's slurm.conf line (CPUs, sockets, cores,
threads and memory from its facts, RealMemory with a margin below what slurmd detects), its GPUs as
GRES (File= the device node by minor number, Type= a stable name from the PCI device id, Cores= from
the GPU's NUMA node), leaving out the GPUs that inference workers or systemd training jobs hold, and
what cgroup.conf may constrain on the node's kernel. Controller side, pure over hostvars."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.module_utils import energy
from ansible_collections.budgetgpu.cluster.plugins.module_utils.device_allow import gpu_minor
from ansible_collections.budgetgpu.cluster.plugins.module_utils.pcie import GPU_NAMES
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.placement import (
    inference_workers,
    rpc_node_gpus,
)
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.jobs import PORT_KEYS, job_hosts, training_gpus
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.nodes import fact, host_var, node_address, node_facts

# Below what slurmd detects: a node whose RealMemory is above what slurmd finds is drained ("Low
# RealMemory"), and the kernel's MemTotal moves by a few MiB between boots and kernels.
DEFAULT_MEMORY_MARGIN_PCT = 5
MIN_MEMORY_MARGIN_MIB = 512

# The character device of NVIDIA GPU N (major 195, minor N), as the driver creates it.
NVIDIA_DEVICE = "/dev/nvidia{minor}"


def gres_type(device_id: Any) -> str:
    """Return the GRES type of a GPU model, from its PCI device id (as gpu_bench's model_key identifies
    models: names differ between drivers, the id does not): the name pcie.GPU_NAMES gives it, lower
    case, without "GeForce" and spaces ("GeForce RTX 3090" -> "rtx3090", "H200" -> "h200"), else
    "nvidia_<id>" ("nvidia_2b00"). ValueError for no id or a malformed one."""
    try:
        number = device_id if isinstance(device_id, int) else int(str(device_id).strip(), 16)
    except ValueError:
        raise ValueError(f"found PCI device id {device_id!r}, expected a hex id such as 0x2204") from None
    name = GPU_NAMES.get(number)
    if name is None:
        return f"nvidia_{number:04x}"
    return re.sub(r"[^a-z0-9]", "", name.lower().replace("geforce", ""))


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def real_memory(memtotal_mib: Any, margin_pct: Any = DEFAULT_MEMORY_MARGIN_PCT) -> int:
    """Return RealMemory (MiB) for a node whose kernel reports memtotal_mib: margin_pct below it, and at
    least MIN_MEMORY_MARGIN_MIB below (a small node's 5% is less than a kernel update moves)."""
    total, margin = _int(memtotal_mib), _int(margin_pct)
    if total is None or total <= 0:
        raise ValueError(f"found memtotal_mb {memtotal_mib!r}, expected the node's memory in MiB (gather facts)")
    if margin is None or not 0 <= margin < 100:
        raise ValueError(f"slurm_memory_margin_pct: found {margin_pct!r}, expected a percentage from 0 to 99")
    return max(1, min(total * (100 - margin) // 100, total - MIN_MEMORY_MARGIN_MIB))


def cpu_layout(facts: Mapping[str, Any]) -> dict[str, int]:
    """Return {CPUs, Sockets, CoresPerSocket, ThreadsPerCore} from a node's setup facts; where the
    facts do not multiply out (a VM without physical ids), {CPUs} alone: Slurm then counts every CPU
    as a core of one socket, which slurmd never finds lower than configured."""
    cpus = _int(facts.get("processor_vcpus"))
    if not cpus:
        found = facts.get("processor_vcpus")
        raise ValueError(f"found processor_vcpus {found!r}, expected the CPU count (gather facts)")
    sockets = _int(facts.get("processor_count"))
    cores = _int(facts.get("processor_cores"))
    threads = _int(facts.get("processor_threads_per_core"))
    if sockets and cores and threads and sockets * cores * threads == cpus:
        return {"CPUs": cpus, "Sockets": sockets, "CoresPerSocket": cores, "ThreadsPerCore": threads}
    return {"CPUs": cpus}


def held_gpus(
    hostvars: Mapping[str, Any],
    host: str,
    services: list[Mapping[str, Any]] | None,
    jobs: list[Mapping[str, Any]] | None,
) -> dict[int, dict[str, Any]]:
    """Return {GPU index: {why: who holds it, user: the user its unit runs as}} on host: the inference workers and
    a spanning llama.cpp worker's RPC servers (the service model's placement, services normalised by
    inference_services_normalize) and the started systemd training jobs (normalised: each has its user)."""
    job_users = {str(job.get("name")): job.get("user") for job in jobs or []}
    held = {
        index: {"why": f"training job {job}", "user": job_users.get(job)}
        for index, job in training_gpus(jobs, hostvars, host).items()
    }
    for service in services or []:
        if service.get("state") == "absent":
            continue
        user = service.get("user")
        # An RPC node's GPUs from its own facts: its head's plan would fail while the head is down.
        rpc = rpc_node_gpus(service, hostvars, host, jobs, list(hostvars))
        for gpu in rpc:
            why = f"llama.cpp RPC server of service {service.get('name')}"
            held.setdefault(int(gpu["index"]), {"why": why, "user": user})
        for worker in [] if rpc else inference_workers(service, hostvars, host, jobs):
            for index in worker["gpu_indices"]:
                held.setdefault(int(index), {"why": f"inference worker {worker['unit']}", "user": user})
    return held


def _core_range(numa_node: Any, layout: Mapping[str, int]) -> str | None:
    """Slurm numbers cores socket by socket (socket s holds cores s*CoresPerSocket...): a GPU on NUMA
    node n of a node with one NUMA node per socket is local to socket n's cores. One socket, an unknown
    NUMA node or more NUMA nodes than sockets (AMD's NPS4): None, every core may drive it."""
    sockets, per_socket, node = layout.get("Sockets"), layout.get("CoresPerSocket"), _int(numa_node)
    if not sockets or sockets < 2 or not per_socket or node is None or not 0 <= node < sockets:
        return None
    first = node * per_socket
    return f"{first}-{first + per_socket - 1}"


def _node_gpus(
    facts: Mapping[str, Any], layout: Mapping[str, int], held: Mapping[int, Mapping[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    """Return (the GPUs Slurm may hand out, those left out with who holds them, their device file and the user
    its unit runs as, problems) from gpu_facts joined by bus id with pcie_facts."""
    gpu_fact, pcie_fact = facts["budgetgpu_gpus"], facts["budgetgpu_pcie"]
    pcie = {str(g.get("bus_id", "")).lower(): g for g in pcie_fact.get("gpus") or [] if isinstance(g, Mapping)}
    gpus, left_out, problems = [], [], []
    for gpu in sorted(gpu_fact.get("gpus") or [], key=lambda g: g.get("index", 0)):
        index, bus_id = gpu.get("index"), str(gpu.get("bus_id", "")).lower()
        if index in held:
            file = NVIDIA_DEVICE.format(minor=gpu_minor(gpu))
            left_out.append({"index": index, "bus_id": bus_id, "file": file, **held[index]})
            continue
        link = pcie.get(bus_id)
        if link is None:
            problems.append(f"GPU {index} ({bus_id}): found no PCI function in budgetgpu_pcie, expected one per GPU")
            continue
        try:
            kind = gres_type(link.get("device_id"))
        except ValueError as exc:
            problems.append(f"GPU {index} ({bus_id}): {exc}")
            continue
        minor = gpu_minor(gpu)
        gpus.append(
            {
                "index": index,
                "uuid": gpu.get("uuid"),
                "bus_id": bus_id,
                "type": kind,
                "file": NVIDIA_DEVICE.format(minor=minor),
                "cores": _core_range(link.get("numa_node"), layout),
            }
        )
    return gpus, left_out, problems


def slurm_node(
    hostvars: Mapping[str, Any],
    host: str,
    services: list[Mapping[str, Any]] | None = None,
    jobs: list[Mapping[str, Any]] | None = None,
    margin_pct: Any = DEFAULT_MEMORY_MARGIN_PCT,
) -> dict[str, Any]:
    """Return what Slurm is told about host: {host, name (its hostname, which slurmd answers to), address
    (the cluster address), layout (cpu_layout), real_memory, gpus [{index, uuid, bus_id, type, file,
    cores}], left_out [{index, bus_id, file, why, user}], gres ("gpu:rtx3090:4,..." or "")}. GPUs come from
    gpu_facts joined by bus id with pcie_facts (device id, NUMA node). ValueError naming host and what
    is missing."""
    setup = node_facts(hostvars, host)
    try:
        layout = cpu_layout(setup)
        memory = real_memory(setup.get("memtotal_mb"), margin_pct)
    except ValueError as exc:
        raise ValueError(f"{host}: {exc}") from None
    if not isinstance(setup.get("budgetgpu_gpus"), Mapping) or not isinstance(setup.get("budgetgpu_pcie"), Mapping):
        raise ValueError(f"{host}: found no budgetgpu_gpus/budgetgpu_pcie facts, expected the probe's (run role probe)")
    gpus, left_out, problems = _node_gpus(setup, layout, held_gpus(hostvars, host, services, jobs))
    if problems:
        raise ValueError(f"{host}: " + "; ".join(problems))
    counts: dict[str, int] = {}
    for gpu in gpus:
        counts[gpu["type"]] = counts.get(gpu["type"], 0) + 1
    return {
        "host": host,
        "name": str(setup.get("hostname") or host),
        "address": node_address(hostvars, host),
        "layout": layout,
        "real_memory": memory,
        "gpus": gpus,
        "left_out": left_out,
        "gres": ",".join(f"gpu:{kind}:{count}" for kind, count in sorted(counts.items())),
    }


def slurm_nodes(
    hosts: list[str],
    hostvars: Mapping[str, Any],
    services: list[Mapping[str, Any]] | None = None,
    margin_pct: Any = DEFAULT_MEMORY_MARGIN_PCT,
    absent: list[str] | None = None,
    recorded: str | None = None,
) -> list[dict[str, Any]]:
    """Return slurm_node for every host, each with its own training jobs (its budgetgpu_jobs fact) and
    proctrack_cgroup (whether its kernel lets Slurm track processes by cgroup: the role's _slurm_cgroup);
    every bad host's problem in one ValueError. A host of absent (not in this run: down, unreachable, or failed
    an earlier task) takes its last known entry from recorded (the hosts file an earlier run wrote, its
    record_line comments), marked stale: its facts may have expired (fact_caching_timeout), and one node down
    must not stop every host's Slurm configuration."""
    nodes, problems = [], []
    last_known = recorded_nodes(recorded or "")
    for host in hosts:
        if host in (absent or []) and host in last_known:
            nodes.append({**last_known[host], "stale": True})
            continue
        jobs = fact(hostvars, host, "budgetgpu_jobs")
        try:
            node = slurm_node(hostvars, host, services, jobs if isinstance(jobs, list) else [], margin_pct)
        except ValueError as exc:
            why = " (not in this run: down or unreachable, and no earlier run recorded it)"
            problems.append(str(exc) + (why if host in (absent or []) else ""))
            continue
        cgroup = host_var(hostvars, host, "_slurm_cgroup")
        node["proctrack_cgroup"] = cgroup.get("proctrack_cgroup") if isinstance(cgroup, Mapping) else None
        nodes.append(node)
    if problems:
        raise ValueError("; ".join(problems))
    return nodes


# The hosts file (/etc/budgetgpu/slurm-hosts: "name address" lines for torchrun.sbatch) keeps each node's entry on
# a comment line, read back for a node that is down on a later run. Not slurm.conf: its parser has a line limit.
RECORD_PREFIX = "# budgetgpu-node "


def record_line(node: Mapping[str, Any]) -> str:
    """Return the node's entry (slurm_nodes, without stale) as one comment line of the hosts file."""
    entry = {key: value for key, value in node.items() if key != "stale"}
    return RECORD_PREFIX + json.dumps(entry, sort_keys=True, separators=(",", ":"))


def recorded_nodes(conf: str) -> dict[str, dict[str, Any]]:
    """Return {host: entry} of the record_line comments of a hosts file; lines that do not parse are skipped."""
    found = {}
    for line in conf.splitlines():
        if line.startswith(RECORD_PREFIX):
            try:
                node = json.loads(line[len(RECORD_PREFIX) :])
            except ValueError:
                continue
            if isinstance(node, dict) and isinstance(node.get("host"), str):
                found[node["host"]] = node
    return found


def node_conf_line(node: Mapping[str, Any]) -> str:
    """Return the node's NodeName line of slurm.conf."""
    words = [f"NodeName={node['name']}", f"NodeAddr={node['address']}"]
    words += [f"{key}={value}" for key, value in node["layout"].items()]
    words.append(f"RealMemory={node['real_memory']}")
    if node.get("gres"):
        words.append(f"Gres={node['gres']}")
    return " ".join(words + ["State=UNKNOWN"])


def gres_conf_lines(node: Mapping[str, Any]) -> list[str]:
    """Return the node's gres.conf lines, one per GPU Slurm may hand out."""
    lines = []
    for gpu in node.get("gpus") or []:
        line = f"NodeName={node['name']} Name=gpu Type={gpu['type']} File={gpu['file']}"
        lines.append(line + (f" Cores={gpu['cores']}" if gpu.get("cores") else ""))
    return lines


def mem_per_cpu(node: Mapping[str, Any]) -> int:
    """Return the node's RealMemory per CPU (MiB): what a job that asks for no memory gets per CPU."""
    return max(1, int(node["real_memory"]) // int(node["layout"]["CPUs"]))


# slurmd -G: "slurmd: Gres Name=gpu Type=rtx3090 Count=1 Index=0 ID=7696487 File=/dev/nvidia0 (null)"
_GRES_FOUND = re.compile(r"Gres Name=gpu Type=(\S+) .*File=(\S+)")


PORT_RANGE = re.compile(r"\s*(\d+)\s*-\s*(\d+)\s*")


def port_range_problems(ranges: Mapping[str, Any], host: str) -> list[str]:
    """Return a message naming the host and the variable for each of `ranges` ({variable: "LOW-HIGH"})
    that is not a range within 1024-65535, and for each two that overlap (srun's I/O ports and the
    batch jobs' rendezvous ports must not meet: the firewall and the jobs read each from its own)."""
    problems: list[str] = []
    bounds: dict[str, tuple[int, int]] = {}
    for name, text in ranges.items():
        match = PORT_RANGE.fullmatch(str(text))
        if match and 1024 <= int(match[1]) <= int(match[2]) <= 65535:
            bounds[name] = (int(match[1]), int(match[2]))
        else:
            problems.append(f"{host}: {name}: found {text!r}, expected a port range LOW-HIGH within 1024-65535")
    names = sorted(bounds)
    for index, name in enumerate(names):
        for other in names[index + 1 :]:
            if bounds[name][0] <= bounds[other][1] and bounds[other][0] <= bounds[name][1]:
                problems.append(
                    f"{host}: {name} ({ranges[name]}) overlaps {other} ({ranges[other]}), expected separate ranges"
                )
    return problems


_CHECKPOINT_ROOT = re.compile(r"/\S*[^/\s]")


def _job_port_problems(inputs: Mapping[str, Any], low: int, high: int) -> list[str]:
    """A systemd job on a Slurm host whose port or store_port lies in slurm_rendezvous_ports: table
    budgetgpu_slurm_jobs (every Slurm host) resets every connection to that range but root's and a running batch
    job's user's on its two ports, so the job's own connections would be reset."""
    slurm_hosts = [inputs.get("controller_host"), *(inputs.get("node_hosts") or [])]
    problems = []
    for job in inputs.get("jobs") or []:
        hosts = [host for host in job_hosts(job, inputs.get("groups") or {}) if host in slurm_hosts]
        if job.get("state") == "absent" or not hosts:
            continue
        problems += [
            f"{', '.join(hosts)}: job {job.get('name')}: {key}: found {job[key]}, expected a port outside "
            f"slurm_rendezvous_ports ({low}-{high}) on a Slurm host (its table resets every connection to that range "
            "but root's and a running batch job's user's)"
            for key in PORT_KEYS
            if isinstance(job.get(key), int) and low <= job[key] <= high
        ]
    return problems


def preflight_problems(inputs: Mapping[str, Any]) -> list[str]:
    """Return every problem of role slurm's cluster inputs, each naming the host and the variable (the
    role's first check, once a run). inputs: host, controller_host, all_hosts, controller_group (the hosts
    of group slurm_controller), node_hosts, play_hosts, srun_port_range, rendezvous_ports, checkpoint_root, jobs (the
    run's systemd jobs, budgetgpu_jobs), groups."""
    host, controller = inputs.get("host"), inputs.get("controller_host")
    problems = []
    if controller not in (inputs.get("all_hosts") or []):
        problems.append(
            f"{host}: slurm_controller_host: found {json.dumps(controller)}, expected the one host of group "
            "slurm_controller"
        )
    group = list(inputs.get("controller_group") or [])
    if len(group) > 1:
        problems.append(f"{host}: group slurm_controller: found {', '.join(group)}, expected one host (one slurmctld)")
    nodes = list(inputs.get("node_hosts") or [])
    if not nodes:
        problems.append(f"{host}: slurm_node_hosts: found none, expected the GPU nodes")
    problems += [
        f"{host}: slurm_node_hosts: {node} is not in this play, expected every node (their facts make slurm.conf)"
        for node in nodes
        if node not in (inputs.get("play_hosts") or [])
    ]
    ranges = {
        name: inputs.get(name.replace("slurm_", "")) for name in ("slurm_srun_port_range", "slurm_rendezvous_ports")
    }
    problems += port_range_problems(ranges, host)
    rendezvous = PORT_RANGE.fullmatch(str(ranges["slurm_rendezvous_ports"]))
    if rendezvous and int(rendezvous[1]) == int(rendezvous[2]):
        problems.append(
            f"{host}: slurm_rendezvous_ports: found {ranges['slurm_rendezvous_ports']!r}, expected two ports or more"
            " (each batch job takes a pair: its rendezvous port and its workers' store port)"
        )
    if rendezvous:
        problems += _job_port_problems(inputs, int(rendezvous[1]), int(rendezvous[2]))
    root = inputs.get("checkpoint_root")
    if not isinstance(root, str) or not _CHECKPOINT_ROOT.fullmatch(root):
        problems.append(
            f"{host}: slurm_checkpoint_root: found {json.dumps(root)}, expected an absolute directory without spaces "
            "(each job keeps its checkpoints in <root>/<user>/<job id>)"
        )
    return problems


def gres_problems(node: Mapping[str, Any], slurmd_output: str) -> list[str]:
    """Return what differs between the node's GPUs (slurm_node) and what `slurmd -G` found in gres.conf
    on the node, one line per GPU naming host, GPU and both sides; slurmd's own error where it stopped
    (a device node that is missing)."""
    found = dict((file, kind) for kind, file in _GRES_FOUND.findall(slurmd_output or ""))
    host, problems = node.get("host") or node.get("name"), []
    for gpu in node.get("gpus") or []:
        kind = found.pop(gpu["file"], None)
        if kind != gpu["type"]:
            seen = f"type {kind}" if kind else "nothing"
            problems.append(
                f"{host}: GPU {gpu['index']} ({gpu['bus_id']}): slurmd found {seen} at {gpu['file']}, "
                f"expected type {gpu['type']} (the probe's)"
            )
    for file, kind in sorted(found.items()):
        problems.append(f"{host}: slurmd found a {kind} GPU at {file} that the probe did not, expected none")
    fatal = [line.strip() for line in (slurmd_output or "").splitlines() if "fatal:" in line or "error:" in line]
    if problems and fatal:
        problems.append(f"{host}: slurmd -G says: " + " / ".join(fatal))
    return problems


# What each cgroup.conf constraint needs from the kernel: cgroup v1 controllers (mounted hierarchies)
# or cgroup v2 controllers (cgroup.controllers of the root).
_CONSTRAINTS = {
    "ConstrainCores": {"v1": ["cpuset"], "v2": ["cpuset"]},
    "ConstrainRAMSpace": {"v1": ["memory"], "v2": ["memory"]},
    # v2 filters devices with eBPF programs, which needs no controller of its own.
    "ConstrainDevices": {"v1": ["devices"], "v2": []},
}
# What proctrack/cgroup needs to find a job's processes.
_PROCTRACK = {"v1": ["freezer"], "v2": []}


def cgroup_settings(filesystem: Any, controllers: list[str] | None) -> dict[str, Any]:
    """Return {plugin (cgroup/v1|cgroup/v2), constrain {ConstrainX: bool}, proctrack_cgroup (bool),
    missing [lines that say what is not constrained and why]} for a node whose /sys/fs/cgroup is of
    filesystem type filesystem (cgroup2fs: v2, else v1 or hybrid) with these controllers available."""
    version = "v2" if str(filesystem).strip() == "cgroup2fs" else "v1"
    have = set(controllers or [])
    constrain, missing = {}, []
    for name, needs in _CONSTRAINTS.items():
        lacking = [c for c in needs[version] if c not in have]
        constrain[name] = not lacking
        if lacking:
            missing.append(f"{name}=no: the kernel's cgroup {version} has no {', '.join(lacking)} controller")
    proctrack = all(c in have for c in _PROCTRACK[version])
    if not proctrack:
        missing.append(f"proctrack/linuxproc: the kernel's cgroup {version} has no freezer controller")
    return {"plugin": f"cgroup/{version}", "constrain": constrain, "proctrack_cgroup": proctrack, "missing": missing}


def job_costs(records_by_host: Mapping[str, Any], price_per_kwh: Any = None, currency: Any = None) -> dict[str, Any]:
    """Return what each Slurm job and each user cost in GPU energy, from the epilog's records of every
    node ({host: [record]}, module_utils/slurm_energy.py): a job that ran on several nodes has a record
    on each, summed. {jobs: [{job, user, nodes, gpus, kwh, cost}], users: [{user, jobs, kwh, cost}],
    lines: the report's text}, the most costly first."""
    price = energy.DEFAULT_PRICE_PER_KWH if price_per_kwh is None else float(price_per_kwh)
    currency = currency or energy.DEFAULT_CURRENCY
    jobs: dict[str, dict[str, Any]] = {}
    for host, records in sorted((records_by_host or {}).items()):
        for record in records if isinstance(records, list) else []:
            if not isinstance(record, Mapping) or not isinstance(record.get("kwh"), int | float):
                continue
            name = str(record.get("job"))
            empty = {"job": name, "user": str(record.get("user")), "nodes": [], "gpus": 0, "kwh": 0.0}
            job = jobs.setdefault(name, empty)
            job["nodes"].append(host)
            job["gpus"] += len(record.get("joules") or {})
            job["kwh"] += float(record["kwh"])
    users: dict[str, dict[str, Any]] = {}
    for job in jobs.values():
        job["cost"] = energy.cost(job["kwh"], price)
        user = users.setdefault(job["user"], {"user": job["user"], "jobs": 0, "kwh": 0.0, "cost": 0.0})
        user["jobs"], user["kwh"], user["cost"] = user["jobs"] + 1, user["kwh"] + job["kwh"], user["cost"] + job["cost"]
    by_cost = sorted(jobs.values(), key=lambda j: (-j["kwh"], j["job"]))
    per_user = sorted(users.values(), key=lambda u: (-u["kwh"], u["user"]))
    money = functools.partial(energy.format_money, currency=currency)
    lines = [f"Slurm jobs: {len(by_cost)}, GPU energy at {money(price)}/kWh"]
    lines += [f"  user {u['user']}: {u['jobs']} job(s), {u['kwh']:.3f} kWh, {money(u['cost'])}" for u in per_user]
    lines += [f"  job {j['job']} ({j['user']}, {j['gpus']} GPU(s) on {', '.join(j['nodes'])}): "
              f"{j['kwh']:.3f} kWh, {money(j['cost'])}" for j in by_cost]  # fmt: skip
    return {"jobs": by_cost, "users": per_user, "lines": lines}


def checkpoint_root_problems(inputs: Mapping[str, Any]) -> list[str]:
    """Return what is wrong with slurm_checkpoint_root on a node as it stands (the role makes it root's, 0755,
    and the Prolog makes each user's directory in it): a link or not a directory, or a directory that already
    holds other things than its users' directories (each a directory, not a link, named after its owner), such
    as /var/lib/budgetgpu. inputs: host, root, stat (stat's result for the root, follow false), entries (find's
    files of the root, depth 1, hidden included)."""
    host, root, found = inputs.get("host"), inputs.get("root"), inputs.get("stat") or {}
    label = f"{host}: slurm_checkpoint_root: found {root}"
    if not found.get("exists"):
        return []
    if found.get("islnk") or not found.get("isdir"):
        kind = "a link" if found.get("islnk") else "not a directory"
        return [f"{label}, {kind}, expected a directory of its own (or none: the role makes it)"]
    others = []
    for entry in inputs.get("entries") or []:
        name = str(entry.get("path", "")).rstrip("/").rsplit("/", 1)[-1]
        if entry.get("isdir") and not entry.get("islnk") and entry.get("pw_name") == name:
            continue
        kind = "link" if entry.get("islnk") else "directory" if entry.get("isdir") else "file"
        others.append(f"{name} ({kind} of {entry.get('pw_name', '?')})")
    if not others:
        return []
    shown = ", ".join(sorted(others)[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
    return [
        f"{label} holding {shown}, expected a directory of its own holding only its users' checkpoint directories "
        "(each named after its owner): root makes a directory there for each user of a job, so it must not share "
        "one with other things. Choose a directory of its own (the default /var/lib/budgetgpu/slurm-checkpoints)"
    ]


def secret_action(inputs: Mapping[str, Any]) -> dict[str, str]:
    """Return {action: keep|install|refuse, reason} for one host's copy of a cluster secret (the munge key,
    slurmdbd's password), by their SHA-256: cluster (the control node's copy), found (the host's, None
    without one), installed (what the role recorded installing there, None where it never did), rotate (the
    inventory asks to replace it), package_new (the package that made the host's copy was installed in this
    run: its copy is the package's own random one). A copy the package made in this run is replaced; any other
    copy that differs from the cluster's is refused unless rotate, whether the role recorded installing it or not
    (a node provisioned before the record existed holds the cluster's key of that time): a second admin, a new
    laptop or sudo's home would otherwise push a new secret mid-run. inputs also: host, what, path, source (the
    control node's file), variable (the rotation's variable)."""
    cluster, found, installed = inputs.get("cluster"), inputs.get("found"), inputs.get("installed")
    host, what, path = inputs.get("host"), inputs.get("what"), inputs.get("path")
    if not cluster:
        raise ValueError(f"{host}: found no {what} on the control node ({inputs.get('source')}), expected one")
    if found == cluster:
        return {"action": "keep", "reason": f"{path} holds the cluster's {what}"}
    if not found:
        return {"action": "install", "reason": f"{path} has no {what} yet"}
    if not installed and inputs.get("package_new"):
        return {"action": "install", "reason": f"{path} holds the {what} its package made in this run"}
    if inputs.get("rotate"):
        return {"action": "install", "reason": f"{inputs.get('variable')} asks to replace {path}"}
    whose = (
        "one the role installed"
        if installed
        else "one the role has no record of installing (a node provisioned before the record, or someone's)"
    )
    return {
        "action": "refuse",
        "reason": (
            f"{host}: {path} holds another {what} than the control node's {inputs.get('source')}, expected the same: "
            f"SHA-256 {found} on {host} ({whose}), {cluster} on the control node. The control node's copy is not "
            "this cluster's (another admin's, another home's: point budgetgpu_state_dir at the cluster's, or remove "
            f"it to take the controller's), or set {inputs.get('variable')}=true to replace the {what} on every host "
            "with the control node's. Nothing changed"
        ),
    }
