"""The argv of one worker's unit, for each engine: builtin (the collection's worker), command (the
service's own command line), vllm (``vllm serve``) and llamacpp (llama-server)."""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.module_utils.netinfo import endpoint
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.memory import inference_context_tokens
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.placement import _per_worker
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.services import (
    SERVICE_DEFAULTS,
    _bad_engine,
    _bad_llamacpp,
    _bad_vllm,
    llamacpp_context,
)


def inference_worker_command(
    service: Mapping[str, Any],
    worker: Mapping[str, Any],
    python: str | None = None,
    worker_script: str | None = None,
    llama_server: str | None = None,
) -> list[str]:
    """Return the argv of a worker's ExecStart. builtin: <python> <worker_script> --config
    <config_file> --port P --host A --worker-id <host>-<slot> (python: <venv>/bin/python3).
    command: the service's command with its placeholders filled, each value shell-quoted, split
    like a shell would (shlex). vllm: inference_vllm_command. llamacpp: inference_llamacpp_command
    (llama_server: the binary's path on the node)."""
    if service.get("engine") == "vllm":
        return inference_vllm_command(service, worker)
    if service.get("engine") == "llamacpp":
        return inference_llamacpp_command(service, worker, llama_server)
    if service.get("engine") == "command":
        uuids = [str(uuid) for uuid in worker.get("gpu_uuids") or [worker.get("gpu_uuid")]]
        values = {
            "model": service.get("model_dir"),
            "port": worker.get("port"),
            "host": worker.get("address"),
            "name": service.get("name"),
            "max_input_tokens": service.get("max_input_tokens"),
            "max_new_tokens": service.get("max_new_tokens"),
            "dtype": service.get("dtype"),
            "gpu_uuid": worker.get("gpu_uuid"),
            "gpu_uuids": ",".join(uuids),
            "gpus": len(uuids),
            "slot": worker.get("slot"),
        }
        problems = _bad_engine(service)
        if problems:
            raise ValueError(f"service {service.get('name')}: {problems[0]}")
        return shlex.split(str(service["command"]).format(**{k: shlex.quote(str(v)) for k, v in values.items()}))
    if not worker_script:
        raise ValueError(f"service {service.get('name')}: worker_script: found none, expected the worker's path")
    python = python or f"{str(service.get('venv') or SERVICE_DEFAULTS['venv']).rstrip('/')}/bin/python3"
    return [
        str(python),
        str(worker_script),
        "--config",
        str(service.get("config_file")),
        "--port",
        str(worker.get("port")),
        "--host",
        str(worker.get("address")),
        "--worker-id",
        f"{worker.get('host')}-{worker.get('slot')}",
    ]


def _flags(options: Mapping[str, Any]) -> list[str]:
    """Return {flag: value} as argv, flag then value, in the mapping's order."""
    return [part for flag, value in options.items() for part in (flag, str(value))]


def _raise_first(service: Mapping[str, Any], problems: list[str]) -> None:
    """Refuse to render a service that preflight would have refused, with its first problem."""
    if problems:
        raise ValueError(f"service {service.get('name')}: {problems[0]}")


def inference_vllm_command(service: Mapping[str, Any], worker: Mapping[str, Any]) -> list[str]:
    """Return engine vllm's argv: <vllm.venv>/bin/vllm serve <model_dir>, listening on the worker's
    address and port, serving the service's name, tensor-parallel over its gpus_per_worker GPUs, with
    the dtype, the context (inference_context_tokens), concurrency as --max-num-seqs (the gateway sends
    a worker concurrency + queue requests), the memory share and vLLM's quantisation method. No API
    key: the gateway checks the clients' keys and the firewall admits only it (and Prometheus)."""
    _raise_first(service, _bad_vllm(service))
    vllm = service["vllm"]
    argv = [f"{str(vllm['venv']).rstrip('/')}/bin/vllm", "serve", str(service.get("model_dir"))]
    argv += _flags(
        {
            "--host": worker.get("address"),
            "--port": worker.get("port"),
            "--served-model-name": service.get("name"),
            "--tensor-parallel-size": _per_worker(service),
            "--dtype": service.get("dtype"),
            "--max-model-len": inference_context_tokens(service),
            "--max-num-seqs": service.get("concurrency"),
            "--gpu-memory-utilization": f"{vllm['gpu_memory_utilization']:g}",
        }
    )
    if vllm["quantization"] != "none":
        argv += ["--quantization", str(vllm["quantization"])]
    return argv


def llamacpp_model_path(service: Mapping[str, Any]) -> str:
    """Return the GGUF file's path on a node: the role copies the file into the service's model_dir."""
    return f"{str(service.get('model_dir')).rstrip('/')}/{str(service.get('model')).rstrip('/').rsplit('/', 1)[-1]}"


