"""Training jobs for Slurm (role slurm's ``slurm_jobs``): each entry becomes a batch script that a user
submits with ``sbatch`` and that runs the shipped ``torchrun.sbatch`` with the job's settings.

An entry takes the job model's keys for what runs and how it trains (``jobs.TRAINING_KEYS``: script or
module, args, venv, checkpoint cadence, the straggler report, DDP's communication settings,
environment), checked by the same rules as ``torchrun_jobs`` (``preflight.training_bads``), and its own
for Slurm: how many nodes, GPUs per node and their type, a time limit. Where it runs is Slurm's choice,
so the checks that need nodes are made against every Slurm node: a job that no set of nodes could run
(more GPUs of a type per node, or more such nodes, than there are) is refused, not queued forever.

Controller side and pure; bad input raises one ValueError naming the host, the job and every field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.jobs import (
    JOB_DEFAULTS,
    JOB_NAME,
    TRAINING_KEYS,
    USER_NAME,
    coerce_numbers,
    image_bads,
    job_image,
    training_environment,
)
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.nodes import node_info
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.preflight import (
    compression_backend_problems,
    training_bads,
)

BATCH_JOB_DEFAULTS: dict[str, Any] = {
    "nodes": 1,  # Slurm nodes (--nodes)
    "gpus_per_node": 1,  # --gres=gpu[:type]:N on each; torchrun.sbatch starts one process per GPU
    "gpu_type": None,  # a GRES type of gres.conf (rtx3090): any type when not given
    "time": None,  # --time (minutes, HH:MM:SS, D-HH:MM:SS, UNLIMITED); the partition's limit when not given
    # The Unix group whose members submit the job: they alone may read its environment file (0640). Required with
    # `environment` (which may hold a token): the batch script every user can read holds no value of it.
    "group": None,
    # The container image the job runs in (NAME@sha256:<digest> or {tarball, digest}, as torchrun_jobs takes it):
    # torchrun.sbatch starts each node's torchrun in it with bubblewrap (docs/slurm.md). None: the venv.
    "image": None,
    **{key: JOB_DEFAULTS[key] for key in TRAINING_KEYS},
}
BATCH_JOB_KEYS = frozenset(BATCH_JOB_DEFAULTS) | {"name"}
# What sbatch --time takes: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or UNLIMITED.
SLURM_TIME = re.compile(r"UNLIMITED|\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}")


def batch_job_normalize(job: Any) -> dict[str, Any]:
    """Return the entry with every key present (BATCH_JOB_DEFAULTS, then its own), numbers written as
    strings taken as numbers. Unknown keys are kept for the checks to report."""
    if not isinstance(job, Mapping):
        raise ValueError(f"slurm_jobs: each job must be a dict, got {type(job).__name__}: {job!r}")
    return coerce_numbers({**BATCH_JOB_DEFAULTS, **job}, ("nodes", "gpus_per_node"))


def _offers(nodes: list[Mapping[str, Any]], gpu_type: Any) -> list[int]:
    """Each Slurm node's GPUs of the type (of any type without one)."""
    return [sum(1 for gpu in node.get("gpus") or [] if gpu_type in (None, gpu["type"])) for node in nodes]


def _bad_slurm_fields(job: Mapping[str, Any], nodes: list[Mapping[str, Any]]) -> list[tuple[str, Any, str, str]]:
    """Name, keys, and the Slurm request against what the nodes offer."""
    bads: list[tuple[str, Any, str, str]] = []
    if not isinstance(job.get("name"), str) or not JOB_NAME.fullmatch(job["name"]):
        bads.append(("name", job.get("name"), "letters, digits, '_', '.' or '-'", "it names the script and the job"))
    for key in sorted(set(job) - BATCH_JOB_KEYS):
        bads.append((key, job[key], f"one of the known keys: {', '.join(sorted(BATCH_JOB_KEYS))}", "a typo?"))
    types = sorted({gpu["type"] for node in nodes for gpu in node.get("gpus") or []})
    if job.get("gpu_type") is not None and job["gpu_type"] not in types:
        bads.append(("gpu_type", job["gpu_type"], f"a GRES type of the nodes: {', '.join(types) or 'none'}", ""))
    group = job.get("group")
    if (group is not None or job.get("environment")) and not (isinstance(group, str) and USER_NAME.fullmatch(group)):
        expected = "the Unix group whose members submit the job, e.g. ml-team"
        bads.append(("group", group, expected, "its environment lands in a file only that group can read"))
    if job.get("time") is not None and not SLURM_TIME.fullmatch(str(job["time"])):
        bads.append(("time", job["time"], "minutes, HH:MM:SS, D-HH:MM:SS or UNLIMITED (sbatch --time)", ""))
    count, gpus = job.get("nodes"), job.get("gpus_per_node")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        bads.append(("nodes", count, "a number of Slurm nodes, 1 or more", ""))
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
        bads.append(("gpus_per_node", gpus, "a number of GPUs, 0 or more", ""))
    if not any(field in ("gpu_type", "nodes", "gpus_per_node") for field, *_rest in bads):
        offers = _offers(nodes, job.get("gpu_type"))
        if sum(1 for offer in offers if offer >= gpus) < count:
            what = f"{job.get('gpu_type') or 'GPU'}s"
            have = ", ".join(f"{node['name']} {offer}" for node, offer in zip(nodes, offers, strict=True))
            hint = "Slurm would hold the job in the queue for good"
            bads.append(("nodes", f"{count} with {gpus} {what} each", f"at most what the nodes offer ({have})", hint))
    return bads


