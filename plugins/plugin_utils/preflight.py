"""Cluster-wide preflight checks: the run's jobs (budgetgpu_jobs) against what the probes found on
every node.

Controller-side and pure; no I/O. ``cluster_check(nodes, jobs, groups, options)`` returns
``{"problems": [...], "warnings": [...], "report": [lines]}``; each problem and warning is a dict
``{host, job, field, found, expected, hint}``, and every report line names host, field, what was
found and what was expected. ``nodes`` comes from ``cluster_nodes`` and the jobs from
``torchrun_jobs_normalize`` (plugins/plugin_utils/jobs.py, the job model).

Checks:

- each job: a valid name (no spaces or slashes), exactly one of script/module, a known rendezvous
  backend, port, restarts, checkpoint interval, absolute paths, an unprivileged user, known keys;
- each job across its nodes: every node probed, ``nproc_per_node`` between 1 and the node's GPU
  count, node ranks unique and contiguous (master = rank 0 with static rendezvous), the master
  in the group, the script present on every node, one GPU model (unless ``allow_mixed_gpus``),
  one driver major, one torch/CUDA/NCCL version in the venvs, the same job list on every node, the store port
  outside each node's ephemeral range;
  fewer CPUs per process than ``min_cpus_per_process`` is a warning;
- across jobs: no two jobs that share a node on one port (their ports and store ports);
- each node: PCIe links not below what the inventory expects (``probe_pcie_min_width``,
  ``probe_pcie_expected``), by the one PCIe rule of plugins/module_utils/pcie.py.
"""

from __future__ import annotations

import posixpath
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.module_utils.pcie import expectation_findings
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.driver import parse_compute_capability
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.jobs import (
    BACKENDS,
    BF16_MIN_CAPABILITY,
    COMPRESSIONS,
    ENV_NAME,
    JOB_KEYS,
    JOB_NAME,
    NCCL_ONLY_COMPRESSIONS,
    PARALLELISMS,
    PORT_KEYS,
    PRECISIONS,
    RENDEZVOUS,
    SHARDED,
    STATE_PRECISIONS,
    STATES,
    STORE_PORT_OFFSET,
    USER_NAME,
    image_bads,
    in_directory,
    job_backend,
    job_hosts,
    job_master,
    job_node_ranks,
    job_nproc,
)

DEFAULT_OPTIONS: dict[str, Any] = {
    "min_cpus_per_process": 2,
    # Scripts the collection installs itself (train.yml), so they need not exist yet.
    "provided_scripts": [],
    # The nightly run (safe mode): a node that is down is reported, the others go on.
    "down_nodes_ok": False,
}
STORE_PORT_DEFAULT = f"default: port + {STORE_PORT_OFFSET}"
MIXED_GPUS_HINT = "faster GPUs wait for slower ones in DDP; set allow_mixed_gpus: true to accept it"

Problem = dict[str, Any]
# A bad field of one job: (field, found, expected, hint); the caller adds host and job.
Bad = tuple[str, Any, str, str]


def _problem(host: str, job: str | None, field: str, found: Any, expected: Any, hint: str = "") -> Problem:
    return {"host": host, "job": job, "field": field, "found": found, "expected": expected, "hint": hint}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_or_none(value: Any) -> int | None:
    if _is_int(value):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


def _where(hosts: list[str]) -> str:
    return ",".join(hosts) if hosts else "all"


def job_script_path(job: Mapping[str, Any]) -> str | None:
    """Return the absolute path of a job's script on the nodes (relative paths: in its workdir)."""
    script = job.get("script")
    if not script or not isinstance(script, str):
        return None
    return script if script.startswith("/") else posixpath.join(str(job.get("workdir") or "/"), script)


def preflight_script_paths(
    jobs: list[Mapping[str, Any]], host: str, groups: Mapping[str, list[str]], provided: list[str] | None = None
) -> list[str]:
    """Return the scripts that must exist on host (those of its jobs, minus the collection's own). An image job's
    script outside its workdir is a path inside the image (only the workdir is the host's), not checked here."""
    paths = []
    for job in jobs:
        if host in job_hosts(job, groups) and job.get("state") != "absent":
            path = job_script_path(job)
            workdir = job.get("workdir")
            in_image = job.get("image") and not (path and isinstance(workdir, str) and in_directory(path, workdir))
            if path and not in_image and path not in (provided or []) and path not in paths:
                paths.append(path)
    return paths


