"""The job model: one training job of ``torchrun_jobs`` with every default applied, where it runs,
its master, node ranks and processes, and the command line and environment of one node's unit.

Controller-side and pure (job dicts and facts in, values out; no I/O). The torchrun role's ``jobs``
entry point turns ``torchrun_jobs`` into the fact ``budgetgpu_jobs`` with ``torchrun_jobs_normalize`` once a
run; preflight, the firewall and the reachability check (nccl_network) and the units read that list,
so what preflight approves is exactly what the units run. Bad input raises ValueError (the filter
files turn it into AnsibleFilterError).

A job (one item of ``torchrun_jobs``; roles/torchrun/meta/argument_specs.yml documents each key):

    name: pretrain                      # ^[A-Za-z0-9_.-]+$ (unit budgetgpu-job-<name>.service)
    script: /srv/train.py               # or module: mypkg.train (exactly one of the two)
    args: [--epochs, "10"]
    nodes: gpu_nodes                    # an inventory group
    nproc_per_node: gpu                 # "gpu" (the node's GPU count) or a number
    master: node1                       # default: first host of the group
    port: 29500
    store_port: 30500                   # the workers' store (MASTER_PORT) with c10d; default: port + 1000
    rendezvous: c10d                    # or static (--node-rank/--master-addr as in the guide)
    max_restarts: 3
    checkpoint_every_minutes: 15
    straggler_every_steps: 200          # rank 0 names the slowest rank every N steps; 0: off
    gradient_compression: none          # fp16, bf16 (NCCL only) or powersgd: DDP's communication hook
    powersgd_rank: 1                    # PowerSGD's matrix rank, and the step it starts at
    powersgd_start_step: 1000
    bucket_cap_mb: 25                   # DDP's gradient bucket size
    accumulate_steps: 1                 # micro-batches per optimizer step (no_sync on all but the last)
    image: nvcr.io/nvidia/pytorch@sha256:<64 hex>   # or {tarball: <control-node path>, digest: sha256:<image id>}:
                                        # runs in the image with its python3 (venv is not used)
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.module_utils import energy
from ansible_collections.budgetgpu.cluster.plugins.module_utils.job_metrics import unit_running
from ansible_collections.budgetgpu.cluster.plugins.module_utils.netinfo import endpoint
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.gpu_devices import unit_device_allow
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.nodes import fact, in_group, node_info, simulated
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.torch_build import driver_cuda, parse_cuda_version

JOB_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
USER_NAME = re.compile(r"^[a-z_][a-z0-9_-]*[$]?$")
RENDEZVOUS = ("c10d", "static")
BACKENDS = ("auto", "nccl", "gloo")
STATES = ("started", "stopped", "absent")
# DDP communication hooks a job may ask for (straggler.COMPRESSIONS; a unit test holds them
# equal). bf16 needs NCCL: torch's bf16 hook refuses gloo.
COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
NCCL_ONLY_COMPRESSIONS = ("bf16",)
# How the model is spread (JOB_DEFAULTS' parallelism), its compute precision and the dtype of what a rank keeps
# (budgetgpu_node.sharding reads the same values from the unit's environment; a unit test holds them equal).
PARALLELISMS = ("ddp", "fsdp", "hsdp")
SHARDED = ("fsdp", "hsdp")
PRECISIONS = ("none", "bf16", "fp16")
STATE_PRECISIONS = ("fp32", "bf16")
# bfloat16 needs Ampere (compute capability 8.0) and NCCL.
BF16_MIN_CAPABILITY = (8, 0)
UNIT_PREFIX = "budgetgpu-job-"
# A job's store port by default: its port + 1000. Not + 1: jobs often take consecutive ports (29500, 29501), and one
# job's store would then sit on the next job's rendezvous. 29500 + 1000 stays clear of Slurm's batch rendezvous ports
# (29600-29999), of nccl_network's (29499, 29510) and, for any port below 31768, of the kernel's usual ephemeral range
# (32768-60999), where the store could not count on its port at each restart (preflight refuses a store port there).
STORE_PORT_OFFSET = 1000
# The ports a job's units listen on (its agents' rendezvous store, its workers' store): the firewall closes them to
# every local user but root and the node's job users, and no two jobs on a node may share one (preflight).
PORT_KEYS = ("port", "store_port")

# The built-in default of every optional key: the one place job defaults live (the torchrun role's
# argument spec repeats them for ansible-doc; a unit test holds the two equal). torchrun_user and
# torchrun_venv, then torchrun_job_defaults, then a job's own keys override them.
JOB_DEFAULTS: dict[str, Any] = {
    "script": None,
    "module": None,
    "args": [],
    "venv": "/opt/budgetgpu/venv",
    "workdir": None,  # /var/lib/budgetgpu/jobs/<name>
    "nodes": "gpu_nodes",
    "nproc_per_node": "gpu",
    "master": None,  # first host of nodes
    "master_addr": None,  # the master's address (nodes.node_address)
    "port": 29500,
    # The port of the workers' own store (MASTER_PORT, on the node that is rank 0 of the rendezvous) with c10d:
    # torch would take a free ephemeral port there, which the firewall leaves open to every local user; the launcher
    # makes torch's agent announce this one (budgetgpu-torchrun --store-port), which the firewall closes. None: port
    # + STORE_PORT_OFFSET (torchrun_job_normalize). A static rendezvous' workers use the store on port instead.
    "store_port": None,
    "rendezvous": "c10d",
    "rendezvous_timeout": 900,
    # Seconds an operation on the c10d store may take (torch's read_timeout): a torchrun start that finds
    # no store fails after it; the launcher's wait for the master reports once per this.
    "rendezvous_read_timeout": 60,
    "node_ranks": {},
    "max_restarts": 3,
    "checkpoint_dir": None,  # <workdir>/checkpoints
    "checkpoint_every_minutes": 15,
    "checkpoint_every_steps": 0,
    # Every N steps the ranks' compute times are compared and rank 0 logs the slowest against the
    # median (module_utils/straggler.py; BUDGETGPU_STRAGGLER_EVERY_STEPS); 0 turns it off.
    "straggler_every_steps": 200,
    # The levers for slow links (straggler.CommSettings reads them from the unit's
    # environment): DDP's communication hook, its bucket size, gradient accumulation.
    "gradient_compression": "none",
    "powersgd_rank": 1,
    "powersgd_start_step": 1000,
    "bucket_cap_mb": 25,
    "accumulate_steps": 1,
    # How the model is spread over the ranks: ddp (every rank holds all of it), fsdp (FSDP2: parameters,
    # gradients and optimizer states sharded over every rank of the job), hsdp (sharded within a node,
    # replicated across nodes: the shards' traffic stays on the node's own links).
    "parallelism": "ddp",
    # The compute precision of forward and backward (fsdp/hsdp: MixedPrecisionPolicy's param_dtype; ddp:
    # autocast); gradients are reduced in fp32. bf16 needs compute capability 8.0 (Ampere) and NCCL.
    "mixed_precision": "none",
    # The dtype of the weights, gradients and optimizer states a rank keeps: fp32 (16 bytes a parameter
    # under AdamW), bf16 (8: the model itself in bf16).
    "state_precision": "fp32",
    # Recompute each block's activations in backward instead of keeping them (about a third more time a step).
    "activation_checkpointing": False,
    # What preflight's training memory planner needs of the model (plugin_utils/training_memory.py): {} plans
    # nothing.
    "model": {},
    "environment": {},
    "user": "budgetgpu",
    "backend": "auto",
    "allow_mixed_gpus": False,
    # The container image the job runs in (docs/job-images.md): None runs it from the venv on the node.
    "image": None,
    "state": "started",
    "enabled": True,
}
JOB_KEYS = frozenset(JOB_DEFAULTS) | {"name"}
# How a job trains, read by its script from the environment (training_environment).
TRAINING_SETTINGS = (
    "parallelism",
    "mixed_precision",
    "state_precision",
    "activation_checkpointing",
    "checkpoint_every_minutes",
    "checkpoint_every_steps",
    "straggler_every_steps",
    "gradient_compression",
    "powersgd_rank",
    "powersgd_start_step",
    "bucket_cap_mb",
    "accumulate_steps",
)
# What a job runs and how it trains, whoever starts it: a systemd unit here, a Slurm batch script
# (role slurm's slurm_jobs takes these keys of the job model and its own for Slurm).
TRAINING_KEYS = ("script", "module", "args", "venv", *TRAINING_SETTINGS, "environment")
_INT_KEYS = (
    "port",
    "store_port",
    "max_restarts",
    "rendezvous_timeout",
    "rendezvous_read_timeout",
    "checkpoint_every_steps",
    "straggler_every_steps",
    "powersgd_rank",
    "powersgd_start_step",
    "accumulate_steps",
    "nproc_per_node",
)
_FLOAT_KEYS = ("checkpoint_every_minutes", "bucket_cap_mb")
STATE_ROOT = "/var/lib/budgetgpu/jobs"
# In a job's state directory: rank 0's latest status (step, steps per second, straggler line). The
# GPUs' energy counters at the unit's start are root's (roles/torchrun vars' records directory).
STATUS_FILE = "status.json"
ENV_DIR = "/etc/budgetgpu/jobs"
# Root's unpacked images, <it>/<digest's hex>/rootfs (read-only for everyone else), and beside each its
# environment (the image's Config.Env) as an env file for the unit.
IMAGE_ROOT = "/var/lib/budgetgpu/images"
# Where an image job finds the driver's user-space libraries (nvidia/cuda's images have it on LD_LIBRARY_PATH).
NVIDIA_LIBRARIES = "/usr/local/nvidia/lib64"
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_IMAGE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:-]*$")
DIGEST_EXPECTED = "sha256: and 64 lowercase hex digits"
# A bad field of one job: (field, found, expected, hint), as preflight's checks yield them.
Bad = tuple[str, Any, str, str]


def unit_name(name: str) -> str:
    """Return the systemd unit of a job: "budgetgpu-job-<name>.service"."""
    return f"{UNIT_PREFIX}{name}.service"


def coerce_numbers(job: dict[str, Any], int_keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """Take numbers written as strings as numbers, in place ("29500" as 29500): extra vars and some
    inventories give them so. Other values are left for the checks to report."""
    for key in (*_INT_KEYS, *int_keys):
        value = job.get(key)
        if isinstance(value, str) and value.strip().isdigit():
            job[key] = int(value)
    for key in _FLOAT_KEYS:
        value = job.get(key)
        if isinstance(value, str) and re.fullmatch(r"\d+(\.\d*)?", value.strip()):
            job[key] = float(value)
    return job


def torchrun_job_normalize(
    job: Mapping[str, Any],
    defaults: Mapping[str, Any] | None = None,
    user: str | None = None,
    venv: str | None = None,
) -> dict[str, Any]:
    """Return the job with every key present. Precedence, lowest first: JOB_DEFAULTS, the shared
    user and venv (torchrun_user, torchrun_venv), defaults (torchrun_job_defaults), the job's keys.

    Unknown keys are kept (preflight reports them); values are not checked here.
    """
    if not isinstance(job, Mapping):
        raise ValueError(f"torchrun_jobs: each job must be a dict, got {type(job).__name__}: {job!r}")
    merged: dict[str, Any] = dict(JOB_DEFAULTS)
    merged.update({k: v for k, v in {"user": user, "venv": venv}.items() if v})
    merged.update({k: v for k, v in (defaults or {}).items() if v is not None})
    merged.update(job)
    coerce_numbers(merged)
    if merged.get("store_port") is None and isinstance(merged.get("port"), int):
        merged["store_port"] = merged["port"] + STORE_PORT_OFFSET
    name = str(merged.get("name") or "")
    if not merged.get("workdir"):
        merged["workdir"] = f"{STATE_ROOT}/{name}"
    if not merged.get("checkpoint_dir"):
        merged["checkpoint_dir"] = f"{merged['workdir'].rstrip('/')}/checkpoints"
    merged["unit"] = unit_name(name)
    merged["env_file"] = f"{ENV_DIR}/{name}.env"
    merged["state_dir"] = f"{STATE_ROOT}/{name}"
    return merged


def torchrun_jobs_normalize(
    jobs: Any, defaults: Mapping[str, Any] | None = None, user: str | None = None, venv: str | None = None
) -> list[dict[str, Any]]:
    """Return every job of torchrun_jobs normalised (see torchrun_job_normalize): budgetgpu_jobs."""
    if jobs is None:
        return []
    if not isinstance(jobs, list):
        raise ValueError(f"torchrun_jobs must be a list of jobs, got {type(jobs).__name__}: {jobs!r}")
    if defaults is not None and not isinstance(defaults, Mapping):
        raise ValueError(f"torchrun_job_defaults must be a dict of job keys, got {type(defaults).__name__}")
    return [torchrun_job_normalize(job, defaults, user, venv) for job in jobs]


def job_hosts(job: Mapping[str, Any], groups: Mapping[str, list[str]]) -> list[str]:
    """Return the hosts of a job's group, in inventory order ([] for an unknown group)."""
    return list(groups.get(str(job.get("nodes")), []) or [])


