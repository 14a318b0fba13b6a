"""The placement checks preflight runs (inference_check): every service's placement, memory, engine
and quantisation on the GPUs it gets, its ports against the other services' and the training jobs',
the gateways' keys and allow lists, and what engines vllm and llamacpp need (venvs, wheels, the
llama-server binary); what each GPU holds (inference_memory_split)."""

from __future__ import annotations

import json
import posixpath
import shlex
from collections.abc import Mapping
from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.gateway import gateway_problems
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.memory import (
    _gib,
    inference_memory_need,
    llamacpp_gpu_needs,
)
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.placement import (
    _gpu_label,
    _per_worker,
    _placement,
    head_rpc_ports,
    inference_gateway_host,
    service_hosts,
    spanning_problems,
    spans_llamacpp,
    worker_layouts,
    worker_node_groups,
)
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.services import (
    GPUS_PER_WORKER,
    MODEL_SHAPE_KEYS,
    QUANT_BYTES,
    QUANT_MIN_CAPABILITY,
    VLLM_MIN_CAPABILITY,
    _is_int,
)
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.nodes import (
    fact,
    host_var,
    in_group,
    node_gpus,
    simulated,
)
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.wheelhouse import wheelhouse_folder, wheels_for


def _capability(value: Any) -> tuple[int, ...] | None:
    try:
        return tuple(int(part) for part in str(value).split(".")[:2])
    except ValueError:
        return None


def _gpu_problems(
    service: Mapping[str, Any], hostvars: Mapping[str, Any], host: str, gpu: Mapping[str, Any], need: Any
) -> list[str]:
    """Memory, engine and quantisation of one GPU that serves the service."""
    name, quant, problems = service.get("name"), service.get("quantization"), []
    label = f"{_gpu_label(host, gpu)}: service {name}"
    memory = gpu.get("memory_total_mib")
    usable, share = _usable_memory(service, memory)
    if isinstance(need, Mapping) and _is_int(memory) and need["per_gpu_bytes"] > usable:
        hint = need.get("hint", "" if need["gpus"] >= max(GPUS_PER_WORKER) else " (or more gpus_per_worker)")
        problems.append(f"{label}: memory: needs {need['text']}; expected at most {_gib(usable)}{share}{hint}")
    if service.get("engine") == "vllm":
        return problems + _vllm_gpu_problems(hostvars, host, gpu, label)
    if quant not in QUANT_BYTES:
        return problems
    if simulated(hostvars, host):
        problems.append(
            f"{label}: quantization: found {quant} on a simulated node (no CUDA), expected none: bitsandbytes "
            f"8bit/4bit runs only on a real CUDA GPU of compute capability 7.5 or more (the real-GPU path)"
        )
        return problems
    capability = _capability(gpu.get("compute_capability"))
    if capability is not None and capability < QUANT_MIN_CAPABILITY:
        problems.append(
            f"{label}: quantization: found {quant} on compute capability {gpu.get('compute_capability')}, "
            f"expected compute capability 7.5 or more (bitsandbytes), or quantization none"
        )
    return problems


def _usable_memory(service: Mapping[str, Any], memory_mib: Any) -> tuple[float, str]:
    """Return (the bytes of one GPU a worker may fill, how that was reached): all of it, or for vLLM
    its gpu_memory_utilization share (it reserves that much up front and never more)."""
    if not _is_int(memory_mib):
        return 0, ""
    total = memory_mib * 2**20
    share = (service.get("vllm") or {}).get("gpu_memory_utilization") if service.get("engine") == "vllm" else None
    if isinstance(share, int | float) and not isinstance(share, bool) and 0 < share < 1:
        return total * share, f" (vllm.gpu_memory_utilization {share:g} of {_gib(total)})"
    return total, ""


def _vllm_gpu_problems(hostvars: Mapping[str, Any], host: str, gpu: Mapping[str, Any], label: str) -> list[str]:
    """vLLM runs on a real CUDA GPU of compute capability 7.0 or more only."""
    if simulated(hostvars, host):
        return [
            f"{label}: engine: found vllm on a simulated node (no CUDA), expected builtin: vLLM runs only on a real "
            "CUDA GPU (the built-in worker is the one that runs on simulated and CPU nodes)"
        ]
    capability = _capability(gpu.get("compute_capability"))
    if capability is not None and capability < VLLM_MIN_CAPABILITY:
        return [
            f"{label}: engine: found vllm on compute capability {gpu.get('compute_capability')}, expected compute "
            "capability 7.0 or more (vLLM's CUDA kernels), or engine builtin"
        ]
    return []


