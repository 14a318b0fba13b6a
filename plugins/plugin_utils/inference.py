"""The inference service model: one service of ``inference_services`` with every default applied,
which GPUs of which node serve it (one worker per GPU), the gateway's upstreams, the model's
memory need, the placement checks preflight runs, and the argv of one worker's unit.

Controller-side and pure (services, hostvars and parsed config.json in, values out; no I/O). Bad
input raises ValueError naming the service, the field, what was found and what was expected (the
filter file plugins/filter/inference.py turns it into AnsibleFilterError).

A service (one item of ``inference_services``; roles/inference/meta/argument_specs.yml documents
each key):

    name: chat                       # ^[a-z0-9][a-z0-9_-]*$ (units budgetgpu-infer-<name>@<slot>.service)
    model: /srv/models/llama-7b      # a model directory on the control node (config.json inside)
    task: generation                 # generation | embeddings
    nodes: inference_nodes           # an inventory group, or a list of hosts
    gpus: auto                       # auto | [0, 1] (nvidia-smi indices) | {node1: [0], node2: auto}
    quantization: 4bit               # none | 8bit | 4bit
    gateway: {host: node1, port: 8080}

Where a node's GPUs come from: ``budgetgpu_gpus.gpus[]`` of gpu_facts (``index``, ``uuid``,
``name``, ``memory_total_mib``, ``compute_capability``), through the node model (nodes.py). A GPU
is taken by a training job of ``budgetgpu_jobs`` as the job model decides it (jobs.training_gpus).
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import posixpath
import re
import shlex
import string
from collections.abc import Mapping
from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.module_utils.netinfo import endpoint
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.jobs import USER_NAME, training_gpus
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.nodes import (
    fact,
    host_var,
    in_group,
    node_address,
    node_gpus,
    simulated,
)
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.wheelhouse import wheelhouse_folder, wheels_for

SERVICE_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*$")
TASKS = ("embeddings", "generation")
DTYPES = ("float32", "float16", "bfloat16")
QUANTIZATIONS = ("none", "8bit", "4bit")
ENGINES = ("builtin", "command", "vllm", "llamacpp")
STATES = ("started", "stopped", "absent")
UNIT_PREFIX = "budgetgpu-infer-"
MODEL_ROOT = "/var/lib/budgetgpu/models"
CONFIG_DIR = "/etc/budgetgpu/inference"
# What an engine=command string may name; {port} is required (each worker listens on its own).
# {gpu_uuids}: the worker's GPUs, comma-separated; {gpus}: how many (vLLM's --tensor-parallel-size).
PLACEHOLDERS = ("model", "port", "host", "name", "max_input_tokens", "max_new_tokens", "dtype", "gpu_uuid", "gpu_uuids",
                "gpus", "slot")  # fmt: skip
# A worker's GPUs, within one node: a model split over 1, 2 or 4 cards (tensor parallelism and
# device_map both want the layers or heads to divide evenly).
GPUS_PER_WORKER = (1, 2, 4)

# engine vllm: vLLM's OpenAI-compatible server (`vllm serve`), from a venv of its own (vLLM pins its
# own CUDA build of torch). Its keys sit under a service's `vllm:`. quantization none lets vLLM read
# the checkpoint's own quantization_config; awq/gptq are the 4-bit checkpoints 3090 owners run.
VLLM_QUANTIZATIONS = ("none", "awq", "awq_marlin", "gptq", "gptq_marlin", "fp8")
VLLM_QUANT_BYTES = {"awq": 0.5, "awq_marlin": 0.5, "gptq": 0.5, "gptq_marlin": 0.5, "fp8": 1.0}
# vLLM takes this share of each GPU's memory up front (weights, then KV cache to fill it); above
# 0.95 the CUDA context, NCCL and the sampler's buffers find no room and the engine fails to start.
VLLM_MAX_MEMORY_FRACTION = 0.95
# vLLM's CUDA kernels need Volta or newer (compute capability 7.0).
VLLM_MIN_CAPABILITY = (7, 0)
# What pip installs into vLLM's venv: vllm, pinned or not (the wheelhouse decides the version).
VLLM_PACKAGE = re.compile(r"^vllm(==[0-9][0-9A-Za-z.+!-]*)?$")
# engine llamacpp: llama.cpp's llama-server (scripts/build-llama-server), one GGUF file as the model
# (the GGUF holds its weights' type: dtype and quantization do not apply). Bounds: its slots
# (-np, the service's concurrency) and the tokens its KV cache holds over all slots (-c).
LLAMACPP_MAX_SLOTS = 256
LLAMACPP_MAX_CONTEXT = 1_048_576
# The workers' own system user, which the role creates; the accounts of the system and of the other
# services the project runs, which a worker must never run as (it would read their keys and data: munge's
# key, Slurm's state, Prometheus' TSDB, NGINX's API key maps through www-data). Role inference refuses
# any other existing account below the node's UID_MIN on the node itself (tasks/install.yml).
INFERENCE_USER = "budgetgpu-infer"
RESERVED_USERS = frozenset(
    {
        "root", "daemon", "bin", "sys", "sync", "games", "man", "lp", "mail", "news", "uucp", "proxy", "www-data",
        "backup", "list", "irc", "gnats", "nobody", "_apt", "messagebus", "sshd", "systemd-network",
        "systemd-resolve", "systemd-timesync", "systemd-coredump", "munge", "slurm", "prometheus", "nginx",
    }
)  # fmt: skip
# The service keys that are mappings of their own, merged key by key (defaults, then the service's).
NESTED_KEYS = ("gateway", "vllm")

# The built-in default of every optional key: the one place service defaults live (the inference
# role's argument spec repeats them for ansible-doc; a unit test holds the two equal). inference_user
# and inference_venv, then inference_service_defaults, then a service's own keys override them.
# name, model and task have no default: a service without them is refused.
SERVICE_DEFAULTS: dict[str, Any] = {
    "model": None,
    "task": None,
    "nodes": "inference_nodes",
    "gpus": "auto",
    "gpus_per_worker": 1,
    "dtype": "float16",
    "quantization": "none",
    "max_new_tokens": 256,
    "max_input_tokens": 2048,
    "concurrency": 1,
    "queue": 8,
    "timeout_s": 120,
    # Engine builtin: concurrent requests share passes of the model (inference_worker.py's Batcher) after
    # waiting up to batch_window_ms (0: each request alone), at most batch_max inputs or sequences a pass.
    "batch_window_ms": 2,
    "batch_max": 32,
    "port": 8100,
    "engine": "builtin",
    "command": "",
    # host: the first node of the service; listen: its cluster address; keys: every key of
    # inference_api_keys; rate_per_s: each key's requests per second (a key's own rate_per_s wins).
    "gateway": {
        "host": None,
        "port": 8080,
        "allow": [],
        "listen": None,
        "keys": None,
        "rate_per_s": 100,
        "conns_per_client": 128,
        # Requests at a time per API key; None: half of what the service's workers admit together.
        "conns_per_key": None,
    },
    # engine vllm only. max_model_len: the tokens of one sequence (None: max_input_tokens +
    # max_new_tokens); venv: vLLM's own, filled with `package` from the nodes' wheelhouse.
    "vllm": {
        "quantization": "none",
        "max_model_len": None,
        "gpu_memory_utilization": 0.9,
        "venv": "/opt/budgetgpu/vllm-venv",
        "package": "vllm",
    },
    "state": "started",
    # A user of the workers' own, not the training user: a job cannot signal or trace them.
    "user": INFERENCE_USER,
    "venv": "/opt/budgetgpu/venv",
}
SERVICE_KEYS = frozenset(SERVICE_DEFAULTS) | {"name"}
GATEWAY_KEYS = tuple(SERVICE_DEFAULTS["gateway"])
VLLM_KEYS = tuple(SERVICE_DEFAULTS["vllm"])
# Keys normalise adds (not the inventory's).
DERIVED_KEYS = frozenset({"unit_template", "model_dir", "config_file"})
GATEWAY_INT_FIELDS = {"rate_per_s": 1, "conns_per_client": 1}
INT_FIELDS = {  # field -> smallest value
    "gpus_per_worker": 1,
    "max_new_tokens": 1,
    "max_input_tokens": 1,
    "concurrency": 1,
    "queue": 0,
    "timeout_s": 1,
    "batch_max": 1,
    "port": 1,
}
# The worker refuses a longer wait (inference_worker.py MAX_BATCH_WINDOW_MS).
MAX_BATCH_WINDOW_MS = 1000

# Bytes per parameter of the weights: the dtype's, or bitsandbytes' when quantised.
DTYPE_BYTES = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0}
QUANT_BYTES = {"8bit": 1.0, "4bit": 0.5}
# What a process holds on a GPU before the first weight: the CUDA context (driver state, the
# kernels of torch's CUDA libraries once loaded) takes about 300-500 MiB on Ampere/Ada with CUDA 12
# and lazy module loading; the larger figure keeps the check on the side of refusing.
CUDA_CONTEXT_BYTES = 500 * 2**20
# bitsandbytes' 8bit/4bit kernels need Turing or newer (compute capability 7.5).
QUANT_MIN_CAPABILITY = (7, 5)
# Families whose MLP is gated (gate, up and down projections: 3 x hidden x intermediate), with
# rotary positions and untied output embeddings by default (Llama-style).
GATED_MODELS = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo"})
UNTIED_MODELS = frozenset({"llama", "mistral", "mixtral", "qwen2", "phi3", "olmo"})
GIB = 2**30


def unit_name(name: str, slot: int | str = "") -> str:
    """Return a worker's unit: "budgetgpu-infer-<name>@<slot>.service" (no slot: the template)."""
    return f"{UNIT_PREFIX}{name}@{slot}.service"