def job_master(job: Mapping[str, Any], groups: Mapping[str, list[str]]) -> str | None:
    """Return the job's master host: the one named, else the first host of its group."""
    if job.get("master"):
        return str(job["master"])
    hosts = job_hosts(job, groups)
    return hosts[0] if hosts else None


def job_node_ranks(job: Mapping[str, Any], groups: Mapping[str, list[str]], nodes: Mapping[str, Any]) -> dict[str, Any]:
    """Return host -> node rank: the job's node_ranks, else each host's torchrun_node_rank, else
    the master first and the others in group order."""
    hosts = job_hosts(job, groups)
    given = dict(job.get("node_ranks") or {})
    for host in hosts:
        rank = (nodes.get(host) or {}).get("node_rank")
        if host not in given and rank is not None:
            given[host] = rank
    if given:
        return {host: given.get(host) for host in hosts}
    master = job_master(job, groups)
    ordered = [master] + [h for h in hosts if h != master] if master in hosts else hosts
    return {host: rank for rank, host in enumerate(ordered)}


def job_nproc_fixed(job: Mapping[str, Any]) -> bool:
    """Whether the job names its number of processes a node (else "gpu": one per GPU of the node)."""
    return job.get("nproc_per_node") not in ("gpu", "auto", None)


def job_nproc(job: Mapping[str, Any], node: Mapping[str, Any]) -> int | None:
    """Return the number of processes a job runs on a node ("gpu": the node's GPU count)."""
    if not job_nproc_fixed(job):
        return node.get("gpu_count")
    try:
        return int(job["nproc_per_node"])
    except (TypeError, ValueError):
        return None