def _memory_need(service: Mapping[str, Any], model_configs: Mapping[str, Any]) -> tuple[Any, list[str]]:
    """Return (the memory need or None, the model's problems) for the service's model_configs entry."""
    name = service.get("name")
    if name not in (model_configs or {}):
        return None, []
    config = model_configs[name]
    if service.get("engine") == "llamacpp":
        return _gguf_need(service, config)
    where = f"control node: service {name}: model"
    if config in (None, ""):
        return None, [
            f"{where}: found no {service.get('model')}/config.json on the control node, "
            f"expected a Hugging Face model directory (config.json, weights, tokenizer)"
        ]
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError as error:
            return None, [f"{where}: found {service.get('model')}/config.json that is not JSON ({error})"]
    try:
        return inference_memory_need(service, config), []
    except ValueError as error:
        return None, [f"{where}: {service.get('model')}/{error}"]


def _gguf_need(service: Mapping[str, Any], found: Any) -> tuple[Any, list[str]]:
    """engine llamacpp: ({bytes, shape} of the GGUF model or None, the model's problems) from what the control
    node found of it: preflight's stat of it ({exists, isreg, size}) with what its header says (gguf_header's
    keys; absent: not read). The shape, {layers, kv_heads, head_dim}, is the header's; the service's
    model_shape gives what the header lacks, and one that differs from the header is refused. A worker over
    several nodes is split by layer, so it is refused without a shape."""
    name, path = service.get("name"), service.get("model")
    size = found.get("size") if isinstance(found, Mapping) and found.get("isreg") else None
    if not _is_int(size) or size <= 0:
        return None, [
            f"control node: service {name}: model: found no GGUF file {path} on the control node, "
            "expected a GGUF model file (scripts in llama.cpp convert Hugging Face models to GGUF)"
        ]
    if found.get("error"):
        return None, [f"control node: service {name}: model: {path}: {found['error']}"]
    given = service.get("model_shape") if isinstance(service.get("model_shape"), Mapping) else {}
    problems = [
        f"control node: service {name}: model_shape.{key}: found {given[key]}, expected {found[key]}, what the "
        f"GGUF header of {path} says ({found['keys'][key]}): leave model_shape out, or make it the header's"
        for key in MODEL_SHAPE_KEYS
        if key in given and key in found and given[key] != found[key]
    ]
    shape = {key: given.get(key, found.get(key)) for key in MODEL_SHAPE_KEYS}
    shape = shape if all(_is_int(value) and value > 0 for value in shape.values()) else None
    per_node = service.get("nodes_per_worker")
    if shape is None and _is_int(per_node) and per_node > 1:
        lacks = ", ".join(key for key in MODEL_SHAPE_KEYS if key not in found)
        problems.append(
            f"control node: service {name}: model_shape: found none with nodes_per_worker {per_node}, and no {lacks} "
            f"in the GGUF header of {path}, expected {{layers, kv_heads, head_dim}} of the GGUF's model: llama.cpp "
            "splits a worker over its nodes by layer, with each layer's KV cache"
        )
    return {"bytes": size, "shape": shape}, problems


def _gpu_needs(
    service: Mapping[str, Any],
    hostvars: Mapping[str, Any],
    hosts: list[str],
    jobs: list[Mapping[str, Any]] | None,
    need: Any,
) -> dict[tuple[str, Any], Any]:
    """Return {(node, GPU index): what that GPU holds of the service}: the same need on every GPU, or for
    engine llamacpp (need: the GGUF's size and shape, _gguf_need) each GPU's layers and KV cache
    (llamacpp_gpu_needs) in every worker, over one node or nodes_per_worker nodes."""
    if need is None:
        return {}
    if service.get("engine") != "llamacpp":
        return {
            (host, gpu.get("index")): need
            for host in service_hosts(service, hostvars, hosts)
            for gpu in _placement(service, hostvars, host, jobs)[0]
        }
    return {
        (host, gpu.get("index")): gpu_need
        for group in worker_node_groups(service, hostvars, hosts)
        for slot, layout in enumerate(worker_layouts(service, hostvars, group, jobs))
        for host, gpu, gpu_need in llamacpp_gpu_needs(service, need["bytes"], layout, slot, need["shape"])
    }