# --- one job on its own -------------------------------------------------------------------


def _bad_identity(job: Mapping[str, Any], groups: Mapping[str, list[str]]) -> Iterator[Bad]:
    """Name, keys, where and the master."""
    name, hosts = job.get("name"), job_hosts(job, groups)
    if not isinstance(name, str) or not JOB_NAME.fullmatch(name):
        yield (
            "name",
            name,
            "letters, digits, '_', '.' or '-' (^[A-Za-z0-9_.-]+$)",
            "the name becomes a unit and a directory name: no spaces or slashes",
        )
    for key in sorted(set(job) - JOB_KEYS - {"unit", "env_file", "state_dir"}):
        yield key, job[key], f"one of the known keys: {', '.join(sorted(JOB_KEYS))}", "a typo? see torchrun_jobs"
    if not hosts:
        groups_known = ", ".join(sorted(groups))
        yield "nodes", job.get("nodes"), f"an inventory group with at least one host (groups: {groups_known})", ""
    master = job_master(job, groups)
    if hosts and master not in hosts:
        yield "master", master, f"a host of group {job.get('nodes')}: {', '.join(hosts)}", "name a node of the job"


def _bad_numbers(job: Mapping[str, Any]) -> Iterator[Bad]:
    """Processes, port, rendezvous and restarts."""
    nproc = job.get("nproc_per_node")
    if nproc not in ("gpu", "auto") and (_int_or_none(nproc) is None or _int_or_none(nproc) < 1):
        yield "nproc_per_node", nproc, '"gpu" (the node\'s GPU count) or a number of 1 or more', ""
    for key in PORT_KEYS:
        if not _is_int(job.get(key)) or not 1 <= job[key] <= 65535:
            yield key, job.get(key), "a TCP port from 1 to 65535", "" if key == "port" else STORE_PORT_DEFAULT
    if _is_int(job.get("port")) and job.get("store_port") == job["port"]:
        yield "store_port", job["port"], "a port other than the job's port, where its agents' store listens", ""
    if job.get("rendezvous") not in RENDEZVOUS:
        hint = "c10d: elastic rendezvous on the master; static: fixed node ranks as in the guide"
        yield "rendezvous", job.get("rendezvous"), f"one of {', '.join(RENDEZVOUS)}", hint
    for key in ("rendezvous_timeout", "rendezvous_read_timeout"):
        timeout = job.get(key)
        if not _is_int(timeout) or timeout < 1:
            yield key, timeout, "seconds, 1 or more", ""
    restarts = job.get("max_restarts")
    if not _is_int(restarts) or restarts < 0:
        yield "max_restarts", restarts, "a number of 0 or more", ""


def _bad_entry_point(job: Mapping[str, Any]) -> Iterator[Bad]:
    """What runs: a script or a module, its arguments and its venv."""
    script, module = job.get("script"), job.get("module")
    if bool(script) == bool(module):
        found = f"script={script!r}, module={module!r}"
        yield "script", found, "exactly one of script (a path on the node) or module (python -m)", ""
    elif script is not None and not isinstance(script, str):
        yield "script", script, "a path (string)", ""
    if not isinstance(job.get("args"), list):
        yield "args", job.get("args"), "a list of arguments", ""
    venv = job.get("venv")
    if not isinstance(venv, str) or not venv.startswith("/") or "\n" in venv:
        yield "venv", venv, "an absolute path", ""


def _bad_cadence(job: Mapping[str, Any]) -> Iterator[Bad]:
    """Checkpoint intervals and the straggler report's."""
    minutes, steps = job.get("checkpoint_every_minutes"), job.get("checkpoint_every_steps")
    if isinstance(minutes, bool) or not isinstance(minutes, int | float) or minutes < 0:
        yield "checkpoint_every_minutes", minutes, "minutes, 0 (off) or more", ""
    if not _is_int(steps) or steps < 0:
        yield "checkpoint_every_steps", steps, "steps, 0 (off) or more", ""
    straggler = job.get("straggler_every_steps")
    if not _is_int(straggler) or straggler < 0:
        yield "straggler_every_steps", straggler, "steps, 0 (off) or more", ""