def job_gpus(job: Mapping[str, Any], node: Mapping[str, Any]) -> list[int]:
    """Return the indices of the GPUs the job's ranks hold on a node (node_info): 0..nproc_per_node-1,
    every GPU for "gpu". The launcher starts them on the same GPUs less the quarantined ones
    (budgetgpu_node.gpu_health.start_plan; a unit test holds the two equal)."""
    return list(range(job_nproc(job, node) or 0))


def training_gpus(jobs: list[Mapping[str, Any]] | None, hostvars: Mapping[str, Any], host: str) -> dict[int, str]:
    """Return {GPU index: job name} of the GPUs that started, enabled training jobs hold on host (job_gpus):
    what inference places its workers around and Slurm leaves out."""
    claimed: dict[int, str] = {}
    node = node_info(hostvars, host)
    for job in jobs or []:
        if job.get("state", "started") != "started" or job.get("enabled", True) is False:
            continue
        if not in_group(hostvars, host, str(job.get("nodes"))):
            continue
        for index in job_gpus(job, node):
            claimed.setdefault(index, str(job.get("name")))
    return claimed


def job_master_addr(job: Mapping[str, Any], groups: Mapping[str, list[str]], nodes: Mapping[str, Any]) -> str | None:
    """Return the address every node dials for the rendezvous."""
    if job.get("master_addr"):
        return str(job["master_addr"])
    master = job_master(job, groups)
    # nodes: cluster_nodes' node_info (its address decided there); a master outside them: its name.
    return (nodes.get(master) or {}).get("address") or master


def job_backend(job: Mapping[str, Any], node: Mapping[str, Any]) -> str:
    """Return the torch.distributed backend: gloo on simulated (CPU) nodes, NCCL on GPUs."""
    if job.get("backend") not in (None, "auto"):
        return str(job["backend"])
    return "gloo" if node.get("simulated") else "nccl"


def _launch_argv(job: Mapping[str, Any], launcher: str | None) -> list[str]:
    """What starts torchrun: the launcher run by the venv's python, the venv's torchrun without one; in an image,
    the launcher alone."""
    if job.get("image"):
        if not launcher:
            raise ValueError(f"job {job.get('name')}: an image job runs through the launcher (torchrun_launcher)")
        # The launcher, bound into the image at its host path, starts with #!/usr/bin/env python3: the image's
        # python3 on the image's PATH, as docker run would find it. The unit's ExecStart is then a file
        # the host has too, which systemd-analyze verify looks for there.
        return [launcher]
    venv_bin = f"{str(job['venv']).rstrip('/')}/bin"
    return [f"{venv_bin}/python3", launcher] if launcher else [f"{venv_bin}/torchrun"]