def _service_problems(
    service: Mapping[str, Any],
    hostvars: Mapping[str, Any],
    hosts: list[str],
    jobs: list[Mapping[str, Any]] | None,
    model_configs: Mapping[str, Any],
    unprobed_ok: bool = False,
) -> tuple[list[str], dict[tuple[str, int], list[str]], list[str]]:
    """Return (problems, {(host, GPU index): [service]}, what each GPU holds) of one service on all of its
    nodes."""
    name, problems, claims, split = service.get("name"), [], {}, []
    nodes = service_hosts(service, hostvars, hosts)
    if not nodes:
        problems.append(f"all: service {name}: nodes: found {service.get('nodes')!r} with no host, expected hosts")
    for host in [h for h in nodes if h not in hosts]:
        problems.append(f"{host}: service {name}: nodes: found {host}, expected a host of the inventory")
    gpus = service.get("gpus")
    for host in sorted(set(gpus) - set(nodes)) if isinstance(gpus, Mapping) else []:
        problems.append(f"{host}: service {name}: gpus: found an entry for {host}, expected nodes of the service")
    gateway = inference_gateway_host(service, hostvars, hosts)
    if gateway is not None and gateway not in hosts:
        problems.append(f"{gateway}: service {name}: gateway.host: found {gateway}, expected a host of the inventory")
    need, model_problems = _memory_need(service, model_configs)
    problems += model_problems + spanning_problems(service, hostvars, hosts, jobs, unprobed_ok)
    needs = _gpu_needs(service, hostvars, hosts, jobs, need)
    for host in (h for h in nodes if h in hosts):
        chosen, placement_problems = _placement(service, hostvars, host, jobs)
        if not (unprobed_ok and node_gpus(hostvars, host) is None):
            problems += placement_problems
        for gpu in chosen:
            claims.setdefault((host, gpu.get("index")), []).append(str(name))
            gpu_need = needs.get((host, gpu.get("index")))
            problems += _gpu_problems(service, hostvars, host, gpu, gpu_need)
            if gpu_need is not None:
                usable, share = _usable_memory(service, gpu.get("memory_total_mib"))
                split.append(f"{_gpu_label(host, gpu)}: service {name}: {gpu_need['text']} of {_gib(usable)}{share}")
    return problems, claims, split


def _port_owners(
    services: list[Mapping[str, Any]],
    hostvars: Mapping[str, Any],
    hosts: list[str],
    jobs: list[Mapping[str, Any]] | None,
) -> dict[str, list[tuple[int, int, str]]]:
    """Return {host: [(first port, last port, owner)]}: each service's worker range, on the head of a
    llama.cpp worker over nodes its own RPC servers' (head_rpc_ports, whatever its build), each gateway
    port, each training job's port (rendezvous) on the nodes of that job."""
    owners: dict[str, list[tuple[int, int, str]]] = {}
    for service in services:
        name = service.get("name")
        heads = [group[0] for group in worker_node_groups(service, hostvars, hosts)] if spans_llamacpp(service) else []
        for host in (h for h in service_hosts(service, hostvars, hosts) if h in hosts):
            count = len(_placement(service, hostvars, host, jobs)[0])
            if count:
                port = service["port"]
                owners.setdefault(host, []).append((port, port + count - 1, f"service {name} workers"))
            own = head_rpc_ports(service, count) if host in heads else []
            if own:
                owners[host].append((own[0], own[-1], f"service {name} RPC servers of its head (port + GPUs + slot)"))
        gateway = inference_gateway_host(service, hostvars, hosts)
        if gateway in hosts:
            port = service["gateway"]["port"]
            owners.setdefault(gateway, []).append((port, port, f"service {name} gateway"))
    for job in jobs or []:
        if job.get("state") == "absent" or not _is_int(job.get("port")):
            continue
        for host in (h for h in hosts if in_group(hostvars, h, str(job.get("nodes")))):
            owners.setdefault(host, []).append((job["port"], job["port"], f"training job {job.get('name')}"))
    return owners


def _port_problems(owners: Mapping[str, list[tuple[int, int, str]]]) -> list[str]:
    problems = []
    for host in sorted(owners):
        ranges = owners[host]
        for i, (first, last, owner) in enumerate(ranges):
            for other_first, other_last, other in ranges[:i]:
                if first <= other_last and other_first <= last and "training job" not in owner:
                    problems.append(_port_clash(host, (first, last, owner), (other_first, other_last, other)))
                elif first <= other_last and other_first <= last:
                    problems.append(_port_clash(host, (other_first, other_last, other), (first, last, owner)))
    return problems