def _bad_comm(job: Mapping[str, Any]) -> Iterator[Bad]:
    """DDP's communication settings: compression, PowerSGD's rank and start, bucket size, accumulation."""
    compression = job.get("gradient_compression")
    if compression not in COMPRESSIONS:
        hint = "fp16 halves the bytes on the wire (bf16 on NCCL), powersgd cuts them further"
        yield "gradient_compression", compression, f"one of {', '.join(COMPRESSIONS)}", hint
    for field, least, what in (
        ("powersgd_rank", 1, "a matrix rank of 1 or more"),
        # torch's PowerSGD needs plain all-reduce steps before it starts (error feedback, warm start).
        ("powersgd_start_step", 2, "a step of 2 or more"),
        ("accumulate_steps", 1, "micro-batches per step, 1 (none) or more"),
    ):
        value = job.get(field)
        if not _is_int(value) or value < least:
            yield field, value, what, ""
    bucket = job.get("bucket_cap_mb")
    if isinstance(bucket, bool) or not isinstance(bucket, int | float) or bucket <= 0:
        yield "bucket_cap_mb", bucket, "megabytes, more than 0 (DDP's default is 25)", ""


def _bad_sharding(job: Mapping[str, Any]) -> Iterator[Bad]:
    """How the model is spread and its precisions, each alone and together."""
    parallelism, precision, states = job.get("parallelism"), job.get("mixed_precision"), job.get("state_precision")
    for field, value, choices in (
        ("parallelism", parallelism, PARALLELISMS),
        ("mixed_precision", precision, PRECISIONS),
        ("state_precision", states, STATE_PRECISIONS),
    ):
        if value not in choices:
            yield field, value, f"one of {', '.join(choices)}", ""
    if not isinstance(job.get("activation_checkpointing"), bool):
        yield "activation_checkpointing", job.get("activation_checkpointing"), "true or false", ""
    if parallelism in SHARDED and job.get("gradient_compression") not in ("none", None):
        hint = "FSDP reduce-scatters its gradients itself; set gradient_compression: none, or parallelism: ddp"
        yield "gradient_compression", job.get("gradient_compression"), f"none under parallelism {parallelism}", hint
    if parallelism in SHARDED and precision == "fp16":
        hint = "fp16 needs a loss scaler the sharded path does not run: bf16 (Ampere or newer), or parallelism ddp"
        yield "mixed_precision", precision, f"none or bf16 under parallelism {parallelism}", hint
    if states == "bf16" and precision == "fp16":
        yield "mixed_precision", precision, "none or bf16 with state_precision bf16", "the model itself is bf16"


def _bad_environment(env: Any) -> Iterator[Bad]:
    if not isinstance(env, Mapping):
        yield "environment", env, "a dict of variable names to values", ""
        return
    for key, value in env.items():
        if not isinstance(key, str) or not ENV_NAME.fullmatch(key):
            yield f"environment.{key}", key, "a variable name (^[A-Za-z_][A-Za-z0-9_]*$)", ""
        elif isinstance(value, Mapping | list):
            yield f"environment.{key}", value, "a string or number", ""


def training_bads(job: Mapping[str, Any]) -> Iterator[Bad]:
    """The job model's TRAINING_KEYS (what runs and how it trains, whoever starts it: a unit here, a
    Slurm batch script in role slurm): (field, found, expected, hint) for each bad one."""
    yield from _bad_entry_point(job)
    yield from _bad_cadence(job)
    yield from _bad_comm(job)
    yield from _bad_sharding(job)
    yield from _bad_environment(job.get("environment"))


