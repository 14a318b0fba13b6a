"""What a service's model needs of a GPU: its shape from config.json, its weights at the service's
dtype and quantisation, the KV cache of its context, split over a worker's GPUs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.placement import _per_worker
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.services import (
    CUDA_CONTEXT_BYTES,
    DTYPE_BYTES,
    GATED_MODELS,
    GIB,
    QUANT_BYTES,
    UNTIED_MODELS,
    VLLM_QUANT_BYTES,
    _is_int,
)


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