def _nearest(value: Any, choices: Any) -> str:
    match = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.5)
    return f" (did you mean {match[0]}?)" if match else ""


def _label(index: int, service: Any) -> str:
    name = service.get("name") if isinstance(service, Mapping) else None
    return f"inference_services[{index}] ({name})" if name else f"inference_services[{index}]"


def _as_int(value: Any) -> Any:
    """Extra vars and some inventories give numbers as strings: take "8100" as 8100."""
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return value


def _as_float(value: Any) -> Any:
    """Take "0.9" (extra vars) as 0.9; anything else as it is (the check names it)."""
    try:
        return float(value) if isinstance(value, str) else value
    except ValueError:
        return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if key in NESTED_KEYS and isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            value = {**merged[key], **value}
        merged[key] = value
    return merged


def inference_service_normalize(
    service: Mapping[str, Any],
    defaults: Mapping[str, Any] | None = None,
    user: str | None = None,
    venv: str | None = None,
    model_root: str | None = None,
    config_dir: str | None = None,
) -> dict[str, Any]:
    """Return one service with every key present, unchecked (inference_services_normalize checks).
    Precedence, lowest first: SERVICE_DEFAULTS, user and venv, defaults, the service's keys; the
    gateway mapping merges key by key."""
    merged = _merge(SERVICE_DEFAULTS, {k: v for k, v in {"user": user, "venv": venv}.items() if v})
    merged = _merge(merged, {k: v for k, v in (defaults or {}).items() if v is not None})
    merged = _merge(merged, service)
    for key in INT_FIELDS:
        merged[key] = _as_int(merged.get(key))
    merged["batch_window_ms"] = _as_float(merged.get("batch_window_ms"))
    if isinstance(merged.get("gateway"), Mapping):
        gateway = merged["gateway"]
        ints = ("port", "conns_per_key", *GATEWAY_INT_FIELDS)
        merged["gateway"] = {**gateway, **{k: _as_int(gateway.get(k)) for k in ints}}
    if isinstance(merged.get("vllm"), Mapping):
        vllm = merged["vllm"]
        merged["vllm"] = {
            **vllm,
            "max_model_len": _as_int(vllm.get("max_model_len")),
            "gpu_memory_utilization": _as_float(vllm.get("gpu_memory_utilization")),
        }
    name = str(merged.get("name") or "")
    merged["unit_template"] = unit_name(name)
    merged["model_dir"] = f"{(model_root or MODEL_ROOT).rstrip('/')}/{name}"
    merged["config_file"] = f"{(config_dir or CONFIG_DIR).rstrip('/')}/{name}.json"
    return merged


# --- the fields of one service --------------------------------------------------------------------


