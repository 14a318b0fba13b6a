"""What a service's model needs of a GPU: its shape from config.json, its weights at the service's
dtype and quantisation, the KV cache of its context, split over a worker's GPUs; for llama.cpp, a
GGUF file's layers and their KV cache on each GPU of a worker, over one node or several."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping
from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.placement import (
    _per_worker,
    llamacpp_devices,
    llamacpp_tensor_split,
)
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.services import (
    CUDA_CONTEXT_BYTES,
    DTYPE_BYTES,
    GATED_MODELS,
    GIB,
    LLAMACPP_KV_BYTES,
    QUANT_BYTES,
    UNTIED_MODELS,
    VLLM_QUANT_BYTES,
    _is_int,
    llamacpp_context,
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


def llamacpp_layers(split: list[Any], layers: int) -> list[list[int]]:
    """Return the layers each device of a llama.cpp worker holds with -ngl all, as llama.cpp assigns
    them (llama_model::load_tensors): layer il of layers + 1 (the last, il = layers, is the output layer)
    goes to the first device whose cumulative share of the split exceeds il / (layers + 1)."""
    total = sum(split)
    points = list(itertools.accumulate(share / total for share in split))
    held: list[list[int]] = [[] for _share in split]
    for layer in range(layers + 1):
        held[min(bisect.bisect_right(points, layer / (layers + 1)), len(split) - 1)].append(layer)
    return held


def _layer_text(held: list[int], layers: int) -> str:
    """Layers 0-20 of 80, layers 61-79 of 80 + the output layer, the output layer only, no layer."""
    repeating = [layer for layer in held if layer < layers]
    text = f"layers {repeating[0]}-{repeating[-1]} of {layers}" if repeating else ""
    if layers in held:
        text = f"{text} + the output layer" if text else "the output layer only"
    return text or "no layer"


def llamacpp_gpu_needs(
    service: Mapping[str, Any],
    gguf_bytes: int,
    layout: list[tuple[str, list[dict[str, Any]]]],
    slot: int = 0,
    shape: Mapping[str, int] | None = None,
) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """Return (node, GPU, need) for each GPU of one llama.cpp worker (layout: worker_layouts' entry), in
    llama-server's device order. The GGUF's weights go by layer: the file over the model's layers + the
    output layer, each the same size (the input embeddings, which llama.cpp keeps on the CPU, counted in:
    the check errs on refusing); each repeating layer holds its KV cache: 2 (K and V) x kv_heads x
    head_dim x 2 B (f16) x llamacpp_context tokens (-c: every slot's context). shape: {layers, kv_heads,
    head_dim} (the GGUF header's, or the service's model_shape: checks._gguf_shape); without it the layers
    are unknown: the weights go by the split's shares and the KV cache is not counted (the text says so).
    Each GPU adds a CUDA context. slot: the worker's, for the text. need:
    {per_gpu_bytes, weights_bytes, kv_cache_bytes, gpus, layers, hint, text}."""
    devices = llamacpp_devices(layout)
    split = llamacpp_tensor_split(service, [gpu for _host, gpu in devices])
    shown = ":".join(f"{share:g}" for share in split)
    where = f"of {len(devices)} of worker {layout[0][0]}@{slot} (tensor split {shown})"
    hint = (
        " (or more nodes_per_worker or gpus_per_worker, a tensor_split that gives this GPU less, fewer slots "
        "(concurrency) or a shorter max_input_tokens + max_new_tokens)"
    )
    context, needs = _gib(CUDA_CONTEXT_BYTES), []
    if shape is None:
        total = sum(split)
        for number, (host, gpu) in enumerate(devices):
            weights = int(gguf_bytes * split[number] / total)
            per_gpu = weights + CUDA_CONTEXT_BYTES
            text = (
                f"{_gib(per_gpu)} (device {number} {where}: GGUF {_gib(gguf_bytes)} x {split[number]:g}/{total:g}"
                f" = {_gib(weights)} + {context} CUDA context; KV cache not counted: neither the GGUF header nor "
                "model_shape gives the model's shape)"
            )
            need = {"per_gpu_bytes": per_gpu, "weights_bytes": weights, "kv_cache_bytes": 0, "layers": None}
            needs.append((host, gpu, {**need, "gpus": len(devices), "hint": hint, "text": text}))
        return needs
    layers, tokens = shape["layers"], llamacpp_context(service)
    per_layer_kv = 2 * shape["kv_heads"] * shape["head_dim"] * LLAMACPP_KV_BYTES * tokens
    formula = f"2 x {shape['kv_heads']} KV heads x {shape['head_dim']} x {LLAMACPP_KV_BYTES} B x {tokens} tokens"
    for number, ((host, gpu), held) in enumerate(zip(devices, llamacpp_layers(split, layers), strict=True)):
        weights = gguf_bytes * len(held) // (layers + 1)
        repeating = len([layer for layer in held if layer < layers])
        kv_cache = per_layer_kv * repeating
        per_gpu = weights + kv_cache + CUDA_CONTEXT_BYTES
        text = (
            f"{_gib(per_gpu)} ({_layer_text(held, layers)} on device {number} {where}: GGUF "
            f"{_gib(gguf_bytes)} x {len(held)}/{layers + 1} layers = {_gib(weights)} + KV cache {repeating} layers x "
            f"{_gib(per_layer_kv)} ({formula}) = {_gib(kv_cache)} + {context} CUDA context)"
        )
        need = {"per_gpu_bytes": per_gpu, "weights_bytes": weights, "kv_cache_bytes": kv_cache, "layers": held}
        needs.append((host, gpu, {**need, "gpus": len(devices), "hint": hint, "text": text}))
    return needs
