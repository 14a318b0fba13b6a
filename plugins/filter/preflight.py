"""Cluster-wide preflight checks: the inventory's jobs against what the probes found on every node.

Pure functions of their inputs; no I/O. ``cluster_check(nodes, jobs, groups, options)`` returns
``{"problems": [...], "warnings": [...], "report": [lines]}``; each problem and warning is a dict
``{host, job, field, found, expected, hint}``, and every report line names host, field, what was
found and what was expected. ``nodes`` comes from the ``cluster_nodes`` filter (torchrun.py), the
jobs from ``torchrun_jobs_normalize``.

Checks:

- each job: a valid name (no spaces or slashes), exactly one of script/module, a known rendezvous
  backend, port, restarts, checkpoint interval, absolute paths, an unprivileged user, known keys;
- each job across its nodes: every node probed, ``nproc_per_node`` between 1 and the node's GPU
  count, node ranks unique and contiguous (master = rank 0 with static rendezvous), the master
  in the group, the script present on every node, one GPU model (unless ``allow_mixed_gpus``),
  one driver major, one torch/CUDA/NCCL version in the venvs, the same ``torchrun_jobs`` on
  every node; fewer CPUs per process than ``min_cpus_per_process`` is a warning;
- across jobs: no two jobs that share a node on one port;
- each node: PCIe links not below what the inventory expects (``probe_pcie_min_width``,
  ``probe_pcie_expected``: {bus id: {width, gen}}, the probe role's variables).
"""

from __future__ import annotations

import posixpath
from collections import Counter
from collections.abc import Mapping
from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.filter.torchrun import (
    BACKENDS,
    ENV_NAME,
    JOB_KEYS,
    JOB_NAME,
    RENDEZVOUS,
    STATES,
    USER_NAME,
    job_hosts,
    job_master,
    job_node_ranks,
    job_nproc,
)
from ansible_collections.budgetgpu.cluster.plugins.module_utils.pcie import normalize_bus_id

DEFAULT_OPTIONS: dict[str, Any] = {
    "min_cpus_per_process": 2,
    # Scripts the collection installs itself (train.yml), so they need not exist yet.
    "provided_scripts": [],
    # The nightly run (safe mode): a node that is down is reported, the others go on.
    "down_nodes_ok": False,
}


def _problem(host: str, job: str | None, field: str, found: Any, expected: Any, hint: str = "") -> dict[str, Any]:
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
    """Return the scripts that must exist on host (those of its jobs, minus the collection's own)."""
    paths = []
    for job in jobs:
        if host in job_hosts(job, groups) and job.get("state") != "absent":
            path = job_script_path(job)
            if path and path not in (provided or []) and path not in paths:
                paths.append(path)
    return paths


# --- one job on its own -------------------------------------------------------------------