def _bad_runtime(job: Mapping[str, Any]) -> Iterator[Bad]:
    """Paths, user and the switches."""
    for field in ("workdir", "checkpoint_dir"):
        value = job.get(field)
        if not isinstance(value, str) or not value.startswith("/") or "\n" in value:
            yield field, value, "an absolute path", ""
    user = job.get("user")
    if not isinstance(user, str) or not USER_NAME.fullmatch(user):
        yield "user", user, "a system user name", ""
    elif user == "root":
        yield (
            "user",
            user,
            "an unprivileged user",
            "jobs never run as root; torchrun_user (budgetgpu_user) is the default",
        )
    for field, choices in (("backend", BACKENDS), ("state", STATES)):
        if job.get(field) not in choices:
            yield field, job.get(field), f"one of {', '.join(choices)}", ""
    for field in ("enabled", "allow_mixed_gpus"):
        if not isinstance(job.get(field), bool):
            yield field, job.get(field), "true or false", ""
    if not isinstance(job.get("node_ranks"), Mapping):
        yield "node_ranks", job.get("node_ranks"), "a dict of host: rank", ""
    yield from image_bads(job)


def _check_job_fields(job: Mapping[str, Any], groups: Mapping[str, list[str]]) -> list[Problem]:
    label = str(job["name"]) if job.get("name") else None
    hosts = job_hosts(job, groups)
    where = _where(hosts)
    bads = [*_bad_identity(job, groups), *_bad_numbers(job), *training_bads(job), *_bad_runtime(job)]
    out = [_problem(where, label, *bad) for bad in bads]
    ranks = job.get("node_ranks")
    for host in sorted(set(ranks) - set(hosts)) if isinstance(ranks, Mapping) else []:
        expected = f"hosts of group {job.get('nodes')} only: {', '.join(hosts)}"
        out.append(_problem(host, label, "node_ranks", f"rank for {host}", expected))
    return out


# --- one job across its nodes -------------------------------------------------------------


def _expected_value(values: Mapping[str, Any], master: str | None) -> Any:
    """Return the value the others should match: the master's, else the most common one."""
    if master in values:
        return values[master]
    return Counter(values.values()).most_common(1)[0][0]


def _check_same(
    job: Mapping[str, Any], values: Mapping[str, Any], field: str, hint: str, master: str | None
) -> list[Problem]:
    if len(set(values.values())) <= 1:
        return []
    expected = _expected_value(values, master)
    where = ", ".join(h for h, v in values.items() if v == expected)
    return [
        _problem(host, job["name"], field, value, f"{expected} (as on {where})", hint)
        for host, value in values.items()
        if value != expected
    ]


def _driver_major(version: Any) -> str | None:
    return str(version).split(".", maxsplit=1)[0] if version else None


def _check_probed(job: Mapping[str, Any], hosts: list[str], probed: list[str]) -> list[Problem]:
    hint = "the node was unreachable or its probe failed: see the probe's output above"
    return [
        _problem(host, job["name"], "budgetgpu_gpus", "no probe facts", "gpu_facts and pcie_facts results", hint)
        for host in hosts
        if host not in probed
    ]


def _check_processes(
    job: Mapping[str, Any], probed: list[str], nodes: Mapping[str, Any], options: Mapping[str, Any]
) -> tuple[list[Problem], list[Problem]]:
    """nproc_per_node against each node's GPUs (a problem) and CPUs (a warning)."""
    problems, warnings = [], []
    value = job.get("nproc_per_node")
    value_ok = value in ("gpu", "auto") or (_int_or_none(value) or 0) >= 1
    floor = options["min_cpus_per_process"]
    for host in probed:
        node = nodes[host]
        count, nproc, cpus = node.get("gpu_count") or 0, job_nproc(job, node), node.get("vcpus")
        if value_ok and nproc is not None and not 1 <= nproc <= count:
            hint = (
                "this node has no GPU the probes can see: check the driver (gpu_facts) and the PCI bus"
                if count == 0
                else "run at most one process per GPU"
            )
            problems.append(
                _problem(host, job["name"], "nproc_per_node", value, f"1 to {count} (GPUs on {host})", hint)
            )
        if nproc and cpus and cpus / nproc < floor:
            found = f"{cpus} CPUs for {nproc} processes"
            hint = "a weak CPU starves the data loader (the guide gained 15% from a better one)"
            warnings.append(
                _problem(host, job["name"], "cpus per process", found, f"{floor} or more per process", hint)
            )
    return problems, warnings


