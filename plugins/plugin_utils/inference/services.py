"""The inference service model: one service of ``inference_services`` with every default applied,
and the problems of its fields (what preflight refuses before anything changes).

A service (one item of ``inference_services``; roles/inference/meta/argument_specs.yml documents
each key):

    name: chat                       # ^[a-z0-9][a-z0-9_-]*$ (units budgetgpu-infer-<name>@<slot>.service)
    model: /srv/models/llama-7b      # a model directory on the control node (config.json inside)
    task: generation                 # generation | embeddings
    nodes: inference_nodes           # an inventory group, or a list of hosts
    gpus: auto                       # auto | [0, 1] (nvidia-smi indices) | {node1: [0], node2: auto}
    nodes_per_worker: 1              # engine llamacpp: one worker over this many nodes (llama.cpp's RPC)
    quantization: 4bit               # none | 8bit | 4bit
    gateway: {host: node1, port: 8080}

Controller-side and pure (services, hostvars and parsed config.json in, values out; no I/O). Bad
input raises ValueError naming the service, the field, what was found and what was expected (the
filter file plugins/filter/inference.py turns it into AnsibleFilterError).
"""

from __future__ import annotations

import difflib
import ipaddress
import re
import string
from collections.abc import Mapping
from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.jobs import USER_NAME

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


# What a GGUF model's KV cache is made of (engine llamacpp: its GGUF header's, gguf_header.py, or the
# service's model_shape): per layer and token, K and V of kv_heads x head_dim elements. The guide's 70B
# (Llama-2/3 70B): 80 layers, 8 KV heads, 128.
MODEL_SHAPE_KEYS = ("layers", "kv_heads", "head_dim")


# llama-server's KV cache type (-ctk/-ctv, default f16): bytes of one element.
LLAMACPP_KV_BYTES = 2


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
    # engine llamacpp: a worker over this many of the service's nodes, in their order (see _bad_spanning).
    "nodes_per_worker": 1,
    # engine llamacpp: {layers, kv_heads, head_dim} of the GGUF's model where its header lacks them, for its KV
    # cache (MODEL_SHAPE_KEYS; preflight reads them from the header and refuses a model_shape that differs);
    # tensor_split: each GPU's share of a worker's layers in llama-server's device order (None: by memory).
    "model_shape": None,
    "tensor_split": None,
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
    "nodes_per_worker": 1,
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


def rpc_unit_name(name: str, slot: int | str = "") -> str:
    """Return a llama.cpp RPC server's unit: "budgetgpu-infer-<name>.rpc@<slot>.service" (no slot: the
    template). No service name holds a dot, so it is no service's worker; the prefix is the workers'
    (role gpu_power's drop-in for "budgetgpu-infer-" orders it after the power caps too)."""
    return f"{UNIT_PREFIX}{name}.rpc@{slot}.service"


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
    if isinstance(merged.get("model_shape"), Mapping):
        merged["model_shape"] = {key: _as_int(value) for key, value in merged["model_shape"].items()}
    if isinstance(merged.get("tensor_split"), list):
        merged["tensor_split"] = [_as_float(share) for share in merged["tensor_split"]]
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


def _bad_spanning(service: Mapping[str, Any]) -> list[str]:
    """A worker over several nodes, and what its memory check needs to know.

    nodes_per_worker, a count like gpus_per_worker rather than a list of node lists: the service's
    nodes (its group in inventory order, or its list) form workers of that many consecutive nodes, so
    a group that grows by whole workers needs no edit of the service, and one key says the size the
    memory check splits over. The first node of each is the head (llama-server --rpc, the gateway's
    upstream); the others run llama.cpp's RPC server on the same GPUs a single-node worker would get
    (gpus, gpus_per_worker). Only llama.cpp splits one model over nodes (its RPC backend); the split is
    by layer, so preflight needs the model's shape: its GGUF header's, or model_shape (checks._gguf_need
    refuses a worker over nodes without one). tensor_split: one share per GPU of a worker, in
    llama-server's device order (the RPC nodes' GPUs in node order, then the head's own)."""
    bad, engine = [], service.get("engine")
    per_node, shape, split = service.get("nodes_per_worker"), service.get("model_shape"), service.get("tensor_split")
    if engine != "llamacpp":
        if _is_int(per_node) and per_node > 1:
            bad.append(
                f"nodes_per_worker: found {per_node} with engine {engine}, expected 1: only engine llamacpp "
                "serves one model from several nodes (llama.cpp's RPC backend)"
            )
        bad += [
            f"{key}: found {service.get(key)!r} with engine {engine}, expected none (engine llamacpp's)"
            for key in ("model_shape", "tensor_split")
            if service.get(key) is not None
        ]
        return bad
    if shape is not None and not (
        isinstance(shape, Mapping)
        and set(shape) == set(MODEL_SHAPE_KEYS)
        and all(_is_int(shape[key]) and shape[key] > 0 for key in MODEL_SHAPE_KEYS)
    ):
        bad.append(
            f"model_shape: found {shape!r}, expected {{layers, kv_heads, head_dim}} of the GGUF's model as whole "
            "numbers (the guide's Llama 70B: {layers: 80, kv_heads: 8, head_dim: 128})"
        )
    if split is not None:
        gpus = service.get("gpus_per_worker")
        wanted = per_node * gpus if _is_int(per_node) and _is_int(gpus) else None
        shares_ok = isinstance(split, list) and all(
            isinstance(share, int | float) and not isinstance(share, bool) and share >= 0 for share in split
        )
        if not shares_ok or not sum(split) > 0 or (wanted and len(split) != wanted):
            bad.append(
                f"tensor_split: found {split!r}, expected {f'{wanted} ' if wanted else ''}shares of 0 or more, not "
                f"all 0, one per GPU of a worker (nodes_per_worker {per_node} x gpus_per_worker {gpus}) in "
                "llama-server's device order: the RPC nodes' GPUs, then the head's"
            )
    return bad


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
        *_bad_spanning(service),
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