def _port_clash(host: str, mine: tuple[int, int, str], theirs: tuple[int, int, str]) -> str:
    def span(first: int, last: int) -> str:
        return str(first) if first == last else f"{first}-{last}"

    field = "gateway.port" if mine[2].endswith("gateway") else "port"
    return (
        f"{host}: {mine[2]}: {field}: found {span(*mine[:2])}, expected ports apart from "
        f"{span(*theirs[:2])} ({theirs[2]} on {host}); a service's workers use port .. port + GPUs - 1"
    )


def inference_extra_requirements(services: list[Mapping[str, Any]]) -> list[str]:
    """Return the requirement files (roles/inference/files) that the built-in worker needs beyond
    requirements.txt for the services of one node that are not absent: requirements-split.txt (accelerate)
    where a worker spans GPUs or loads in 8 or 4 bits, requirements-quant.txt (bitsandbytes) where it loads
    in 8 or 4 bits. Other engines bring their own packages."""
    builtin = [s for s in services or [] if s.get("engine") == "builtin" and s.get("state") != "absent"]
    quantized = any(s.get("quantization") in ("8bit", "4bit") for s in builtin)
    split = quantized or any(_per_worker(s) > 1 for s in builtin)
    wanted = {"requirements-split.txt": split, "requirements-quant.txt": quantized}
    return [name for name, asked in wanted.items() if asked]


def _vllm_services(services: list[Mapping[str, Any]]) -> list[tuple[str, Mapping[str, Any]]]:
    """Return (vllm.venv without its trailing slash, service) of the services of engine vllm not absent."""
    return [
        (str(s["vllm"]["venv"]).rstrip("/"), s)
        for s in services or []
        if s.get("engine") == "vllm" and s.get("state") != "absent"
    ]