def _check_ranks(job: Mapping[str, Any], groups: Mapping[str, list[str]], nodes: Mapping[str, Any]) -> list[Problem]:
    """Node ranks: numbers, unique, contiguous, the master first (static rendezvous)."""
    name, count = job["name"], len(job_hosts(job, groups))
    ranks = job_node_ranks(job, groups, nodes)
    problems, by_rank = [], {}
    for host, rank in ranks.items():
        if _int_or_none(rank) is None:
            problems.append(_problem(host, name, "node_rank", rank, f"a number from 0 to {count - 1}"))
        else:
            by_rank.setdefault(_int_or_none(rank), []).append(host)
    for rank, owners in sorted(by_rank.items()):
        for host in owners if len(owners) > 1 else []:
            others = ", ".join(o for o in owners if o != host)
            hint = f"{others} has rank {rank} too"
            problems.append(_problem(host, name, "node_rank", rank, "a rank no other node of the job has", hint))
    if by_rank and len(by_rank) == len(ranks) and sorted(by_rank) != list(range(count)):
        problems += [
            _problem(host, name, "node_rank", rank, f"ranks 0 to {count - 1}, each once", "ranks must be contiguous")
            for host, rank in ranks.items()
            if _int_or_none(rank) not in range(count)
        ]
    master = job_master(job, groups)
    if job.get("rendezvous") == "static" and master in ranks and _int_or_none(ranks[master]) not in (0, None):
        hint = "static rendezvous: the master is node rank 0"
        problems.append(_problem(master, name, "node_rank", ranks[master], "0 on the master", hint))
    return problems


def _check_script(
    job: Mapping[str, Any], probed: list[str], nodes: Mapping[str, Any], options: Mapping[str, Any]
) -> list[Problem]:
    path = job_script_path(job)
    if not path or path in options["provided_scripts"]:
        return []
    return [
        _problem(
            host,
            job["name"],
            "script",
            f"{path} (missing)",
            "an existing file on the node",
            "copy the script to every node",
        )
        for host in probed
        if nodes[host].get("scripts_found", {}).get(path) is False
    ]


def _check_gpu_models(
    job: Mapping[str, Any], probed: list[str], nodes: Mapping[str, Any], master: str | None
) -> list[Problem]:
    """One GPU model within each node and across the nodes, unless the job allows mixed GPUs."""
    if job.get("allow_mixed_gpus"):
        return []
    problems = []
    for host in probed:
        models = sorted(set(nodes[host].get("gpu_models") or []))
        if len(models) > 1:
            problems.append(
                _problem(host, job["name"], "gpu model", " + ".join(models), "one GPU model", MIXED_GPUS_HINT)
            )
    single = {h: nodes[h]["gpu_models"][0] for h in probed if len(set(nodes[h].get("gpu_models") or [])) == 1}
    return problems + _check_same(job, single, "gpu model", MIXED_GPUS_HINT, master)


def _check_software(
    job: Mapping[str, Any], hosts: list[str], probed: list[str], nodes: Mapping[str, Any], master: str | None
) -> list[Problem]:
    """One driver major, one torch/CUDA/NCCL and one job list on every node of the job."""
    loaded = [h for h in probed if nodes[h].get("driver_state") == "loaded"]
    majors = {h: _driver_major(nodes[h].get("driver_version")) for h in loaded}
    problems = _check_same(
        job, majors, "driver major", "install one driver branch on every node (nvidia_driver)", master
    )
    for field in ("torch", "cuda", "nccl"):
        envs = {h: nodes[h].get("python_env") for h in probed if isinstance(nodes[h].get("python_env"), Mapping)}
        values = {h: str(env.get(field)) for h, env in envs.items()}
        problems += _check_same(job, values, field, "provision every node from one python_env (provision.yml)", master)
    digests = {h: nodes[h].get("jobs_digest") for h in hosts if (nodes.get(h) or {}).get("jobs_digest")}
    hint = (
        "define torchrun_jobs and its defaults (torchrun_job_defaults, torchrun_user, torchrun_venv) once "
        "(group_vars/all), not per host"
    )
    return problems + _check_same(job, digests, "torchrun_jobs", hint, master)