def _bad_identity(service: Mapping[str, Any]) -> list[str]:
    bad = []
    name = service.get("name")
    if not isinstance(name, str) or not SERVICE_NAME.fullmatch(name):
        bad.append(f"name: found {name!r}, expected lower-case letters, digits, '_' or '-' (^[a-z0-9][a-z0-9_-]*$)")
    model = service.get("model")
    if not isinstance(model, str) or not model.strip():
        bad.append(f"model: found {model!r}, expected a model directory on the control node (config.json inside)")
    elif not model.startswith("/"):
        # The role reads and copies it from tasks on the control node, whose working directory is not the
        # playbook's: a relative path would name different files in preflight and in the copy.
        bad.append(
            f"model: found {model!r}, expected an absolute path on the control node (e.g. "
            '"{{ inventory_dir }}/models/..." or /srv/models/...)'
        )
    for key in sorted(set(service) - SERVICE_KEYS - DERIVED_KEYS, key=str):
        bad.append(
            f"{key}: unknown key{_nearest(key, SERVICE_KEYS)}; expected one of {', '.join(sorted(SERVICE_KEYS))}"
        )
    for field, choices in (
        ("task", TASKS),
        ("dtype", DTYPES),
        ("quantization", QUANTIZATIONS),
        ("engine", ENGINES),
        ("state", STATES),
    ):
        if service.get(field) not in choices:
            found = service.get(field)
            bad.append(f"{field}: found {found!r}, expected one of {', '.join(choices)}{_nearest(found, choices)}")
    return bad


def _bad_numbers(service: Mapping[str, Any]) -> list[str]:
    bad = []
    for field, low in INT_FIELDS.items():
        value = service.get(field)
        if not _is_int(value) or value < low:
            bad.append(f"{field}: found {value!r}, expected a whole number of {low} or more")
    port = service.get("port")
    if _is_int(port) and port > 65535:
        bad.append(f"port: found {port!r}, expected a TCP port from 1 to 65535")
    window = service.get("batch_window_ms")
    if isinstance(window, bool) or not isinstance(window, int | float) or not 0 <= window <= MAX_BATCH_WINDOW_MS:
        expected = f"milliseconds from 0 (no batching) to {MAX_BATCH_WINDOW_MS}"
        bad.append(f"batch_window_ms: found {window!r}, expected {expected}")
    per_worker = service.get("gpus_per_worker")
    if _is_int(per_worker) and per_worker not in GPUS_PER_WORKER:
        bad.append(f"gpus_per_worker: found {per_worker!r}, expected one of {', '.join(map(str, GPUS_PER_WORKER))}")
    return bad


def _bad_gpus(gpus: Any) -> list[str]:
    def index_list_ok(value: Any) -> bool:
        return value == "auto" or (isinstance(value, list) and all(_is_int(_as_int(i)) for i in value))

    if isinstance(gpus, Mapping):
        wrong = {host: value for host, value in gpus.items() if not index_list_ok(value)}
        if not wrong:
            return []
        return [f"gpus: found {wrong!r}, expected for each host auto or a list of GPU indices (nvidia-smi order)"]
    if index_list_ok(gpus):
        return []
    return [f"gpus: found {gpus!r}, expected auto, a list of GPU indices (nvidia-smi order) or a mapping host -> list"]


def _bad_gateway(gateway: Any) -> list[str]:
    if not isinstance(gateway, Mapping):
        return [f"gateway: found {gateway!r}, expected a mapping with host, port and allow"]
    bad = [
        f"gateway.{key}: unknown key{_nearest(key, GATEWAY_KEYS)}; expected one of {', '.join(GATEWAY_KEYS)}"
        for key in sorted(set(gateway) - set(GATEWAY_KEYS), key=str)
    ]
    port = gateway.get("port")
    if not _is_int(port) or not 1 <= port <= 65535:
        bad.append(f"gateway.port: found {port!r}, expected a TCP port from 1 to 65535")
    for key, low in GATEWAY_INT_FIELDS.items():
        value = gateway.get(key)
        if not _is_int(value) or value < low:
            bad.append(f"gateway.{key}: found {value!r}, expected a whole number of {low} or more")
    per_key = gateway.get("conns_per_key")
    if per_key is not None and (not _is_int(per_key) or per_key < 1):
        bad.append(
            f"gateway.conns_per_key: found {per_key!r}, expected a whole number of 1 or more, or none (half of "
            "what the service's workers admit)"
        )
    listen = gateway.get("listen")
    if listen is not None and not _is_address(listen):
        bad.append(f"gateway.listen: found {listen!r}, expected an IP address of the gateway's host")
    keys = gateway.get("keys")
    if keys is not None and not (isinstance(keys, list) and keys and all(isinstance(k, str) for k in keys)):
        bad.append(f"gateway.keys: found {keys!r}, expected a list of key names of inference_api_keys")
    host = gateway.get("host")
    if host is not None and not isinstance(host, str):
        bad.append(f"gateway.host: found {host!r}, expected an inventory host")
    allow = gateway.get("allow")
    if not isinstance(allow, list) or not all(_is_cidr(item) for item in allow):
        bad.append(f"gateway.allow: found {allow!r}, expected a list of CIDRs such as 192.168.1.0/24")
    return bad


def _is_address(value: Any) -> bool:
    try:
        ipaddress.ip_address(str(value))
    except ValueError:
        return False
    return True


def _is_cidr(value: Any) -> bool:
    try:
        ipaddress.ip_network(str(value), strict=False)
    except ValueError:
        return False
    return "/" in str(value)


def _bad_engine(service: Mapping[str, Any]) -> list[str]:
    engine, command = service.get("engine"), service.get("command")
    if engine in ("builtin", "vllm") and command:
        return [f"command: found {command!r}, expected none with engine {engine} (set engine: command to run it)"]
    if engine != "command":
        return []
    if not isinstance(command, str) or "{port}" not in command:
        return [
            f"command: found {command!r}, expected an OpenAI-compatible server command with {{port}} "
            f"(placeholders {', '.join('{' + p + '}' for p in PLACEHOLDERS)})"
        ]
    try:
        names = {field for _text, field, _spec, _conversion in string.Formatter().parse(command) if field is not None}
    except ValueError as error:
        return [f"command: found {command!r}, expected balanced {{placeholders}} ({error})"]
    unknown = sorted(names - set(PLACEHOLDERS))
    if unknown:
        hint = _nearest(unknown[0], PLACEHOLDERS)
        return [f"command: found placeholder {{{unknown[0]}}}{hint}, expected only {', '.join(PLACEHOLDERS)}"]
    return []