def inference_vllm_venvs(services: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Return the vLLM venvs that the normalised services of one node need: [{venv, package, services}],
    one per vllm.venv, for the services of engine vllm that are not absent. A venv that two services ask
    to hold different packages is refused (vllm_venv_problems names it in preflight first)."""
    problems = vllm_venv_problems(services)
    if problems:
        raise ValueError(problems[0])
    venvs: dict[str, dict[str, Any]] = {}
    for path, service in _vllm_services(services):
        entry = venvs.setdefault(path, {"venv": path, "package": service["vllm"]["package"], "services": []})
        entry["services"].append(service.get("name"))
    return list(venvs.values())


def vllm_venv_problems(services: list[Mapping[str, Any]]) -> list[str]:
    """One vLLM venv holds one vLLM: services that name the same vllm.venv must ask for the same package."""
    first: dict[str, tuple[str, str]] = {}
    problems = []
    for path, service in _vllm_services(services):
        package, name = service["vllm"]["package"], service.get("name")
        other, wanted = first.setdefault(path, (name, package))
        if package != wanted:
            problems.append(
                f"service {name}: vllm.package: found {package}, expected {wanted} as service {other} "
                f"asks for vllm.venv {path} (one venv holds one vLLM: give the service a vllm.venv of its own)"
            )
    return problems


def inference_vllm_wheelhouses(
    services: list[Mapping[str, Any]], hostvars: Mapping[str, Any], hosts: list[str], playbook_dir: str
) -> dict[str, str]:
    """Return host -> its wheelhouse's path on the control node, for the nodes of the services of engine vllm
    (not absent) whose python_env_wheelhouse is set: role inference installs vllm.package there from the
    wheelhouse alone (pip --no-index). Preflight lists those folders for vllm_wheelhouse_problems."""
    folders = {}
    for _venv, service in _vllm_services(services):
        for host in service_hosts(service, hostvars, hosts):
            value = host_var(hostvars, host, "python_env_wheelhouse")
            if isinstance(value, str) and value:
                folders[host] = wheelhouse_folder(value, playbook_dir)
    return folders


def vllm_wheelhouse_problems(
    services: list[Mapping[str, Any]],
    hostvars: Mapping[str, Any],
    hosts: list[str],
    wheelhouses: Mapping[str, str] | None,
    wheels: list[str] | None,
) -> list[str]:
    """engine vllm on a node with a wheelhouse: the wheelhouse must hold a wheel of vllm.package, or the
    install fails on the node after other nodes were changed. wheelhouses: inference_vllm_wheelhouses';
    wheels: the paths of the *.whl files in those folders on the control node; None: not looked at. One
    problem per service, package, folder and node Python, naming the nodes and the command that fills it."""
    if wheelhouses is None:
        return []
    names: dict[str, list[str]] = {}
    for path in wheels or []:
        folder, name = posixpath.split(str(path))
        names.setdefault(folder, []).append(name)
    missing: dict[tuple[str, str, str, str], list[str]] = {}
    for _venv, service in _vllm_services(services):
        package = service["vllm"]["package"]
        for host in service_hosts(service, hostvars, hosts):
            folder = wheelhouses.get(host)
            if folder and not wheels_for(package, names.get(folder, [])):
                key = (str(service.get("name")), package, folder, _node_python(hostvars, host))
                missing.setdefault(key, []).append(host)
    return [
        f"{', '.join(nodes)}: service {name}: vllm.package: found no wheel for {package} in python_env_wheelhouse "
        f"{folder} on the control node, expected one (role inference installs vLLM from the node's wheelhouse "
        f"alone): run scripts/fill-wheelhouse --vllm '{package}'{f' --python-version {python}' if python else ''} "
        f'{shlex.quote(folder)}, or set python_env_wheelhouse to "" for these nodes'
        for (name, package, folder, python), nodes in missing.items()
    ]


def _node_python(hostvars: Mapping[str, Any], host: str) -> str:
    """The node's Python as X.Y (preflight gathers it; the vLLM venv is made from it), or "" unknown."""
    version = fact(hostvars, host, "python")
    version = version.get("version") if isinstance(version, Mapping) else None
    if isinstance(version, Mapping) and _is_int(version.get("major")) and _is_int(version.get("minor")):
        return f"{version['major']}.{version['minor']}"
    return ""


def llama_server_problems(
    services: list[Mapping[str, Any]],
    llama_server: Mapping[str, Any] | None,
    rpc_server: Mapping[str, Any] | None = None,
) -> list[str]:
    """engine llamacpp: the role copies llama-server from the control node (inference_llamacpp_server), and
    where a worker spans nodes ggml-rpc-server too (inference_llamacpp_rpc_server). llama_server,
    rpc_server: {path} and preflight's stat of it there ({exists, isreg, executable}); None: not looked at."""
    active = [s for s in services or [] if s.get("engine") == "llamacpp" and s.get("state") != "absent"]
    spanning = [s for s in active if _is_int(s.get("nodes_per_worker")) and s["nodes_per_worker"] > 1]
    return _binary_problems(
        ("inference_llamacpp_server", "llama-server", "of engine llamacpp"), llama_server, active
    ) + _binary_problems(
        ("inference_llamacpp_rpc_server", "RPC server ggml-rpc-server", "whose workers span nodes (nodes_per_worker)"),
        rpc_server,
        spanning,
    )


def _binary_problems(
    what_for: tuple[str, str, str], found: Mapping[str, Any] | None, services: list[Mapping[str, Any]]
) -> list[str]:
    """A llama.cpp binary the services need from the control node, an absolute path to an executable file.
    what_for: (the variable naming it, the binary, which services need it)."""
    if not services or found is None:
        return []
    path = str(found.get("path") or "")
    if not path:
        what = "none"
    elif not path.startswith("/"):
        what = f"{path!r}, a relative path"
    elif not (found.get("isreg") and found.get("executable")):
        what = f"{path}, which is not an executable file there"
    else:
        return []
    variable, binary, needs = what_for
    names = ", ".join(str(s.get("name")) for s in services)
    return [
        f"control node: {variable}: found {what}, expected the absolute path of llama.cpp's {binary} on the control "
        f"node for service {names} {needs} (scripts/build-llama-server builds it and prints its path)"
    ]


def inference_binary_problems(found: list[Mapping[str, Any]], wanted: list[Mapping[str, Any]]) -> list[str]:
    """Return each llama.cpp binary on a node that is not the control node's build: ``found``, the results
    of a looped stat with item [node, path on the node] (checksum: its SHA-256); ``wanted``, those of the
    control node's files with item {src, dest}. llama.cpp's RPC breaks between builds that differ, so a
    node, its path and both digests are named before any worker or RPC server starts."""
    expected = {
        str(result["item"]["dest"]): (str(result["item"]["src"]), (result.get("stat") or {}).get("checksum"))
        for result in wanted
        if isinstance(result.get("item"), Mapping)
    }
    problems = []
    for result in found:
        host, path = result["item"]
        src, digest = expected.get(str(path), (None, None))
        if digest is None:
            continue
        stat = result.get("stat") or {}
        if stat.get("checksum") != digest:
            what = f"sha256 {stat['checksum']}" if stat.get("exists") else "no such file"
            problems.append(
                f"{host}: {path}: found {what}, expected sha256 {digest}, the control node's {src} (llama.cpp's RPC "
                "needs one build on every node of a worker: run playbooks/inference.yml on all of them)"
            )
    return problems


def inference_check(
    services: list[Mapping[str, Any]],
    hostvars: Mapping[str, Any],
    hosts: list[str],
    jobs: list[Mapping[str, Any]] | None = None,
    model_configs: Mapping[str, Any] | None = None,
    unprobed_ok: bool = False,
    api_keys: Any = None,
    gateway_allow: list[str] | None = None,
    cluster_subnet: str | None = None,
    llama_server: Mapping[str, Any] | None = None,
    vllm_wheelhouses: Mapping[str, str] | None = None,
    wheels: list[str] | None = None,
    rpc_server: Mapping[str, Any] | None = None,
) -> list[str]:
    """Return the placement problems of the normalised services (inference_services_normalize), each
    naming host, GPU, field, what was found and what was expected: memory that does not fit, a GPU
    that a training job or another service uses, port clashes, a missing model directory or
    config.json, a quantisation the GPU cannot run, no GPU left, hosts not in the inventory.

    hosts: the inventory's hosts (groups.all); jobs: budgetgpu_jobs; model_configs: service name ->
    its parsed config.json (or its text), None where the control node has none; a service not in
    model_configs is not checked for memory.
    unprobed_ok: a node without GPU facts is left out instead of refused (safe mode: the nightly
    run goes on when a node is down; role preflight passes budgetgpu_safe_mode).
    api_keys, gateway_allow, cluster_subnet: inference_api_keys, inference_gateway_allow and
    budgetgpu_cluster_subnet, for gateway_problems (an empty allow list, no key, a bad key).
    llama_server: {path, exists, isreg, executable} of inference_llamacpp_server on the control node;
    rpc_server: the same of inference_llamacpp_rpc_server, needed where a llama.cpp worker spans nodes.
    vllm_wheelhouses, wheels: the vLLM nodes' wheelhouses and the wheels in them (vllm_wheelhouse_problems).
    """
    active = [s for s in services or [] if s.get("state") != "absent"]
    problems, claims = [], {}
    for service in active:
        service_problems, service_claims, _split = _service_problems(
            service, hostvars, hosts, jobs, model_configs or {}, unprobed_ok
        )
        problems += service_problems
        for key, names in service_claims.items():
            claims.setdefault(key, []).extend(names)
    for (host, index), names in sorted(claims.items(), key=lambda item: (item[0][0], str(item[0][1]))):
        if len(names) > 1:
            gpu = next((g for g in node_gpus(hostvars, host) or [] if g.get("index") == index), {"index": index})
            problems.append(
                f"{_gpu_label(host, gpu)}: service {names[1]}: gpus: found GPU {index}, which service {names[0]} "
                f"uses too, expected one service per GPU (give each service its own gpus list)"
            )
    problems += _port_problems(_port_owners(active, hostvars, hosts, jobs))
    problems += vllm_venv_problems(active)
    problems += llama_server_problems(active, llama_server, rpc_server)
    problems += vllm_wheelhouse_problems(active, hostvars, hosts, vllm_wheelhouses, wheels)
    problems += gateway_problems(active, api_keys, gateway_allow, cluster_subnet)
    return problems


def inference_memory_split(
    services: list[Mapping[str, Any]],
    hostvars: Mapping[str, Any],
    hosts: list[str],
    jobs: list[Mapping[str, Any]] | None = None,
    model_configs: Mapping[str, Any] | None = None,
) -> list[str]:
    """Return what each GPU of each service not absent holds, one line a GPU with the arithmetic that
    inference_check holds against its memory (the same inputs): for engine llamacpp the layers and their
    KV cache of the GPU's worker, over one node or several. A service not in model_configs has no lines."""
    return [
        line
        for service in services or []
        if service.get("state") != "absent"
        for line in _service_problems(service, hostvars, hosts, jobs, model_configs or {}, True)[2]
    ]