def compression_backend_problems(job: Mapping[str, Any], probed: list[str], nodes: Mapping[str, Any]) -> list[Problem]:
    """A compression the node's backend cannot run (bf16 wants NCCL; simulated nodes train with gloo)."""
    compression = job.get("gradient_compression")
    if compression not in NCCL_ONLY_COMPRESSIONS:
        return []
    hint = "torch's bf16 hook needs CUDA and NCCL 2.10+: use fp16 or powersgd on gloo"
    return [
        _problem(host, job["name"], "gradient_compression", f"{compression} on backend {backend}", "backend nccl", hint)
        for host in probed
        if (backend := job_backend(job, nodes[host])) != "nccl"
    ]


def sharding_problems(
    job: Mapping[str, Any], hosts: list[str], probed: list[str], nodes: Mapping[str, Any]
) -> list[Problem]:
    """A sharded job with nothing to shard over, and bf16 where a GPU or the backend cannot run it."""
    name, parallelism, problems = job["name"], job.get("parallelism"), []
    if parallelism == "hsdp" and len(hosts) < 2:
        hint = "hsdp replicates across nodes: use fsdp on one node"
        problems.append(
            _problem(_where(hosts), name, "parallelism", f"hsdp on {len(hosts)} node", "2 nodes or more", hint)
        )
    ranks = [job_nproc(job, nodes[host]) for host in probed]
    if parallelism == "fsdp" and len(probed) == len(hosts) and None not in ranks and sum(ranks) < 2:
        hint = "fsdp over one rank shards nothing: use ddp, or more GPUs"
        problems.append(
            _problem(_where(hosts), name, "parallelism", f"fsdp on {sum(ranks)} rank", "2 ranks or more", hint)
        )
    wants_bf16 = "bf16" in (job.get("mixed_precision"), job.get("state_precision"))
    for host in probed if wants_bf16 else []:
        if (backend := job_backend(job, nodes[host])) != "nccl":
            hint = "bf16 training needs CUDA GPUs and NCCL: mixed_precision none (or fp16 under ddp)"
            problems.append(_problem(host, name, "mixed_precision", f"bf16 on backend {backend}", "backend nccl", hint))
            continue
        too_old: dict[tuple[str, str], list[str]] = {}
        for index, gpu in enumerate(nodes[host].get("gpus") or []):
            capability = parse_compute_capability(gpu.get("compute_capability"))
            if capability is not None and capability < BF16_MIN_CAPABILITY:
                too_old.setdefault((str(gpu.get("name")), "{}.{}".format(*capability)), []).append(str(index))
        for (model, capability), indexes in too_old.items():
            found = f"bf16 on GPU {', '.join(indexes)} ({model}, compute capability {capability})"
            hint = "bf16 needs Ampere (8.0) or newer: mixed_precision fp16 under ddp, or none; state_precision fp32"
            problems.append(_problem(host, name, "mixed_precision", found, "compute capability 8.0 or more", hint))
    return problems


def _check_job_nodes(
    job: Mapping[str, Any], groups: Mapping[str, list[str]], nodes: Mapping[str, Any], options: Mapping[str, Any]
) -> tuple[list[Problem], list[Problem]]:
    hosts, master = job_hosts(job, groups), job_master(job, groups)
    probed = [h for h in hosts if (nodes.get(h) or {}).get("probed")]
    unprobed = _check_probed(job, hosts, probed)
    problems, warnings = ([], unprobed) if options.get("down_nodes_ok") else (unprobed, [])
    process_problems, process_warnings = _check_processes(job, probed, nodes, options)
    problems += process_problems + _check_ranks(job, groups, nodes) + _check_script(job, probed, nodes, options)
    problems += _check_gpu_models(job, probed, nodes, master) + _check_software(job, hosts, probed, nodes, master)
    problems += compression_backend_problems(job, probed, nodes) + sharding_problems(job, hosts, probed, nodes)
    problems += _check_store_port(job, probed, nodes)
    return problems, warnings + process_warnings