def batch_job_problems(
    job: Mapping[str, Any], nodes: list[Mapping[str, Any]], infos: Mapping[str, Any], host: str
) -> list[str]:
    """Return one message per bad field of a normalised entry, naming host and job; `infos` are the
    Slurm nodes' node_info (whether each trains on gloo or NCCL)."""
    label = f"{host}: slurm_jobs[{job.get('name')}]"
    messages = []
    for field, found, expected, hint in [*_bad_slurm_fields(job, nodes), *training_bads(job), *image_bads(job)]:
        messages.append(f"{label}.{field}: found {found!r}, expected {expected}" + (f" ({hint})" if hint else ""))
    for problem in compression_backend_problems(job, list(infos), infos):
        messages.append(
            f"{label}.{problem['field']}: found {problem['found']} on {problem['host']}, "
            f"expected {problem['expected']} ({problem['hint']})"
        )
    return messages


def sbatch_options(job: Mapping[str, Any]) -> list[str]:
    """Return the job's own #SBATCH options (torchrun.sbatch's own lines come with it)."""
    options = [f"--job-name={job['name']}", f"--nodes={job['nodes']}"]
    if job["gpus_per_node"]:
        kind = f"{job['gpu_type']}:" if job.get("gpu_type") else ""
        options.append(f"--gres=gpu:{kind}{job['gpus_per_node']}")
    if job.get("time") is not None:
        options.append(f"--time={job['time']}")
    return options


def batch_jobs(
    jobs: Any, nodes: list[Mapping[str, Any]], hostvars: Mapping[str, Any], host: str
) -> list[dict[str, Any]]:
    """Return slurm_jobs normalised, each with ``sbatch`` (its #SBATCH options), ``env`` (what its
    script exports: training_environment, the venv), ``user_env`` (the entry's environment, which its script
    reads from a file only ``group`` may read, after env) and ``argv`` (what follows torchrun.sbatch: the
    script or --module and the arguments) and ``image_plan`` (what the nodes do with its image, jobs.job_image's: None
    for a venv job; ``image`` stays as given, as torchrun's image tasks read it). ``nodes`` are the Slurm nodes
    (slurm_nodes). ValueError naming host, job and field for every bad entry."""
    if jobs is None:
        return []
    if not isinstance(jobs, list):
        raise ValueError(f"{host}: slurm_jobs: found {type(jobs).__name__} {jobs!r}, expected a list of jobs")
    normalised = [batch_job_normalize(job) for job in jobs]
    infos = {node["host"]: node_info(hostvars, node["host"]) for node in nodes}
    problems = [message for job in normalised for message in batch_job_problems(job, nodes, infos, host)]
    names = [job.get("name") for job in normalised]
    problems += [
        f"{host}: slurm_jobs: found two jobs named {name}, expected one"
        for name in sorted({name for name in names if names.count(name) > 1}, key=str)
    ]
    if problems:
        raise ValueError("; ".join(problems))
    for job in normalised:
        job["sbatch"] = sbatch_options(job)
        job["env"] = {**training_environment(job), "BUDGETGPU_VENV": str(job["venv"]), "PYTHONUNBUFFERED": "1"}
        job["user_env"] = {str(k): str(v) for k, v in job["environment"].items()}
        job["image_plan"] = job_image(job)
        entry = ["--module", str(job["module"])] if job.get("module") else [str(job["script"])]
        job["argv"] = entry + [str(arg) for arg in job["args"]]
    return normalised