def inference_llamacpp_command(
    service: Mapping[str, Any], worker: Mapping[str, Any], llama_server: str | None = None
) -> list[str]:
    """Return engine llamacpp's argv: <llama_server> -m <the GGUF in model_dir>, listening on the
    worker's address and port, the service's name as its model (-a), concurrency slots (-np), each
    holding max_input_tokens + max_new_tokens (-c, llamacpp_context), max_new_tokens as the default
    completion length (-n), /metrics on, every layer on the GPU (-ngl all: a CPU build ignores it, with
    a warning), the layers split over the worker's GPUs by its tensor_split (placement's, the split
    preflight checks: each GPU's memory, or the service's tensor_split), a worker over several nodes
    --rpc to its RPC servers (address:port, in the worker's rpc_servers order: llama-server's device
    order), --embeddings for task embeddings, no web UI, no slot endpoints (--no-slots). No API key: the
    gateway checks the clients' keys and takes the header off, and the firewall admits only the
    gateway (and Prometheus)."""
    _raise_first(service, _bad_llamacpp(service))
    if not llama_server:
        raise ValueError(f"service {service.get('name')}: llama_server: found none, expected llama-server's path")
    argv = [str(llama_server)]
    argv += _flags(
        {
            "--model": llamacpp_model_path(service),
            "--alias": service.get("name"),
            "--host": worker.get("address"),
            "--port": worker.get("port"),
            "--parallel": service.get("concurrency"),
            "--ctx-size": llamacpp_context(service),
            "--n-predict": service.get("max_new_tokens"),
            "--n-gpu-layers": "all",
        }
    )
    # No slot endpoints (/slots: read, save, restore or erase another client's KV cache); the gateway
    # passes none of llama-server's own paths either (inference_gateway_routes).
    argv += ["--metrics", "--no-webui", "--no-slots"]
    if worker.get("rpc_servers"):
        argv += ["--rpc", ",".join(endpoint(server["address"], server["port"]) for server in worker["rpc_servers"])]
    split = worker.get("tensor_split") or []
    if len(split) > 1:
        argv += ["--tensor-split", ",".join(f"{share:g}" for share in split)]
    if service.get("task") == "embeddings":
        argv.append("--embeddings")
    return argv


def llamacpp_head_rpc(results: list[Mapping[str, Any]], llama_server: str) -> bool:
    """Return whether a node's llama-server has no GPU device of its own, so that the head of a worker over
    nodes serves its GPUs through an RPC server of its own (placement.inference_workers' head_rpc). ``results``:
    a looped command's, item {src, dest}, where llama_server's ran ``--list-devices`` on the node: the build
    as installed there answers (a CPU build lists "(none)"; a CUDA build each GPU it can open), whoever built
    it. No such result (check mode, no llama.cpp here): False, the plan as without the fact."""
    for result in results or []:
        if (result.get("item") or {}).get("dest") == llama_server and "stdout" in result:
            lines = str(result["stdout"]).splitlines()
            after = lines[next((i + 1 for i, line in enumerate(lines) if line.startswith("Available devices")), 0) :]
            return not any(re.match(r"\s+[^\s:]+: ", line) for line in after)
    return False


def inference_rpc_server_command(server: Mapping[str, Any], rpc_server: str | None = None) -> list[str]:
    """Return the argv of a llama.cpp RPC server's unit (one of inference_plan's rpc_servers):
    <rpc_server> listening on the node's cluster address and the server's port (never every address:
    it has no authentication; the firewall admits the worker's head alone), --cache: the tensors the
    head sends are kept in $LLAMA_CACHE/rpc (the unit's cache directory), so a restart of the group
    loads them from the node's disk instead of the network. Its GPUs are the unit's
    (CUDA_VISIBLE_DEVICES); it serves every one it sees."""
    if not rpc_server:
        raise ValueError(f"service {server.get('service')}: rpc_server: found none, expected ggml-rpc-server's path")
    return [str(rpc_server), *_flags({"--host": server.get("address"), "--port": server.get("port")}), "--cache"]


# A head's wait for its RPC servers. $1: seconds to wait; then node, address and port of each RPC server. Each
# connect has 2 s (a node that is off answers nothing: the kernel's own timeout is minutes); ggml-rpc-server takes
# a connection that closes at once and goes back to accepting.
_RPC_WAIT_SCRIPT = """\
wait=$1; deadline=$((SECONDS + wait)); shift
while [ $# -ge 3 ]; do
  until timeout 2 bash -c 'exec 3<>"/dev/tcp/$1/$2"' probe "$2" "$3" 2>/dev/null; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "the llama.cpp RPC server of node $1 ($2 port $3) does not answer after $wait s:" \
        "its node or its unit is down" >&2
      exit 1
    fi
    sleep 1
  done
  shift 3
done
"""


def inference_rpc_wait_command(worker: Mapping[str, Any], wait_s: int) -> list[str]:
    """Return the argv of a head's ExecStartPre (a worker with rpc_servers): wait at most wait_s seconds until
    each of its RPC servers accepts a connection, else fail naming the node, its address and port. The RPC
    servers run on other nodes, so the head's unit cannot order itself after them: it waits for them, and
    llama-server, which aborts when an RPC server goes away, starts only once every one answers."""
    servers = []
    for server in worker.get("rpc_servers") or []:
        servers += [str(server["host"]), str(server["address"]), str(server["port"])]
    return ["/bin/bash", "-c", _RPC_WAIT_SCRIPT, "rpc-wait", str(wait_s), *servers]