def _check_job_fields(job: Mapping[str, Any], groups: Mapping[str, list[str]]) -> list[dict[str, Any]]:
    name = job.get("name")
    label = str(name) if name else None
    hosts = job_hosts(job, groups)
    where = _where(hosts)
    out: list[dict[str, Any]] = []

    def bad(field: str, found: Any, expected: str, hint: str = "") -> None:
        out.append(_problem(where, label, field, found, expected, hint))

    if not isinstance(name, str) or not JOB_NAME.fullmatch(name):
        bad(
            "name",
            name,
            "letters, digits, '_', '.' or '-' (^[A-Za-z0-9_.-]+$)",
            "the name becomes a unit and a directory name: no spaces or slashes",
        )
    for key in sorted(set(job) - JOB_KEYS - {"unit", "env_file", "state_dir"}):
        bad(key, job[key], f"one of the known keys: {', '.join(sorted(JOB_KEYS))}", "a typo? see torchrun_jobs")
    script, module = job.get("script"), job.get("module")
    if bool(script) == bool(module):
        bad(
            "script",
            f"script={script!r}, module={module!r}",
            "exactly one of script (a path on the node) or module (python -m)",
        )
    elif script is not None and not isinstance(script, str):
        bad("script", script, "a path (string)")
    if not isinstance(job.get("args"), list):
        bad("args", job.get("args"), "a list of arguments")
    group = job.get("nodes")
    if not hosts:
        bad(
            "nodes",
            group,
            f"an inventory group with at least one host (groups: {', '.join(sorted(groups))})",
        )
    nproc = job.get("nproc_per_node")
    if nproc not in ("gpu", "auto") and (_int_or_none(nproc) is None or _int_or_none(nproc) < 1):
        bad("nproc_per_node", nproc, '"gpu" (the node\'s GPU count) or a number of 1 or more')
    master = job_master(job, groups)
    if hosts and master not in hosts:
        bad("master", master, f"a host of group {group}: {', '.join(hosts)}", "name a node of the job")
    port = job.get("port")
    if not _is_int(port) or not 1 <= port <= 65535:
        bad("port", port, "a TCP port from 1 to 65535")
    if job.get("rendezvous") not in RENDEZVOUS:
        bad(
            "rendezvous",
            job.get("rendezvous"),
            f"one of {', '.join(RENDEZVOUS)}",
            "c10d: elastic rendezvous on the master; static: fixed node ranks as in the guide",
        )
    timeout = job.get("rendezvous_timeout")
    if not _is_int(timeout) or timeout < 1:
        bad("rendezvous_timeout", timeout, "seconds, 1 or more")
    restarts = job.get("max_restarts")
    if not _is_int(restarts) or restarts < 0:
        bad("max_restarts", restarts, "a number of 0 or more")
    minutes, steps = job.get("checkpoint_every_minutes"), job.get("checkpoint_every_steps")
    if isinstance(minutes, bool) or not isinstance(minutes, int | float) or minutes < 0:
        bad("checkpoint_every_minutes", minutes, "minutes, 0 (off) or more")
    if not _is_int(steps) or steps < 0:
        bad("checkpoint_every_steps", steps, "steps, 0 (off) or more")
    for field in ("venv", "workdir", "checkpoint_dir"):
        value = job.get(field)
        if not isinstance(value, str) or not value.startswith("/") or "\n" in value:
            bad(field, value, "an absolute path")
    env = job.get("environment")
    if not isinstance(env, Mapping):
        bad("environment", env, "a dict of variable names to values")
    else:
        for key, value in env.items():
            if not isinstance(key, str) or not ENV_NAME.fullmatch(key):
                bad(f"environment.{key}", key, "a variable name (^[A-Za-z_][A-Za-z0-9_]*$)")
            elif isinstance(value, Mapping | list):
                bad(f"environment.{key}", value, "a string or number")
    user = job.get("user")
    if not isinstance(user, str) or not USER_NAME.fullmatch(user):
        bad("user", user, "a system user name")
    elif user == "root":
        bad("user", user, "an unprivileged user", "jobs never run as root; budgetgpu_user is the default")
    for field, choices in (("backend", BACKENDS), ("state", STATES)):
        if job.get(field) not in choices:
            bad(field, job.get(field), f"one of {', '.join(choices)}")
    for field in ("enabled", "allow_mixed_gpus"):
        if not isinstance(job.get(field), bool):
            bad(field, job.get(field), "true or false")
    ranks = job.get("node_ranks")
    if not isinstance(ranks, Mapping):
        bad("node_ranks", ranks, "a dict of host: rank")
    else:
        for host in sorted(set(ranks) - set(hosts)):
            out.append(
                _problem(
                    host, label, "node_ranks", f"rank for {host}", f"hosts of group {group} only: {', '.join(hosts)}"
                )
            )
    return out


# --- one job across its nodes -------------------------------------------------------------


def _expected_value(values: Mapping[str, Any], master: str | None) -> Any:
    """Return the value the others should match: the master's, else the most common one."""
    if master in values:
        return values[master]
    return Counter(values.values()).most_common(1)[0][0]


def _check_same(
    job: Mapping[str, Any], values: Mapping[str, Any], field: str, hint: str, master: str | None
) -> list[dict[str, Any]]:
    if len(set(values.values())) <= 1:
        return []
    expected = _expected_value(values, master)
    return [
        _problem(
            host,
            job["name"],
            field,
            value,
            f"{expected} (as on {', '.join(h for h, v in values.items() if v == expected)})",
            hint,
        )
        for host, value in values.items()
        if value != expected
    ]


def _driver_major(version: Any) -> str | None:
    return str(version).split(".")[0] if version else None