def _bad_vllm(service: Mapping[str, Any]) -> list[str]:
    """engine vllm: its own keys, and quantisation by vLLM's methods, never bitsandbytes' 8bit/4bit."""
    if service.get("engine") != "vllm":
        return []
    vllm = service.get("vllm")
    if not isinstance(vllm, Mapping):
        return [f"vllm: found {vllm!r}, expected a mapping with {', '.join(VLLM_KEYS)}"]
    bad = [
        f"vllm.{key}: unknown key{_nearest(key, VLLM_KEYS)}; expected one of {', '.join(VLLM_KEYS)}"
        for key in sorted(set(vllm) - set(VLLM_KEYS), key=str)
    ]
    quant, method = service.get("quantization"), vllm.get("quantization")
    if quant in QUANT_BYTES:
        bad.append(
            f"quantization: found {quant} with engine vllm, expected none: 8bit/4bit are bitsandbytes' (engine "
            f"builtin); for an AWQ or GPTQ checkpoint set vllm.quantization ({', '.join(VLLM_QUANTIZATIONS)})"
        )
    if method not in VLLM_QUANTIZATIONS:
        bad.append(
            f"vllm.quantization: found {method!r}, expected one of {', '.join(VLLM_QUANTIZATIONS)}"
            f"{_nearest(method, VLLM_QUANTIZATIONS)}"
        )
    return bad + _bad_vllm_settings(service, vllm)


def _bad_vllm_settings(service: Mapping[str, Any], vllm: Mapping[str, Any]) -> list[str]:
    bad = []
    length = vllm.get("max_model_len")
    if length is not None and (not _is_int(length) or length < 1):
        bad.append(
            f"vllm.max_model_len: found {length!r}, expected a whole number of tokens of 1 or more, or none "
            "(max_input_tokens + max_new_tokens)"
        )
    share = vllm.get("gpu_memory_utilization")
    if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= VLLM_MAX_MEMORY_FRACTION:
        bad.append(
            f"vllm.gpu_memory_utilization: found {share!r}, expected a share of each GPU's memory above 0 and "
            f"at most {VLLM_MAX_MEMORY_FRACTION}"
        )
    venv, workers_venv = vllm.get("venv"), str(service.get("venv")).rstrip("/")
    if not isinstance(venv, str) or not venv.startswith("/") or venv.rstrip("/") == workers_venv:
        bad.append(
            f"vllm.venv: found {venv!r}, expected an absolute path apart from venv {service.get('venv')} "
            "(vLLM pins its own torch)"
        )
    package = vllm.get("package")
    if not isinstance(package, str) or not VLLM_PACKAGE.fullmatch(package):
        bad.append(f"vllm.package: found {package!r}, expected vllm or vllm==VERSION (a wheel in the wheelhouse)")
    return bad


def _bad_llamacpp(service: Mapping[str, Any]) -> list[str]:
    """engine llamacpp: a .gguf model, no command, no bitsandbytes quantisation (the GGUF's own
    type is what runs), slots and context within llama-server's bounds."""
    if service.get("engine") != "llamacpp":
        return []
    bad, model, command = [], service.get("model"), service.get("command")
    if isinstance(model, str) and not model.strip().lower().endswith(".gguf"):
        bad.append(f"model: found {model!r}, expected a GGUF file (*.gguf) on the control node with engine llamacpp")
    if command:
        bad.append(f"command: found {command!r}, expected none with engine llamacpp (set engine: command to run it)")
    quant = service.get("quantization")
    if quant in QUANT_BYTES:
        bad.append(
            f"quantization: found {quant} with engine llamacpp, expected none: a GGUF file carries its own "
            "quantisation (Q4_K_M, Q8_0, ...): convert or pick the GGUF you want to run"
        )
    slots = service.get("concurrency")
    if _is_int(slots) and slots > LLAMACPP_MAX_SLOTS:
        bad.append(f"concurrency: found {slots}, expected at most {LLAMACPP_MAX_SLOTS} llama-server slots (-np)")
    context = llamacpp_context(service)
    if context > LLAMACPP_MAX_CONTEXT:
        bad.append(
            f"max_input_tokens + max_new_tokens: found {context} tokens over {slots} slots, expected at most "
            f"{LLAMACPP_MAX_CONTEXT} (llama-server's -c: (max_input_tokens + max_new_tokens) x concurrency)"
        )
    return bad


def llamacpp_context(service: Mapping[str, Any]) -> int:
    """Return llama-server's -c: the tokens of all slots' KV cache, each slot holding one request's
    max_input_tokens + max_new_tokens (llama-server splits -c evenly over its -np slots)."""
    values = [service.get(key) for key in ("max_input_tokens", "max_new_tokens", "concurrency")]
    if not all(_is_int(v) and v > 0 for v in values):
        return 0
    return (values[0] + values[1]) * values[2]


def _bad_user(user: Any, training_users: Any = ()) -> list[str]:
    """The workers' user: a valid name, never root, a training user or another service's account."""
    expected = f"expected a user of the workers' own (default {INFERENCE_USER}, which the role creates)"
    if not isinstance(user, str) or not USER_NAME.fullmatch(user):
        return [f"user: found {user!r}, {expected}"]
    if user in {str(u) for u in training_users or () if u}:
        return [
            f"user: found {user}, the training user (budgetgpu_user, torchrun_user or a job's user), {expected}: "
            "a job running as it could signal, trace or replace the workers"
        ]
    if user in RESERVED_USERS:
        return [f"user: found {user}, an account of the system or of another service, {expected}"]
    return []


# The passwd comment of the workers' users the role creates: an existing account below UID_MIN that
# carries it is the role's own (inference_user_problems).
USER_COMMENT = "budgetgpu inference worker"


def inference_user_problems(
    services: list[Mapping[str, Any]], accounts: Mapping[str, Any], uid_min: int, host: str
) -> list[str]:
    """Return why the workers of a node may not run as their services' users: an account that exists
    on the node below its UID_MIN (the system's and other services' accounts: munge, slurm, www-data,
    _apt...) that the role did not create (passwd comment USER_COMMENT; the default user of releases
    that set no comment counts as the role's), or root. accounts: {user: {uid, gecos} or None (absent:
    the role creates it)}, as the role's look at the node found them."""
    problems = []
    for service in services:
        if service.get("state") == "absent":
            continue
        user = service.get("user")
        found = accounts.get(user) if isinstance(accounts, Mapping) else None
        if not isinstance(found, Mapping):
            continue
        uid, gecos = found.get("uid"), str(found.get("gecos") or "")
        ours = gecos == USER_COMMENT or (user == INFERENCE_USER and gecos == "")
        if uid == 0 or (_is_int(uid) and uid < int(uid_min) and not ours):
            problems.append(
                f"{host}: service {service.get('name')}: user: found {user}, an existing account of uid {uid} "
                f"(below UID_MIN {uid_min}: the system's or another service's) that role inference did not create, "
                f"expected a user of the workers' own: set the service's user (or inference_user) to a name that "
                f"does not exist yet (default {INFERENCE_USER}), which the role creates"
            )
    return problems