def torchrun_argv(
    job: Mapping[str, Any],
    host: str,
    groups: Mapping[str, list[str]],
    nodes: Mapping[str, Any],
    launcher: str | None = None,
) -> list[str]:
    """Return the unit's ExecStart as an argv list for this host: <venv>/bin/torchrun, or the
    launcher (a torchrun wrapper) run by the venv's python, or in an image the launcher alone."""
    hosts = job_hosts(job, groups)
    node = nodes.get(host) or {}
    nproc = job_nproc(job, node)
    if nproc is None:
        raise ValueError(
            f"{host}: job {job.get('name')}: cannot tell nproc_per_node: no GPU facts (run the probe first)"
        )
    addr = job_master_addr(job, groups, nodes)
    is_master = host == job_master(job, groups)
    static = job.get("rendezvous") == "static"
    rank = job_node_ranks(job, groups, nodes).get(host) if static else None
    argv = _launch_argv(job, launcher)
    if launcher and not (rank == 0 if static else is_master):
        # The launcher waits for the master's store before torchrun starts, so that a long
        # outage of the master is a wait, not a row of failed starts that ends in systemd's
        # start limit (the unit would stay failed when the master returns).
        argv.append(f"--wait-for-master={endpoint(addr, job['port'])}")
    if launcher and not static:
        # The workers' store on the port the firewall closes, not on a free port torch picks (JOB_DEFAULTS).
        argv.append(f"--store-port={job['store_port']}")
    argv.append(f"--nproc-per-node={nproc}")
    if static:
        argv += [
            f"--nnodes={len(hosts)}",
            f"--node-rank={rank}",
            f"--master-addr={addr}",
            f"--master-port={job['port']}",
        ]
    else:
        argv += [
            f"--nnodes={len(hosts)}:{len(hosts)}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint(addr, job['port'])}",
            f"--rdzv-id={job['name']}",
            # is_host: the master hosts the c10d store because the inventory says so. Left to
            # itself torch decides by resolving its hostname, and on a stock install (hostname on
            # 127.0.1.1, the cluster address not in /etc/hosts) no node would host it.
            f"--rdzv-conf=join_timeout={int(job.get('rendezvous_timeout') or 900)},"
            f"read_timeout={int(job.get('rendezvous_read_timeout') or JOB_DEFAULTS['rendezvous_read_timeout'])},"
            f"is_host={int(is_master)}",
        ]
    if node.get("cluster_address"):
        # Workers find rank 0 by the address its agent advertises: the cluster one, not the hostname.
        argv.append(f"--local-addr={node['cluster_address']}")
    argv.append(f"--max-restarts={job['max_restarts']}")
    if job.get("module"):
        argv += ["--module", str(job["module"])]
    else:
        argv.append(str(job["script"]))
    argv += [str(arg) for arg in job.get("args") or []]
    return argv


def training_environment(job: Mapping[str, Any]) -> dict[str, str]:
    """Return the settings of a job's training that its script reads from the environment
    (train_ddp.py's defaults, straggler.CommSettings.from_env): checkpoint cadence, the
    straggler report and DDP's communication settings. The systemd units and role slurm's batch
    scripts both set them from here."""
    return {f"BUDGETGPU_{key.upper()}": str(job[key]) for key in TRAINING_SETTINGS}


def torchrun_environment(job: Mapping[str, Any], host: str, nodes: Mapping[str, Any]) -> dict[str, str]:
    """Return the job's env file for this host: what the collection sets, then the user's variables."""
    node = nodes.get(host) or {}
    env = {
        "BUDGETGPU_JOB": str(job["name"]),
        "BUDGETGPU_CHECKPOINT_DIR": str(job["checkpoint_dir"]),
        **training_environment(job),
        # Rank 0 writes the job's status here; train.yml -e job_state=status reads it.
        "BUDGETGPU_STATUS_FILE": f"{job['state_dir']}/{STATUS_FILE}",
        "BUDGETGPU_DIST_BACKEND": job_backend(job, node),
        "PYTHONUNBUFFERED": "1",
    }
    if node.get("gpu_uuids"):
        # The launcher leaves quarantined GPUs out at each start (role gpu_health; gpu_health.start_plan).
        env["BUDGETGPU_GPUS"] = ",".join(node["gpu_uuids"])
        env["BUDGETGPU_NPROC_FIXED"] = "1" if job_nproc_fixed(job) else "0"
    if job.get("rendezvous") != "static":
        # The workers get a store of their own for each rendezvous round. torch's default shares
        # the agent's store across in-place restarts, and a restarted worker then read its peers'
        # addresses of the round before: gloo's connectFullMesh failed with "Connection refused"
        # and every in-place restart with it.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env.update({str(k): str(v) for k, v in (job.get("environment") or {}).items()})
    return env


def systemd_quote(value: Any) -> str:
    """Return one word for ExecStart= or an env file, double-quoted with systemd's escapes."""
    text = str(value)
    text = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{text}"'


def systemd_exec(argv: list[str]) -> str:
    """Return an argv list as an ExecStart= command line ($ and % doubled: no expansion)."""
    return " ".join(systemd_quote(a).replace("$", "$$").replace("%", "%%") for a in argv)


def image_bads(job: Mapping[str, Any]) -> Iterator[Bad]:
    """The job's image key, as preflight's checks yield a bad field: (field, found, expected, hint).

    A name pinned by digest ("name@sha256:<hex>", what `docker pull` fetches the same everywhere), or
    {tarball: <path on the control node>, digest: <the image id docker load gives>}. A tag alone moves."""
    value = job.get("image")
    if value is None:
        return
    yield from _bound_dir_bads(job)
    if isinstance(value, str):
        name, digest = value.partition("@")[::2]
        if not digest:
            hint = "a tag moves: docker image inspect --format '{{index .RepoDigests 0}}' NAME:TAG names its digest"
            yield "image", value, "NAME@sha256:<64 hex digits>, the image pinned by digest", hint
        elif not _IMAGE_NAME.match(name):
            yield "image", value, "NAME@sha256:<64 hex digits> with an image name before the @", ""
        elif not _DIGEST.match(digest):
            yield "image", value, f"a digest after the @: {DIGEST_EXPECTED}", ""
        return
    if not isinstance(value, Mapping):
        yield "image", value, "NAME@sha256:<digest>, or {tarball: <path on the control node>, digest: sha256:<id>}", ""
        return
    for key in sorted(set(value) - {"tarball", "digest"}):
        yield f"image.{key}", value[key], "only tarball and digest", "a typo?"
    tarball = value.get("tarball")
    if not (isinstance(tarball, str) and tarball.startswith("/")):
        yield "image.tarball", tarball, "an absolute path on the control node (docker save's output)", ""
    if not (isinstance(value.get("digest"), str) and _DIGEST.match(value["digest"])):
        hint = "docker image inspect --format '{{.Id}}' NAME where the tarball was saved"
        yield "image.digest", value.get("digest"), f"the image id docker load gives: {DIGEST_EXPECTED}", hint