def _check_job_nodes(
    job: Mapping[str, Any], groups: Mapping[str, list[str]], nodes: Mapping[str, Any], options: Mapping[str, Any]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    problems: list[dict[str, Any]] = []
    warnings: list[dict[str, Any]] = []
    name = job["name"]
    hosts = job_hosts(job, groups)
    master = job_master(job, groups)
    probed = [h for h in hosts if (nodes.get(h) or {}).get("probed")]
    for host in hosts:
        if host not in probed:
            (warnings if options.get("down_nodes_ok") else problems).append(
                _problem(
                    host,
                    name,
                    "budgetgpu_gpus",
                    "no probe facts",
                    "gpu_facts and pcie_facts results",
                    "the node was unreachable or its probe failed: see the probe's output above",
                )
            )
    # nproc_per_node on each node, against the node's GPUs.
    nproc_value = job.get("nproc_per_node")
    nproc_ok = nproc_value in ("gpu", "auto") or (_int_or_none(nproc_value) or 0) >= 1
    for host in probed:
        node = nodes[host]
        count = node.get("gpu_count") or 0
        nproc = job_nproc(job, node)
        if nproc_ok and nproc is not None and not 1 <= nproc <= count:
            hint = (
                "this node has no GPU the probes can see: check the driver (gpu_facts) and the PCI bus"
                if count == 0
                else "run at most one process per GPU"
            )
            problems.append(_problem(host, name, "nproc_per_node", nproc_value, f"1 to {count} (GPUs on {host})", hint))
        cpus = node.get("vcpus")
        if nproc and cpus and cpus / nproc < options["min_cpus_per_process"]:
            warnings.append(
                _problem(
                    host,
                    name,
                    "cpus per process",
                    f"{cpus} CPUs for {nproc} processes",
                    f"{options['min_cpus_per_process']} or more per process",
                    "a weak CPU starves the data loader (the guide gained 15% from a better one)",
                )
            )
    # Node ranks: unique, contiguous, the master first (static rendezvous).
    ranks = job_node_ranks(job, groups, nodes)
    by_rank: dict[int, list[str]] = {}
    for host, rank in ranks.items():
        number = _int_or_none(rank)
        if number is None:
            problems.append(_problem(host, name, "node_rank", rank, f"a number from 0 to {len(hosts) - 1}"))
        else:
            by_rank.setdefault(number, []).append(host)
    for rank, owners in sorted(by_rank.items()):
        if len(owners) > 1:
            for host in owners:
                others = ", ".join(o for o in owners if o != host)
                problems.append(
                    _problem(
                        host,
                        name,
                        "node_rank",
                        rank,
                        "a rank no other node of the job has",
                        f"{others} has rank {rank} too",
                    )
                )
    numbers = sorted(by_rank)
    if numbers and len(by_rank) == len(ranks) and numbers != list(range(len(hosts))):
        for host, rank in ranks.items():
            if _int_or_none(rank) not in range(len(hosts)):
                problems.append(
                    _problem(
                        host,
                        name,
                        "node_rank",
                        rank,
                        f"ranks 0 to {len(hosts) - 1}, each once",
                        "ranks must be contiguous",
                    )
                )
    if job.get("rendezvous") == "static" and master in ranks and _int_or_none(ranks[master]) not in (0, None):
        problems.append(
            _problem(
                master,
                name,
                "node_rank",
                ranks[master],
                "0 on the master",
                "static rendezvous: the master is node rank 0",
            )
        )
    # The script, on every node.
    path = job_script_path(job)
    if path and path not in options["provided_scripts"]:
        for host in probed:
            if nodes[host].get("scripts_found", {}).get(path) is False:
                problems.append(
                    _problem(
                        host,
                        name,
                        "script",
                        f"{path} (missing)",
                        "an existing file on the node",
                        "copy the script to every node",
                    )
                )
    # One GPU model (unless allowed), one driver major, one torch/CUDA/NCCL.
    if not job.get("allow_mixed_gpus"):
        for host in probed:
            models = sorted(set(nodes[host].get("gpu_models") or []))
            if len(models) > 1:
                problems.append(
                    _problem(
                        host,
                        name,
                        "gpu model",
                        " + ".join(models),
                        "one GPU model",
                        "faster GPUs wait for slower ones in DDP; set allow_mixed_gpus: true to accept it",
                    )
                )
        single = {h: nodes[h]["gpu_models"][0] for h in probed if len(set(nodes[h].get("gpu_models") or [])) == 1}
        problems += _check_same(
            job,
            single,
            "gpu model",
            "faster GPUs wait for slower ones in DDP; set allow_mixed_gpus: true to accept it",
            master,
        )
    majors = {
        h: _driver_major(nodes[h].get("driver_version")) for h in probed if nodes[h].get("driver_state") == "loaded"
    }
    problems += _check_same(
        job, majors, "driver major", "install one driver branch on every node (nvidia_driver)", master
    )
    for field in ("torch", "cuda", "nccl"):
        values = {
            h: str((nodes[h].get("python_env") or {}).get(field))
            for h in probed
            if isinstance(nodes[h].get("python_env"), Mapping)
        }
        problems += _check_same(job, values, field, "provision every node from one python_env (provision.yml)", master)
    digests = {h: nodes[h].get("jobs_digest") for h in hosts if (nodes.get(h) or {}).get("jobs_digest")}
    problems += _check_same(
        job, digests, "torchrun_jobs", "define torchrun_jobs once (group_vars/all), not per host", master
    )
    return problems, warnings


# --- across jobs and per node -------------------------------------------------------------


def _check_ports(jobs: list[Mapping[str, Any]], groups: Mapping[str, list[str]]) -> list[dict[str, Any]]:
    problems = []
    active = [j for j in jobs if j.get("state") != "absent" and _is_int(j.get("port"))]
    for i, job in enumerate(active):
        for other in active[:i]:
            shared = [h for h in job_hosts(job, groups) if h in job_hosts(other, groups)]
            if job["port"] == other["port"] and shared:
                problems.append(
                    _problem(
                        ",".join(shared),
                        job.get("name"),
                        "port",
                        job["port"],
                        f"a port other than {other['port']}, which job {other.get('name')} uses on these nodes",
                        "give every job its own port",
                    )
                )
    names = Counter(str(j.get("name")) for j in jobs)
    for name, count in names.items():
        if count > 1:
            problems.append(_problem("all", name, "name", f"{name} ({count} jobs)", "a name used by one job only"))
    return problems


def _fmt_link(gen: Any, width: Any) -> str:
    return f"gen{gen if gen is not None else '?'} x{width if width is not None else '?'}"


def _check_pcie(host: str, node: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Problems where a GPU misses the inventory's expectation; warnings where a link trained low."""
    pcie = node.get("pcie") or {}
    min_width = _int_or_none(node.get("pcie_min_width"))
    expected = {normalize_bus_id(str(k)): v for k, v in (node.get("pcie_expected") or {}).items()}
    problems: list[dict[str, Any]] = []
    warnings: list[dict[str, Any]] = []
    gpus = {g.get("bus_id"): g for g in pcie.get("gpus") or []}
    for bus_id in sorted(set(expected) - set(gpus)):
        problems.append(
            _problem(host, None, f"pcie {bus_id}", "not on the PCI bus", "a GPU", "check the card, its power and riser")
        )
    for bus_id, gpu in sorted(gpus.items()):
        eff = gpu.get("effective") or {}
        capable = gpu.get("capable") or {}
        want = expected.get(bus_id) or {}
        floors = [w for w in (min_width, _int_or_none(want.get("width"))) if w]
        where = f" (limiting hop {gpu.get('limiting_hop')})" if gpu.get("limiting_hop") not in (None, bus_id) else ""
        if floors and (eff.get("width") is None or eff["width"] < max(floors)):
            problems.append(
                _problem(
                    host,
                    None,
                    f"pcie {bus_id} width",
                    _fmt_link(eff.get("gen"), eff.get("width")) + where,
                    f"x{max(floors)} or wider",
                    "reseat the card or riser, check the riser cable",
                )
            )
        gen = _int_or_none(want.get("gen"))
        # GPUs drop their link's generation at idle: compare with what the path can reach.
        if gen is not None and (capable.get("gen") is None or capable["gen"] < gen):
            problems.append(
                _problem(
                    host,
                    None,
                    f"pcie {bus_id} gen",
                    f"gen{capable.get('gen')} at best" + where,
                    f"gen{gen}",
                    "check the riser (many hold gen3 at most) and the slot speed in the BIOS",
                )
            )
        if gpu.get("downgraded"):
            warnings.append(
                _problem(
                    host,
                    None,
                    f"pcie {bus_id} link",
                    _fmt_link(eff.get("gen"), eff.get("width")) + where,
                    _fmt_link(capable.get("gen"), capable.get("width")) + " (what both ends support)",
                    "; ".join(gpu.get("downgrade_reasons") or []),
                )
            )
    return problems, warnings


def _line(level: str, item: Mapping[str, Any]) -> str:
    job = f"job {item['job']} " if item.get("job") else ""
    hint = f": {item['hint']}" if item.get("hint") else ""
    return f"{level} {item['host']}: {job}{item['field']}: found {item['found']!r}, expected {item['expected']}{hint}"


def cluster_check(
    nodes: Mapping[str, Mapping[str, Any]],
    jobs: list[Mapping[str, Any]],
    groups: Mapping[str, list[str]],
    options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Return {problems, warnings, report} for the whole cluster (see the module docstring)."""
    opts = dict(DEFAULT_OPTIONS)
    opts.update({k: v for k, v in (options or {}).items() if v is not None})
    problems: list[dict[str, Any]] = []
    warnings: list[dict[str, Any]] = []
    for job in jobs:
        job_problems = _check_job_fields(job, groups)
        problems += job_problems
        if job.get("state") == "absent" or not job_hosts(job, groups):
            continue
        node_problems, node_warnings = _check_job_nodes(job, groups, nodes, opts)
        problems += node_problems
        warnings += node_warnings
        minutes, steps = job.get("checkpoint_every_minutes"), job.get("checkpoint_every_steps")
        if minutes == 0 and steps == 0:
            warnings.append(
                _problem(
                    _where(job_hosts(job, groups)),
                    job.get("name"),
                    "checkpoint interval",
                    "0 minutes and 0 steps",
                    "a checkpoint every N minutes or steps",
                    "a crash then loses the whole run",
                )
            )
        if job.get("rendezvous") == "static" and isinstance(job.get("max_restarts"), int) and job["max_restarts"] > 0:
            # torch's static rendezvous hands the workers of every restart round the same store,
            # and restarted workers read their peers' old addresses (gloo: Connection refused).
            warnings.append(
                _problem(
                    _where(job_hosts(job, groups)),
                    job.get("name"),
                    "max_restarts",
                    f"{job['max_restarts']} with rendezvous static",
                    "0 with rendezvous static",
                    "torch's static rendezvous keeps one store across in-place restarts, which then fail; "
                    "with 0 systemd restarts the units fresh, or use rendezvous c10d (in-place restarts work)",
                )
            )
    problems += _check_ports(jobs, groups)
    for host in sorted(nodes):
        pcie_problems, pcie_warnings = _check_pcie(host, nodes[host])
        problems += pcie_problems
        warnings += pcie_warnings
    report = [
        f"budgetgpu preflight: {len(nodes)} nodes, {len(jobs)} jobs: {len(problems)} problems, {len(warnings)} warnings"
    ]
    for host in sorted(nodes):
        node = nodes[host]
        if node.get("probed"):
            models = (
                ", ".join(f"{n}x {m}" for m, n in sorted(Counter(node.get("gpu_models") or []).items())) or "no GPU"
            )
            driver = node.get("driver_version") or node.get("driver_state") or "unknown"
            cpus = node.get("vcpus") or "?"
            report.append(f"  node {host}: {node.get('gpu_count')} GPUs ({models}), driver {driver}, {cpus} CPUs")
        else:
            report.append(f"  node {host}: not probed")
    report += [_line("FAIL", p) for p in problems] + [_line("WARN", w) for w in warnings]
    return {"problems": problems, "warnings": warnings, "report": report}


class FilterModule:
    """Preflight filters."""

    def filters(self) -> dict[str, Any]:
        return {
            "cluster_check": cluster_check,
            "preflight_script_paths": preflight_script_paths,
            "job_script_path": job_script_path,
        }