def _check_store_port(job: Mapping[str, Any], probed: list[str], nodes: Mapping[str, Any]) -> list[Problem]:
    """A store port inside a node's ephemeral range: the kernel may hand it to any connection between two restarts,
    and rank 0's worker binds it anew at each (the rendezvous port is bound once, by the agent)."""
    port, problems = job.get("store_port"), []
    for host in probed:
        low, high = nodes[host].get("ephemeral_ports") or (0, -1)
        if _is_int(port) and low <= port <= high:
            expected = f"a port outside {host}'s ephemeral range {low}-{high} (net.ipv4.ip_local_port_range)"
            hint = f"the kernel hands those out to any connection; {STORE_PORT_DEFAULT}"
            problems.append(_problem(host, job.get("name"), "store_port", port, expected, hint))
    return problems


def _job_warnings(job: Mapping[str, Any], groups: Mapping[str, list[str]]) -> list[Problem]:
    where, name, warnings = _where(job_hosts(job, groups)), job.get("name"), []
    if job.get("checkpoint_every_minutes") == 0 and job.get("checkpoint_every_steps") == 0:
        hint = "a crash then loses the whole run"
        warnings.append(
            _problem(
                where,
                name,
                "checkpoint interval",
                "0 minutes and 0 steps",
                "a checkpoint every N minutes or steps",
                hint,
            )
        )
    restarts = job.get("max_restarts")
    if job.get("rendezvous") == "static" and _is_int(restarts) and restarts > 0:
        # torch's static rendezvous hands the workers of every restart round the same store,
        # and restarted workers read their peers' old addresses (gloo: Connection refused).
        hint = (
            "torch's static rendezvous keeps one store across in-place restarts, which then fail; "
            "with 0 systemd restarts the units fresh, or use rendezvous c10d (in-place restarts work)"
        )
        found = f"{restarts} with rendezvous static"
        warnings.append(_problem(where, name, "max_restarts", found, "0 with rendezvous static", hint))
    return warnings


# --- across jobs and per node -------------------------------------------------------------


def _check_ports(jobs: list[Mapping[str, Any]], groups: Mapping[str, list[str]]) -> list[Problem]:
    """No two jobs that share a node on one port: a job's port or store port against another's port and store port."""
    problems = []
    active = [j for j in jobs if j.get("state") != "absent"]
    for i, job in enumerate(active):
        for other in active[:i]:
            shared = [h for h in job_hosts(job, groups) if h in job_hosts(other, groups)]
            if not shared:
                continue
            clashes = [(key, other_key) for key in PORT_KEYS for other_key in PORT_KEYS
                       if _is_int(job.get(key)) and job[key] == other.get(other_key)]  # fmt: skip
            for key, other_key in clashes:
                expected = f"a port other than {job[key]}, which job {other.get('name')} uses on these nodes"
                expected += "" if other_key == "port" else f" as its {other_key}"
                hint = "give every job its own port" + ("" if key == other_key == "port" else " and store_port")
                problems.append(_problem(",".join(shared), job.get("name"), key, job[key], expected, hint))
    names = Counter(str(j.get("name")) for j in jobs)
    for name, count in names.items():
        if count > 1:
            problems.append(_problem("all", name, "name", f"{name} ({count} jobs)", "a name used by one job only"))
    return problems


def _fmt_link(link: Mapping[str, Any]) -> str:
    gen, width = link.get("gen"), link.get("width")
    return f"gen{gen if gen is not None else '?'} x{width if width is not None else '?'}"