def _bad_runtime(service: Mapping[str, Any], training_users: Any = ()) -> list[str]:
    bad = []
    nodes = service.get("nodes")
    if not (isinstance(nodes, str) and nodes) and not (
        isinstance(nodes, list) and nodes and all(isinstance(h, str) for h in nodes)
    ):
        bad.append(f"nodes: found {nodes!r}, expected an inventory group or a list of hosts")
    bad += _bad_user(service.get("user"), training_users)
    venv = service.get("venv")
    if not isinstance(venv, str) or not venv.startswith("/"):
        bad.append(f"venv: found {venv!r}, expected an absolute path")
    return bad


def service_problems(service: Mapping[str, Any], training_users: Any = ()) -> list[str]:
    """Return what is wrong with the fields of one normalised service, each "field: found, expected"
    (training_users: the users training jobs run as, which the workers must not)."""
    return [
        *_bad_identity(service),
        *_bad_numbers(service),
        *_bad_gpus(service.get("gpus")),
        *_bad_gateway(service.get("gateway")),
        *_bad_engine(service),
        *_bad_vllm(service),
        *_bad_llamacpp(service),
        *_bad_runtime(service, training_users),
    ]


def inference_services_normalize(
    services: Any,
    defaults: Mapping[str, Any] | None = None,
    user: str | None = None,
    venv: str | None = None,
    model_root: str | None = None,
    config_dir: str | None = None,
    training_users: list[str] | None = None,
) -> list[dict[str, Any]]:
    """Return every service of inference_services with every key present (see
    inference_service_normalize), or raise ValueError listing every bad field of every service.
    training_users: budgetgpu_user and the users of the training jobs, refused as a service's user."""
    if services is None:
        return []
    if not isinstance(services, list):
        hint = " (a mapping: put a '-' before each service)" if isinstance(services, Mapping) else ""
        raise ValueError(
            f"inference_services: found {type(services).__name__} {services!r}, expected a list of services{hint}"
        )
    if defaults is not None and not isinstance(defaults, Mapping):
        raise ValueError(f"inference_service_defaults: found {defaults!r}, expected a dict of service keys")
    problems = [
        f"inference_service_defaults: {key}: unknown key{_nearest(key, SERVICE_KEYS)}"
        for key in sorted(set(defaults or {}) - SERVICE_KEYS, key=str)
    ]
    normalised, seen = [], {}
    for index, service in enumerate(services):
        if not isinstance(service, Mapping):
            problems.append(f"inference_services[{index}]: found {service!r}, expected a mapping (a service)")
            continue
        item = inference_service_normalize(service, defaults, user, venv, model_root, config_dir)
        problems += [f"{_label(index, service)}: {bad}" for bad in service_problems(item, training_users)]
        name = item.get("name")
        if isinstance(name, str) and name in seen:
            problems.append(f"{_label(index, service)}: name: found {name!r}, expected a name no other service has")
        seen.setdefault(name, index)
        normalised.append(item)
    if problems:
        raise ValueError("; ".join(problems))
    return normalised


# --- where a service runs ---------------------------------------------------------------------------


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


# --- the gateway ------------------------------------------------------------------------------------

# An API key as NGINX compares it (a regular expression of the whole Authorization header, so that
# case counts): characters that need no quoting, long enough not to be guessed.
API_KEY_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
API_KEY = re.compile(r"^[A-Za-z0-9._~+/=-]{24,256}$")
# What a request may weigh, per endpoint: OpenAI's 2048 embedding inputs, at most EMBEDDING_TOKENS
# tokens in all (OpenAI's 300,000), BYTES_PER_TOKEN bytes of JSON per token (text in ASCII JSON
# takes 4 to 6 bytes per token), plus BODY_SLACK for the other fields and the chat structure.
EMBEDDING_INPUTS = 2048
EMBEDDING_TOKENS = 300_000
BYTES_PER_TOKEN = 8
BODY_SLACK = 64 * 1024
ENDPOINTS = ("/v1/embeddings", "/v1/completions", "/v1/chat/completions")


def inference_gateway_allow(
    service: Mapping[str, Any], allow: list[str] | None = None, cluster_subnet: str | None = None
) -> list[str]:
    """Return who may reach the service's gateway: its gateway.allow, else ``allow``
    (inference_gateway_allow), else the cluster's subnet; [] when none is known (preflight refuses)."""
    own = (service.get("gateway") or {}).get("allow")
    if own:
        return [str(item) for item in own]
    if allow:
        return [str(item) for item in allow]
    return [str(cluster_subnet)] if cluster_subnet else []


def inference_firewall_ports(
    plan: list[Mapping[str, Any]], gateways: list[Mapping[str, Any]], scrapers: list[str], scrapers_extra: list[str]
) -> list[dict[str, Any]]:
    """Return the entries of a node's inference firewall table (role firewall, filter firewall_rules):
    each service's workers, which answer anyone (no authentication), from its gateway and the
    Prometheus hosts (their /metrics) only; each gateway port from its allow list, from no one when
    that is empty. ``plan`` and ``gateways`` are role inference's entries of this node."""
    entries = []
    for svc in plan:
        ports = sorted(int(worker["port"]) for worker in svc.get("workers") or [])
        if svc.get("state") == "absent" or not ports:
            continue
        entries.append(
            {
                # Each port, not a range: a range would open the ports between to this gateway too.
                "port": ports,
                "what": f"{svc['name']} workers",
                "only": "gateway and Prometheus only",
                "hosts": list(scrapers or []),
                "extra": [str(svc["gateway_address"])] + list(scrapers_extra or []),
                "inputs": "inference_scrapers / inference_scrapers_extra",
            }
        )
    for svc in gateways:
        if svc.get("state") != "absent":
            entries.append(
                {
                    "port": int(svc["gateway_port"]),
                    "what": f"{svc['name']} gateway",
                    "only": "its allow list only",
                    "hosts": [],
                    "extra": list(svc.get("allow") or []),
                    "inputs": f"service {svc['name']}: gateway.allow",
                }
            )
    return entries