def _bound_dir_bads(job: Mapping[str, Any]) -> Iterator[Bad]:
    """An image job's workdir and checkpoint_dir outside its state directory. The unit binds the state directory
    into the image, and systemd resolves a bind's source as root, following links: a directory whose parent the
    job's user may write (its own state directory, its home) could be swapped for a link to a place only root
    reaches (another image's files behind root's 0700 directory). The state directory's parents are root's, so it
    is the one directory bound; what lies in it is reached through it, links resolved inside the image."""
    state_dir = f"{STATE_ROOT}/{job.get('name')}"
    for field in ("workdir", "checkpoint_dir"):
        path = job.get(field)
        if isinstance(path, str) and path.startswith("/") and not in_directory(path, state_dir):
            hint = "root binds only that directory into the image; a path its user may change could be made a link"
            yield field, path, f"{state_dir} or a directory in it, for an image job", hint


def in_directory(path: str, directory: str) -> bool:
    """Whether path is directory or lies in it, with no '..' to leave it."""
    return ".." not in path.split("/") and (path.rstrip("/") + "/").startswith(directory.rstrip("/") + "/")


def _untagged(name: str) -> str:
    """An image name without its tag (registry.lan:5000/team/train:v1 -> registry.lan:5000/team/train): beside a
    digest a tag says nothing, and root's commands name the image by the digest alone."""
    head, slash, last = name.rpartition("/")
    return head + slash + last.partition(":")[0]


def engine_user_problems(
    jobs: list[Mapping[str, Any]], host: str, groups: Mapping[str, list[str]], engine_users: list[str], where: str
) -> list[str]:
    """Why host's jobs (all but those to be removed, image or venv) cannot run: a job's user among engine_users,
    the users that may use the node's Docker engine (where: how they may, "in the docker group"). The docker group
    is root's equal (docker run -v /:/host), and no job needs an engine: an image job's unit runs its image."""
    running = [job for job in jobs if job.get("state") != "absent" and host in job_hosts(job, groups)]
    users = sorted({str(job.get("user")) for job in running} & set(engine_users or []))
    if not users:
        return []
    names = ", ".join(str(job.get("name")) for job in running if job.get("user") in users)
    return [
        f"{host}: job(s) {names} run as {', '.join(users)}, {where}: the docker group is root's equal "
        "(docker run -v /:/host) and no job needs an engine (an image job's unit runs its image, docs/job-images.md): "
        f"take {', '.join(users)} out of container_runtime_users and out of the docker group on {host} "
        "(gpasswd -d USER docker)"
    ]


def job_image(job: Mapping[str, Any]) -> dict[str, Any] | None:
    """Return what the nodes do with a job's image (None: a venv job): {ref: what docker names it by
    (NAME@sha256:<digest> without a tag, or a tarball's image id), digest, tarball (None: pulled), root: the
    unpacked root filesystem, env_file: its environment, nvidia_libraries: where the unit binds the driver's
    libraries}.
    A bad image raises ValueError naming job, key, found and expected."""
    for field, found, expected, hint in image_bads(job):
        raise ValueError(
            f"job {job.get('name')}: {field}: found {found!r}, expected {expected}" + (f" ({hint})" if hint else "")
        )
    value = job.get("image")
    if value is None:
        return None
    if isinstance(value, str):
        name, digest = value.partition("@")[::2]
        ref, tarball = f"{_untagged(name)}@{digest}", None
    else:
        # docker load keeps the tarball's tags, or none: the image is named by its id.
        ref, digest, tarball = value["digest"], value["digest"], value["tarball"]
    where = f"{IMAGE_ROOT}/{digest.partition(':')[2]}"
    image = {"ref": ref, "digest": digest, "tarball": tarball, "root": f"{where}/rootfs", "env_file": f"{where}/env"}
    return {**image, "nvidia_libraries": NVIDIA_LIBRARIES}


def image_environment(config_env: list[str] | None, node_packages: str) -> dict[str, str]:
    """Return an image job's environment from its image (docker image inspect's Config.Env, "NAME=value"
    items), which systemd's RootDirectory= does not apply on its own: with the node package after the
    image's PYTHONPATH (the launcher's health check, the trainer's helpers) and the driver's libraries,
    bound at /usr/local/nvidia/lib64, on LD_LIBRARY_PATH where the image (unlike nvidia/cuda's) does not
    put them."""
    env = dict(item.partition("=")[::2] for item in config_env or [] if ENV_NAME.match(item.partition("=")[0]))
    env["PYTHONPATH"] = ":".join(part for part in (env.get("PYTHONPATH"), node_packages) if part)
    libraries = env.get("LD_LIBRARY_PATH", "")
    if NVIDIA_LIBRARIES not in libraries.split(":"):
        env["LD_LIBRARY_PATH"] = ":".join(part for part in (libraries, NVIDIA_LIBRARIES) if part)
    return env


def image_cuda(config_env: list[str] | None) -> str | None:
    """Return the CUDA an image was built for: its CUDA_VERSION (nvidia/cuda's images and those built on them)."""
    env = dict(item.partition("=")[::2] for item in config_env or [])
    return env.get("CUDA_VERSION") or None