def _check_pcie(host: str, node: Mapping[str, Any]) -> tuple[list[Problem], list[Problem]]:
    """Problems where a GPU misses the inventory's expectation (the one PCIe rule, module_utils/pcie.py);
    warnings where a link trained below what both its ends support."""
    pcie = node.get("pcie") or {}
    expected = {
        bus_id: {key: _int_or_none(value) for key, value in want.items()} if isinstance(want, Mapping) else {}
        for bus_id, want in (node.get("pcie_expected") or {}).items()
    }
    problems = []
    for finding in expectation_findings(pcie, _int_or_none(node.get("pcie_min_width")), expected):
        check = "" if finding["check"] == "present" else f" {finding['check']}"
        field = f"pcie {finding['bus_id']}{check}"
        problems.append(_problem(host, None, field, finding["found"], finding["expected"], finding["hint"]))
    warnings = []
    for gpu in sorted(pcie.get("gpus") or [], key=lambda gpu: str(gpu.get("bus_id"))):
        if gpu.get("downgraded"):
            hop = gpu.get("limiting_hop")
            where = f" (limiting hop {hop})" if hop not in (None, gpu.get("bus_id")) else ""
            found = _fmt_link(gpu.get("effective") or {}) + where
            expected_link = _fmt_link(gpu.get("capable") or {}) + " (what both ends support)"
            hint = "; ".join(gpu.get("downgrade_reasons") or [])
            warnings.append(_problem(host, None, f"pcie {gpu.get('bus_id')} link", found, expected_link, hint))
    return problems, warnings


def _check_quarantine(host: str, node: Mapping[str, Any]) -> list[Problem]:
    """Warnings for the GPUs role gpu_health (or the inventory) quarantined: jobs start without them."""
    warnings = []
    for uuid, why in sorted((node.get("gpu_quarantine") or {}).items()):
        found = f"quarantined since {why.get('since') or '(inventory)'}: {why.get('reason')}"
        hint = (
            "jobs start without it (one rank fewer; a fixed nproc_per_node that needs it is held) and its "
            f"inference worker does not start; return it with playbooks/gpu_release.yml -e gpu={uuid} once fixed"
        )
        warnings.append(_problem(host, None, f"GPU {uuid}", found, "in service", hint))
    return warnings


def _line(level: str, item: Mapping[str, Any]) -> str:
    job = f"job {item['job']} " if item.get("job") else ""
    hint = f": {item['hint']}" if item.get("hint") else ""
    return f"{level} {item['host']}: {job}{item['field']}: found {item['found']!r}, expected {item['expected']}{hint}"


def _node_line(host: str, node: Mapping[str, Any]) -> str:
    if not node.get("probed"):
        return f"  node {host}: not probed"
    models = ", ".join(f"{n}x {m}" for m, n in sorted(Counter(node.get("gpu_models") or []).items())) or "no GPU"
    driver = node.get("driver_version") or node.get("driver_state") or "unknown"
    cpus = node.get("vcpus") or "?"
    return f"  node {host}: {node.get('gpu_count')} GPUs ({models}), driver {driver}, {cpus} CPUs"


def cluster_check(
    nodes: Mapping[str, Mapping[str, Any]],
    jobs: list[Mapping[str, Any]],
    groups: Mapping[str, list[str]],
    options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Return {problems, warnings, report} for the whole cluster (see the module docstring)."""
    opts = dict(DEFAULT_OPTIONS)
    opts.update({k: v for k, v in (options or {}).items() if v is not None})
    problems: list[Problem] = []
    warnings: list[Problem] = []
    for job in jobs:
        problems += _check_job_fields(job, groups)
        if job.get("state") == "absent" or not job_hosts(job, groups):
            continue
        node_problems, node_warnings = _check_job_nodes(job, groups, nodes, opts)
        problems += node_problems
        warnings += node_warnings + _job_warnings(job, groups)
    problems += _check_ports(jobs, groups)
    for host in sorted(nodes):
        pcie_problems, pcie_warnings = _check_pcie(host, nodes[host])
        problems += pcie_problems
        warnings += pcie_warnings + _check_quarantine(host, nodes[host])
    summary = f"{len(nodes)} nodes, {len(jobs)} jobs: {len(problems)} problems, {len(warnings)} warnings"
    report = [f"budgetgpu preflight: {summary}"] + [_node_line(host, nodes[host]) for host in sorted(nodes)]
    report += [_line("FAIL", p) for p in problems] + [_line("WARN", w) for w in warnings]
    return {"problems": problems, "warnings": warnings, "report": report}