def _key_entries(api_keys: Any) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Return ({name: {key, rate_per_s}}, problems) of inference_api_keys. A problem never shows a key."""
    if api_keys in (None, ""):
        return {}, []
    if not isinstance(api_keys, Mapping):
        return {}, [f"inference_api_keys: found {type(api_keys).__name__}, expected a mapping of key name -> key"]
    entries, problems = {}, []
    for name, value in api_keys.items():
        where = f"inference_api_keys.{name}"
        if not isinstance(name, str) or not API_KEY_NAME.fullmatch(name):
            problems.append(f"{where}: name: expected 1 to 64 of A-Z a-z 0-9 _ . -")
            continue
        entry = dict(value) if isinstance(value, Mapping) else {"key": value}
        key, rate = entry.get("key"), _as_int(entry.get("rate_per_s"))
        if set(entry) - {"key", "rate_per_s"}:
            problems.append(
                f"{where}: found keys {', '.join(sorted(map(str, set(entry) - {'key', 'rate_per_s'})))}, "
                "expected key and rate_per_s only"
            )
        if not isinstance(key, str) or not API_KEY.fullmatch(key):
            size = len(key) if isinstance(key, str) else type(key).__name__
            problems.append(
                f"{where}: found a key of {size} characters (not shown), expected 24 to 256 of "
                "A-Z a-z 0-9 . _ ~ + / = - (e.g. openssl rand -hex 24)"
            )
        if rate is not None and (not _is_int(rate) or rate < 1):
            problems.append(f"{where}: rate_per_s: found {rate!r}, expected a whole number of 1 or more")
        entries[name] = {"key": key, "rate_per_s": rate}
    return entries, problems


def _service_keys(service: Mapping[str, Any], entries: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """Return (the key names the service's gateway accepts, problems)."""
    name, wanted = service.get("name"), (service.get("gateway") or {}).get("keys")
    if wanted is None:
        names = sorted(entries)
    else:
        names = [k for k in wanted if k in entries]
        unknown = [k for k in wanted if k not in entries]
        if unknown:
            return names, [
                f"all: service {name}: gateway.keys: found {', '.join(map(str, unknown))}, expected names of "
                f"inference_api_keys ({', '.join(sorted(entries)) or 'none'})"
            ]
    if not names:
        return [], [
            f"all: service {name}: gateway: found no API key, expected at least one in inference_api_keys "
            "(a mapping of name -> key; keep it in Ansible Vault): the gateway refuses every request without one"
        ]
    return names, []


def gateway_problems(
    services: list[Mapping[str, Any]],
    api_keys: Any = None,
    allow: list[str] | None = None,
    cluster_subnet: str | None = None,
) -> list[str]:
    """Return what stops the services' gateways from being closed to strangers: an allow list that
    resolves to empty (the firewall would then admit everyone), no API key, bad keys."""
    entries, problems = _key_entries(api_keys)
    for service in (s for s in services or [] if s.get("state") != "absent"):
        if not inference_gateway_allow(service, allow, cluster_subnet):
            problems.append(
                f"all: service {service.get('name')}: gateway.allow: found an empty allow list (no gateway.allow, "
                "no inference_gateway_allow, no budgetgpu_cluster_subnet), expected the CIDRs of the clients"
            )
        problems += _service_keys(service, entries)[1]
    return problems


def inference_gateway_keys(service: Mapping[str, Any], api_keys: Any) -> list[dict[str, Any]]:
    """Return the keys the service's gateway accepts, for its NGINX key map: [{name, pattern, rate_per_s}]
    (pattern: a case-sensitive regular expression of the whole Authorization header). Secret: render
    it only in a no_log task. Raises ValueError (without the keys) on the problems preflight reports."""
    entries, problems = _key_entries(api_keys)
    names, more = _service_keys(service, entries)
    if problems or more:
        raise ValueError("; ".join(problems + more))
    rate = (service.get("gateway") or {}).get("rate_per_s") or SERVICE_DEFAULTS["gateway"]["rate_per_s"]
    return [
        {
            "name": name,
            "pattern": "^Bearer " + re.escape(entries[name]["key"]) + "$",
            "rate_per_s": entries[name]["rate_per_s"] or rate,
        }
        for name in names
    ]


def inference_body_limits(service: Mapping[str, Any]) -> dict[str, int]:
    """Return the largest request body in bytes per endpoint ("other": every other path), the same in
    NGINX (client_max_body_size) and in the worker (413 before parsing)."""
    tokens = int(service.get("max_input_tokens") or SERVICE_DEFAULTS["max_input_tokens"])
    generation = tokens * BYTES_PER_TOKEN + BODY_SLACK
    embeddings = min(EMBEDDING_INPUTS * tokens, EMBEDDING_TOKENS) * BYTES_PER_TOKEN + BODY_SLACK
    return {
        "/v1/embeddings": embeddings,
        "/v1/completions": generation,
        "/v1/chat/completions": generation,
        "other": BODY_SLACK,
    }


def inference_max_conns(service: Mapping[str, Any]) -> int:
    """Return how many requests the gateway sends one worker at a time: what the worker runs and
    queues. Past that, the gateway sheds (503 with Retry-After) instead of queueing in NGINX."""
    return int(service.get("concurrency") or 1) + int(service.get("queue") or 0)


# What the gateway passes to a service's workers, whatever the engine: the OpenAI paths of its task
# (every engine serves these; llama.cpp's and vLLM's own paths such as /slots, /props, /tokenize,
# /v1/stream, /v1/messages, /v1/responses, /pause never pass) and /health; and of the client's
# headers only Content-Type (the JSON body). NGINX sets Host, Content-Length and X-Request-Id itself;
# Authorization (the gateway's key) and everything else, X-Conversation-Id (which makes llama-server
# go on generating after the client left) included, stay at the gateway.
GATEWAY_PATHS = {
    "embeddings": ("/v1/models", "/v1/embeddings"),
    "generation": ("/v1/models", "/v1/completions", "/v1/chat/completions"),
}
GATEWAY_CLIENT_HEADERS = ("Content-Type",)


def inference_gateway_routes(service: Mapping[str, Any], workers: int) -> dict[str, Any]:
    """Return what the service's gateway passes and how much one key may hold: {paths: the OpenAI
    paths of its task, headers: the client headers passed (all others are dropped), conns_per_key:
    the requests at a time one API key may have in the gateway: gateway.conns_per_key, else half of
    what its ``workers`` workers admit together (concurrency + queue each), at least 1}. Past it NGINX
    answers 429, so that one key cannot take every worker's slots and starve the other keys."""
    task = service.get("task")
    if task not in GATEWAY_PATHS:
        raise ValueError(f"service {service.get('name')}: task: found {task!r}, expected one of {', '.join(TASKS)}")
    own = (service.get("gateway") or {}).get("conns_per_key")
    admitted = max(int(workers or 0), 0) * inference_max_conns(service)
    return {
        "paths": list(GATEWAY_PATHS[task]),
        "headers": list(GATEWAY_CLIENT_HEADERS),
        "conns_per_key": int(own) if _is_int(own) and own > 0 else max(1, admitted // 2),
    }


# --- memory -----------------------------------------------------------------------------------------


def _config_int(config: Mapping[str, Any], *names: str, default: Any = None) -> int:
    for name in names:
        value = config.get(name)
        if _is_int(value) and value > 0:
            return value
    if default is not None:
        return default
    raise ValueError(f"config.json: found no {' or '.join(names)}, expected a positive number")


def model_shape(config: Mapping[str, Any]) -> dict[str, Any]:
    """Return the shape of a BERT, GPT-2 or Llama-style model from its config.json."""
    if not isinstance(config, Mapping):
        raise ValueError(f"config.json: found {type(config).__name__}, expected a JSON object")
    # Multimodal and some newer configs keep the language model's numbers under text_config.
    if "hidden_size" not in config and isinstance(config.get("text_config"), Mapping):
        config = {**config["text_config"], **{k: v for k, v in config.items() if k != "text_config"}}
    kind = str(config.get("model_type") or "")
    gated = kind in GATED_MODELS or (not kind and config.get("hidden_act") in ("silu", "swish"))
    hidden = _config_int(config, "hidden_size", "n_embd", "d_model")
    heads = _config_int(config, "num_attention_heads", "n_head")
    return {
        "model_type": kind or "unknown",
        "hidden": hidden,
        "layers": _config_int(config, "num_hidden_layers", "n_layer"),
        "heads": heads,
        "kv_heads": _config_int(config, "num_key_value_heads", default=heads),
        "head_dim": _config_int(config, "head_dim", default=hidden // heads),
        "intermediate": _config_int(config, "intermediate_size", "n_inner", default=4 * hidden),
        "vocab": _config_int(config, "vocab_size"),
        # Llama-style models use rotary positions (no parameters); BERT and GPT-2 learn them.
        "positions": 0 if gated else _config_int(config, "max_position_embeddings", "n_positions", default=0),
        "token_types": 0 if gated else _config_int(config, "type_vocab_size", default=0),
        "gated": gated,
        "tied": bool(config.get("tie_word_embeddings", kind not in UNTIED_MODELS)),
    }


def model_parameters(shape: Mapping[str, Any]) -> int:
    """Return the parameter count of a model shape (model_shape): embeddings, per layer attention
    (q, k, v, o), the MLP (gated: 3 matrices, else 2), norms and biases, and an untied output layer."""
    h, kv = shape["hidden"], shape["kv_heads"] * shape["head_dim"]
    attention = h * shape["heads"] * shape["head_dim"] * 2 + h * kv * 2
    mlp = (3 if shape["gated"] else 2) * h * shape["intermediate"]
    # Gated: two RMSNorm weights, no biases; else the q/k/v/o and MLP biases and two LayerNorms.
    extras = 2 * h if shape["gated"] else 4 * h + shape["intermediate"] + h + 4 * h
    embeddings = (shape["vocab"] + shape["positions"] + shape["token_types"]) * h
    output = 0 if shape["tied"] else shape["vocab"] * h
    return embeddings + shape["layers"] * (attention + mlp + extras) + output + 2 * h


def _gib(value: float) -> str:
    """Bytes in GiB, or in MiB below 1 GiB."""
    return f"{value / GIB:.1f} GiB" if value >= GIB else f"{value / 2**20:.0f} MiB"


def _weight_bytes(service: Mapping[str, Any], config: Mapping[str, Any]) -> tuple[float, str]:
    """Return (bytes per parameter, what sets them): bitsandbytes' 8bit/4bit (engine builtin), vLLM's
    method (vllm.quantization, else the checkpoint's quantization_config, its bits where it says),
    else the dtype."""
    dtype = str(service.get("dtype") or "float16")
    quant = service.get("quantization") or "none"
    if service.get("engine") != "vllm":
        return (QUANT_BYTES[quant], quant) if quant in QUANT_BYTES else (DTYPE_BYTES.get(dtype, 2.0), dtype)
    vllm = service.get("vllm") if isinstance(service.get("vllm"), Mapping) else {}
    found = config.get("quantization_config") if isinstance(config, Mapping) else None
    found = found if isinstance(found, Mapping) else {}
    method = vllm.get("quantization") or "none"
    method = str(found.get("quant_method") or "none") if method == "none" else method
    if method not in VLLM_QUANT_BYTES:
        return DTYPE_BYTES.get(dtype, 2.0), dtype
    bits = found.get("bits")
    return (bits / 8 if _is_int(bits) and method != "fp8" else VLLM_QUANT_BYTES[method]), method


def inference_context_tokens(service: Mapping[str, Any]) -> int:
    """Return the tokens of one sequence that a worker's KV cache holds: vllm.max_model_len (vLLM's
    --max-model-len) where set, else max_input_tokens + max_new_tokens."""
    vllm = service.get("vllm") if isinstance(service.get("vllm"), Mapping) else {}
    if service.get("engine") == "vllm" and _is_int(vllm.get("max_model_len")):
        return int(vllm["max_model_len"])
    return int(service.get("max_input_tokens") or 0) + int(service.get("max_new_tokens") or 0)


def inference_memory_need(service: Mapping[str, Any], model_config: Mapping[str, Any]) -> dict[str, Any]:
    """Return what one worker of the service holds on its GPUs, in bytes: the weights (parameters x
    bytes per parameter of the dtype, or of the quantisation), for generation the KV cache
    (2 x layers x kv_heads x head_dim x inference_context_tokens x concurrency x bytes of
    the dtype, never below 2: quantised weights compute in float16), split evenly over its
    gpus_per_worker GPUs, and one CUDA context on each; `per_gpu_bytes` is what each GPU must hold,
    `text` says the arithmetic. Activations are not counted: the figure is the least a worker needs."""
    shape = model_shape(model_config)
    params = model_parameters(shape)
    dtype = service.get("dtype") or "float16"
    per_param, unit = _weight_bytes(service, model_config)
    weights = int(params * per_param)
    kv_cache = 0
    if service.get("task") == "generation":
        tokens = inference_context_tokens(service)
        per_token = 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * max(DTYPE_BYTES.get(dtype, 2.0), 2)
        kv_cache = int(per_token * tokens * int(service.get("concurrency") or 1))
    gpus = _per_worker(service)
    per_gpu = (weights + kv_cache) // gpus + CUDA_CONTEXT_BYTES
    scale = f"{params / 1e9:.1f}e9" if params >= 1e9 else f"{params / 1e6:.1f}e6"
    text = f"{scale} params x {per_param:g} B ({unit}) = {_gib(weights)}"
    if kv_cache:
        text += f" + KV cache {_gib(kv_cache)}"
    if gpus > 1:
        share = _gib((weights + kv_cache) // gpus)
        text += f", over {gpus} GPUs: {share} each + {_gib(CUDA_CONTEXT_BYTES)} CUDA context"
        summary = f"{_gib(per_gpu)} on each of {gpus} GPUs"
    else:
        text += f" + {_gib(CUDA_CONTEXT_BYTES)} CUDA context"
        summary = _gib(per_gpu)
    return {
        "params": params,
        "bytes_per_param": per_param,
        "weights_bytes": weights,
        "kv_cache_bytes": kv_cache,
        "overhead_bytes": CUDA_CONTEXT_BYTES * gpus,
        "gpus": gpus,
        "per_gpu_bytes": per_gpu,
        "total_bytes": weights + kv_cache + CUDA_CONTEXT_BYTES * gpus,
        "text": f"{summary} ({text})",
    }


# --- the placement checks ---------------------------------------------------------------------------


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
        hint = "" if need["gpus"] >= max(GPUS_PER_WORKER) else " (or more gpus_per_worker)"
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
    """engine llamacpp: (the memory need, the model's problems) from what the control node found of
    the GGUF file: preflight's stat of it ({exists, isreg, size})."""
    size = found.get("size") if isinstance(found, Mapping) and found.get("isreg") else None
    if not _is_int(size) or size <= 0:
        return None, [
            f"control node: service {service.get('name')}: model: found no GGUF file {service.get('model')} on the "
            "control node, expected a GGUF model file (scripts in llama.cpp convert Hugging Face models to GGUF)"
        ]
    gpus = _per_worker(service)
    per_gpu = size // gpus + CUDA_CONTEXT_BYTES
    spread = f", over {gpus} GPUs" if gpus > 1 else ""
    context = _gib(CUDA_CONTEXT_BYTES)
    text = f"{_gib(per_gpu)} (GGUF weights {_gib(size)}{spread} + {context} CUDA context; KV cache not counted)"
    return {
        "params": None,
        "bytes_per_param": None,
        "weights_bytes": size,
        "kv_cache_bytes": 0,
        "overhead_bytes": CUDA_CONTEXT_BYTES * gpus,
        "gpus": gpus,
        "per_gpu_bytes": per_gpu,
        "total_bytes": size + CUDA_CONTEXT_BYTES * gpus,
        "text": text,
    }, []


def _service_problems(
    service: Mapping[str, Any],
    hostvars: Mapping[str, Any],
    hosts: list[str],
    jobs: list[Mapping[str, Any]] | None,
    model_configs: Mapping[str, Any],
    unprobed_ok: bool = False,
) -> tuple[list[str], dict[tuple[str, int], list[str]]]:
    """Return (problems, {(host, GPU index): [service]}) of one service on all of its nodes."""
    name, problems, claims = service.get("name"), [], {}
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
    problems += model_problems
    for host in (h for h in nodes if h in hosts):
        chosen, placement_problems = _placement(service, hostvars, host, jobs)
        if not (unprobed_ok and node_gpus(hostvars, host) is None):
            problems += placement_problems
        for gpu in chosen:
            claims.setdefault((host, gpu.get("index")), []).append(str(name))
            problems += _gpu_problems(service, hostvars, host, gpu, need)
    return problems, claims


def _port_owners(
    services: list[Mapping[str, Any]],
    hostvars: Mapping[str, Any],
    hosts: list[str],
    jobs: list[Mapping[str, Any]] | None,
) -> dict[str, list[tuple[int, int, str]]]:
    """Return {host: [(first port, last port, owner)]}: each service's worker range, each gateway
    port, each training job's port (rendezvous) on the nodes of that job."""
    owners: dict[str, list[tuple[int, int, str]]] = {}
    for service in services:
        name = service.get("name")
        for host in (h for h in service_hosts(service, hostvars, hosts) if h in hosts):
            count = len(_placement(service, hostvars, host, jobs)[0])
            if count:
                port = service["port"]
                owners.setdefault(host, []).append((port, port + count - 1, f"service {name} workers"))
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


def llama_server_problems(services: list[Mapping[str, Any]], llama_server: Mapping[str, Any] | None) -> list[str]:
    """engine llamacpp: the role copies llama-server from the control node (inference_llamacpp_server).
    llama_server: {path} and preflight's stat of it there ({exists, isreg, executable}); None: not looked at."""
    names = [s.get("name") for s in services or [] if s.get("engine") == "llamacpp" and s.get("state") != "absent"]
    if not names or llama_server is None:
        return []
    path = str(llama_server.get("path") or "")
    if not path:
        found = "none"
    elif not path.startswith("/"):
        found = f"{path!r}, a relative path"
    elif not (llama_server.get("isreg") and llama_server.get("executable")):
        found = f"{path}, which is not an executable file there"
    else:
        return []
    return [
        f"control node: inference_llamacpp_server: found {found}, expected the absolute path of llama.cpp's "
        f"llama-server on the control node for service {', '.join(names)} of engine llamacpp "
        "(scripts/build-llama-server builds it and prints its path)"
    ]


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
    llama_server: {path, exists, isreg, executable} of inference_llamacpp_server on the control node.
    vllm_wheelhouses, wheels: the vLLM nodes' wheelhouses and the wheels in them (vllm_wheelhouse_problems).
    """
    active = [s for s in services or [] if s.get("state") != "absent"]
    problems, claims = [], {}
    for service in active:
        service_problems, service_claims = _service_problems(
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
    problems += llama_server_problems(active, llama_server)
    problems += vllm_wheelhouse_problems(active, hostvars, hosts, vllm_wheelhouses, wheels)
    problems += gateway_problems(active, api_keys, gateway_allow, cluster_subnet)
    return problems


# --- a worker's command -----------------------------------------------------------------------------


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
    a warning), the layers split evenly over gpus_per_worker GPUs (--tensor-split 1,1[,...]),
    --embeddings for task embeddings, no web UI, no slot endpoints (--no-slots). No API key: the
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
    gpus = _per_worker(service)
    if gpus > 1:
        argv += ["--tensor-split", ",".join(["1"] * gpus)]
    if service.get("task") == "embeddings":
        argv.append("--embeddings")
    return argv