def images_found(results: list[Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Return the node's images as the fact budgetgpu_job_images: {digest: {id, cuda, env}}, from the results of
    `docker image inspect REF` looped over the plan's images (item: job_image's dict); an image docker does
    not have (rc 1) is left out."""
    found = {}
    for result in results or []:
        if result.get("rc") != 0 or not result.get("stdout"):
            continue
        (inspect,) = json.loads(result["stdout"])
        env = list((inspect.get("Config") or {}).get("Env") or [])
        found[str(result["item"]["digest"])] = {"id": inspect.get("Id"), "cuda": image_cuda(env), "env": env}
    return found


def image_tarball_problems(results: list[Mapping[str, Any]] | None, host: str) -> list[str]:
    """Return why a job's tarball is not its image, before the tarball is copied or loaded: the results of `tar
    --extract --to-stdout --file TARBALL manifest.json` on the control node, looped over the node's first
    inspects of its missing tarball images (item: the inspect's result, whose item is job_image's dict). docker
    save's manifest names each image's config, whose SHA-256 is the image's id (Config: "<hex>.json", or
    "blobs/sha256/<hex>" from Docker 25); a tarball without one, or whose ids miss the job's digest, is refused.
    Once loaded, such an image would stay in the node's Docker though no job names it."""
    problems = []
    for result in results or []:
        image = result["item"]["item"]
        what = f"{host}: image tarball {image['tarball']}"
        try:
            entries = json.loads(result.get("stdout") or "") if result.get("rc") == 0 else None
            ids = [f"sha256:{str(entry['Config']).rsplit('/', 1)[-1].removesuffix('.json')}" for entry in entries]
        except (TypeError, KeyError, ValueError):
            said = (result.get("stderr") or "").strip().splitlines()[-1:] or ["unreadable"]
            problems.append(
                f"{what}: no manifest.json of docker save in it ({said[0]}): expected `docker save`'s tarball"
            )
            continue
        if image["digest"] not in ids:
            problems.append(
                f"{what} holds image {', '.join(ids) or 'none'}, not the job's {image['digest']}: docker load would "
                "give no image of that id (scripts/build-job-image prints a tarball and its id)"
            )
    return problems


def _image_jobs(jobs: list[Mapping[str, Any]]) -> Iterator[tuple[Mapping[str, Any], dict[str, Any]]]:
    """Yield (job, job_image) for each job that runs in an image and is not absent."""
    for job in jobs:
        image = job_image(job) if job.get("state") != "absent" else None
        if image is not None:
            yield job, image


def _named_image(hostvars: Mapping[str, Any], host: str, name: Any, lists: str) -> tuple[str | None, str] | None:
    """Return (digest, what the host's own job list names) for its job name: (None, ...) for a venv job; None where
    the host has no job list in this run (its fact or variable `lists`: outside the play), no such job, has it
    absent, or names a bad image key (preflight refuses that one, naming the key)."""
    theirs = next((job for job in fact(hostvars, host, lists) or [] if job.get("name") == name), None)
    if theirs is None or theirs.get("state") == "absent" or next(image_bads(theirs), None):
        return None
    image = job_image(theirs)
    if image is None:
        return None, "no image: the venv"
    return image["digest"], f"{image['digest']} ({image['tarball'] or image['ref']})"


def torchrun_image_differences(
    jobs: list[Mapping[str, Any]],
    groups: Mapping[str, list[str]],
    hostvars: Mapping[str, Any],
    lists: str = "budgetgpu_jobs",
) -> list[str]:
    """Return why jobs cannot start, before anything changes: a job whose nodes name different images (a host's or
    a group's vars give one node another image, another tarball and digest, or none). Such a node would run its
    own image, or its ranks in the venv beside the others' in the image. Each node's own job list is its fact
    budgetgpu_jobs (tasks/jobs.yml, worked out once a run), or its variable `lists` names (role slurm: slurm_jobs);
    every node of a job reads all of theirs, a venv job's too, so that each of them refuses."""
    problems = []
    for job in jobs:
        if job.get("state") == "absent":
            continue
        named = {host: _named_image(hostvars, host, job.get("name"), lists) for host in job_hosts(job, groups)}
        named = {host: image for host, image in named.items() if image is not None}
        if len({image[0] for image in named.values()}) > 1:
            listed = ", ".join(f"{host}: {image[1]}" for host, image in sorted(named.items()))
            problems.append(
                f"job {job.get('name')}: its nodes name different images ({listed}): every node must run the same "
                "image (a host's or a group's vars name another for some)"
            )
    return problems


def torchrun_image_problems(
    jobs: list[Mapping[str, Any]], groups: Mapping[str, list[str]], hostvars: Mapping[str, Any]
) -> list[str]:
    """Return why the image jobs cannot start: a job's image missing on one of its nodes, an image whose id
    differs between nodes (the same name and digest, or a tarball, gave different images), an image built
    for a newer CUDA than a node's driver runs. Each node this run looked at reports its images as the fact
    budgetgpu_job_images ({digest: {id, cuda, env}}, images_found after the pull or load), and its driver in
    budgetgpu_gpus."""
    problems = []
    for job, image in _image_jobs(jobs):
        # A node this run did not look at (no fact: outside the play, or an ansible-pull run of another node)
        # is not judged; one that looked and has no such image is.
        seen_by = {host: fact(hostvars, host, "budgetgpu_job_images") for host in job_hosts(job, groups)}
        found = {host: images.get(image["digest"]) or {} for host, images in seen_by.items() if images is not None}
        what = f"job {job.get('name')}: image {image['tarball'] or job['image']}"
        why = f"docker load gave no image of id {image['digest']}" if image["tarball"] else "the pull did not give it"
        for host in sorted(host for host, seen in found.items() if not seen.get("id")):
            problems.append(f"{host}: {what} is missing on the node ({why})")
        ids = {seen["id"]: host for host, seen in found.items() if seen.get("id")}
        if len(ids) > 1:
            listed = ", ".join(
                f"{host}: {image_id}" for image_id, host in sorted(ids.items(), key=lambda item: item[1])
            )
            problems.append(f"{what} differs between nodes ({listed}): every node must run the same image")
        for host, seen in sorted(found.items()):
            driver = parse_cuda_version(driver_cuda(fact(hostvars, host, "budgetgpu_gpus"), simulated(hostvars, host)))
            built = parse_cuda_version(seen.get("cuda"))
            if driver and built and built > driver:
                problems.append(
                    f"{host}: {what} is built for CUDA {seen['cuda']}, the node's driver runs CUDA "
                    f"{driver[0]}.{driver[1]}: choose an image of CUDA {driver[0]}.{driver[1]} or older, "
                    "or upgrade the driver"
                )
    return problems


def torchrun_masters_unknown(
    jobs: list[Mapping[str, Any]], host: str, groups: Mapping[str, list[str]], nodes: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """Return this host's jobs whose master has no cluster address in this run (no facts: an
    ansible-pull run knows only its own node) and that name no master_addr."""
    return [
        dict(job)
        for job in jobs
        if host in job_hosts(job, groups)
        and job.get("state") != "absent"
        and not job.get("master_addr")
        and not (nodes.get(job_master(job, groups)) or {}).get("cluster_address")
    ]


_RECORDED_ENDPOINT = re.compile(r'"--rdzv-endpoint=(\[[^\]"]+\]|[^":]+):\d+"|"--master-addr=([^"]+)"')


def torchrun_recorded_masters(slurped: list[Mapping[str, Any]]) -> dict[str, str]:
    """Return {job name: master address} read from the ExecStart= of units written before (slurp
    results, item = the job): the address an earlier run with the master's facts decided."""
    recorded = {}
    for result in slurped or []:
        job, content = result.get("item") or {}, result.get("content")
        if not content or not job.get("name"):
            continue
        match = _RECORDED_ENDPOINT.search(base64.b64decode(content).decode("utf-8", "replace"))
        if match:
            recorded[str(job["name"])] = (match[1] or match[2]).strip("[]")
    return recorded


def torchrun_plan(
    jobs: list[Mapping[str, Any]],
    host: str,
    groups: Mapping[str, list[str]],
    nodes: Mapping[str, Any],
    launcher: str | None = None,
    recorded_masters: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Return the normalised jobs that run on host, each with its exec line and env for this host.

    recorded_masters ({job: address}, torchrun_recorded_masters) stands in for the master's cluster
    address when this run has no facts of the master, so that the unit keeps the address it has.
    """
    plan = []
    for job in jobs:
        if host not in job_hosts(job, groups):
            continue
        if job.get("name") in (recorded_masters or {}) and torchrun_masters_unknown([job], host, groups, nodes):
            job = {**job, "master_addr": recorded_masters[job["name"]]}
        item = dict(job)
        item["node_count"] = len(job_hosts(job, groups))
        if job.get("state") != "absent":
            item["argv"] = torchrun_argv(job, host, groups, nodes, launcher)
            item["exec_start"] = systemd_exec(item["argv"])
            item["env"] = torchrun_environment(job, host, nodes)
            # The GPUs the job's ranks run on, the only ones its unit opens.
            node = nodes.get(host) or {}
            item["gpu_indices"] = job_gpus(job, node)
            item["device_allow"] = unit_device_allow(node.get("gpus"), item["gpu_indices"])
            item["image"] = job_image(job)
        plan.append(item)
    return plan


def systemd_show(output: str) -> dict[str, dict[str, str]]:
    """`systemctl show --property=Id,... UNIT...` output as {unit: {property: value}}: one call for
    every job's unit, where service_facts lists every unit on the node."""
    units: dict[str, dict[str, str]] = {}
    for block in str(output).strip().split("\n\n"):
        props = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        if "Id" in props:
            units[props["Id"]] = props
    return units


def running_units(units: Mapping[str, Mapping[str, Any]] | None) -> list[str]:
    """Return the units of systemd_show's answer that count as running (module_utils/job_metrics.py
    unit_running, the one definition)."""
    return [unit for unit, props in (units or {}).items() if unit_running(props.get("ActiveState"))]


def _slurped_json(result: Mapping[str, Any] | None) -> Any:
    """Return the JSON a slurp result holds; None for a missing or unreadable file."""
    content = (result or {}).get("content")
    if not content:
        return None
    try:
        return json.loads(base64.b64decode(content).decode("utf-8"))
    except ValueError:
        return None


# The verdict on a step breakdown (rank 0's status: each rank's compute, communication not hidden and
# data wait per step). A rank waiting this share of its step for data has a loader that does not keep
# up (the guide gained 15% from a faster CPU); communication not hidden on every rank from this share
# on is worth a lever (the guide: 5 ms of 50 ms at 4 GPUs is fine, 30 ms of 50 loses 60%).
DATA_WAIT_FLAG = 0.10
COMM_FLAG = 0.20


def _breakdown_ranks(status: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The ranks of a status with a whole breakdown: step_s (compute), comm_s, data_s, wall_s > 0."""
    keys = ("step_s", "comm_s", "data_s", "wall_s")
    ranks = []
    for rank in status.get("ranks") or []:
        if not isinstance(rank, Mapping):
            continue
        values = [rank.get(k) for k in keys]
        if all(isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in values) and values[3] > 0:
            ranks.append(dict(rank))
    return ranks


def _comm_advice(status: Mapping[str, Any]) -> str:
    """The levers against communication not hidden, the fastest first, leaving out what the job runs
    already and what its backend cannot run (bf16 wants NCCL). On gloo the order is measured
    (docs/benchmarks/scaling.md, 4 CPU nodes, all-reduce 0.6 of compute, against stock DDP's samples/s:
    accumulate_steps 2 1.22x, fp16 1.02x, PowerSGD 0.90x, its buckets one at a time on gloo). On NCCL,
    which no machine here has, the fewest bytes on the wire first: PowerSGD, then half precision."""
    backend, compression = status.get("backend"), status.get("gradient_compression") or "none"
    accumulate = status.get("accumulate_steps")
    more = "accumulate_steps" + (f" above {accumulate}" if isinstance(accumulate, int) and accumulate > 1 else "")
    if backend == "nccl":
        levers = [] if compression == "powersgd" else ["gradient_compression: powersgd"]
        levers += ["fp16 (bf16 on NCCL)"] if compression == "none" else []
        levers += ["a larger batch per GPU", more]
    else:
        others = {"none": ["fp16", "powersgd"], "powersgd": []}.get(compression, ["powersgd"])
        levers = [more, "a larger batch per process"]
        levers += [f"gradient_compression: {others[0]}", *others[1:]] if others else []
    return ", ".join(levers[:-1]) + f", or {levers[-1]}"


def step_verdict(status: Mapping[str, Any] | None) -> list[str]:
    """Return the lines job_state=status prints about where a job's step time goes, from rank 0's
    breakdown alone ([] without one): the median rank's split, then what to change when one part
    dominates: the worst rank's data wait, communication not hidden on every rank."""
    ranks = _breakdown_ranks(status or {})
    if not ranks or not isinstance(status, Mapping):
        return []
    shares = [(r["step_s"] / r["wall_s"], r["comm_s"] / r["wall_s"], r["data_s"] / r["wall_s"], r) for r in ranks]
    middle = sorted(shares, key=lambda s: s[3]["wall_s"])[len(shares) // 2]
    lines = [
        f"step time {middle[3]['wall_s']:.3f} s (median of {len(ranks)} ranks): compute {middle[0]:.0%}, "
        f"communication not hidden {middle[1]:.0%}, waiting for data {middle[2]:.0%}"
    ]
    worst = max(shares, key=lambda s: (s[2], -int(s[3].get("rank") or 0)))
    if worst[2] >= DATA_WAIT_FLAG:
        where = f"{worst[3].get('host') or '?'} rank {worst[3].get('rank')}"
        lines.append(
            f"{where} waits {worst[2]:.0%} of each step for data: the data loader does not keep up "
            "(more workers, or a faster CPU: the guide saw 15%)"
        )
    hidden_least = min(s[1] for s in shares)  # the slowest rank waits least for the others
    if len(ranks) > 1 and hidden_least >= COMM_FLAG:
        lines.append(f"communication not hidden by compute: {hidden_least:.0%} of a step; try {_comm_advice(status)}")
    return lines


def _rank0_status(status: Mapping[str, Any] | None, now: float) -> tuple[dict[str, Any], list[str]]:
    """Return what rank 0's status file (parsed; None: no file) gives torchrun_job_status: {step, steps_per_s,
    straggler, verdict} and its lines."""
    if not isinstance(status, Mapping):
        return {}, ["no status from rank 0 on this node (rank 0 writes it on the job's master)"]
    found = {"step": status.get("step"), "steps_per_s": status.get("steps_per_s")}
    found["straggler"] = status.get("straggler") or ""
    age = now - float(status.get("time") or now)
    lines = [
        f"step {status.get('step')}, {float(status.get('steps_per_s') or 0):.2f} steps/s "
        f"(rank 0's status of {age:.0f} s ago)",
        found["straggler"] or "straggler: no report yet",
    ]
    if status.get("world_change"):
        # Restarted on fewer GPUs than planned (a GPU taken out; sharding.keep_global_batch's words).
        lines.append(f"world changed: {status['world_change']}")
    found["verdict"] = step_verdict(status)
    return found, lines + found["verdict"]


def torchrun_job_status(
    job: Mapping[str, Any],
    unit: Mapping[str, str] | None,
    status: Mapping[str, Any] | None,
    energy_start: Mapping[str, Any] | None,
    gpus_facts: Mapping[str, Any] | None,
    now: float,
    price: Any = None,
    currency: Any = None,
    base_watts: Any = None,
    cpu_now: Any = None,
) -> dict[str, Any]:
    """Return what train.yml -e job_state=status prints for one job on one node: its unit's state
    (systemctl show: ActiveState, SubState, NRestarts), rank 0's status file (status.json: step,
    steps_per_s, straggler, time; only rank 0's node has one), and the job run's energy and cost
    (energy.job_run_energy of the counters recorded at the unit's start against gpu_facts now, and the rest
    of the node since then from base_watts, budgetgpu_node_base_watts; cpu_now: the RAPL reader's state).

    status and energy_start are the parsed files, or slurp results of them (None: no file).
    Returns {"job", "state", "step", "steps_per_s", "straggler", "energy": {...}, "lines": [...]}.
    """
    if isinstance(status, Mapping) and "content" in status:
        status = _slurped_json(status)
    if isinstance(energy_start, Mapping) and "content" in energy_start:
        energy_start = _slurped_json(energy_start)
    unit = unit or {}
    state = f"{unit.get('ActiveState', 'unknown')} ({unit.get('SubState', 'unknown')})"
    if unit.get("LoadState") == "not-found":
        state = "no unit"
    lines = [f"job {job.get('name')}: unit {job.get('unit')} {state}, restarts {unit.get('NRestarts', '?')}"]
    result: dict[str, Any] = {"job": job.get("name"), "state": state, "step": None, "steps_per_s": None}
    result["straggler"], result["verdict"] = "", []
    found, status_lines = _rank0_status(status, now)
    result.update(found)
    lines += status_lines
    run = energy.job_run_energy(
        energy_start,
        (gpus_facts or {}).get("gpus") or [],
        energy.DEFAULT_PRICE_PER_KWH if price is None else float(price),
        energy.DEFAULT_CURRENCY if currency is None else str(currency),
        now=now,
        base_watts=None if base_watts is None else float(base_watts),
        cpu_now=cpu_now,
    )
    result["energy"] = run
    lines.append(run["line"])
    result["lines"] = lines
    return result
