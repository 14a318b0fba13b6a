"""A GGUF model's shape from its header: layers, KV heads and head size, which place a llama.cpp worker's
layers and their KV cache on its GPUs (memory.llamacpp_gpu_needs). Read on the control node, where the
models are, with llama.cpp's own reader, the Python package gguf (requirements.txt): the format is
llama.cpp's, so its library reads it, not a parser of ours."""

from __future__ import annotations

import sys
from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.services import _is_int

# Each model_shape key's metadata key under the GGUF's architecture (general.architecture): the first
# that is a positive whole number; head_dim falls back to embedding_length / head_count below.
SHAPE_METADATA = {
    "layers": ("block_count",),
    # Grouped-query attention has fewer key/value heads; a header without head_count_kv has as many as heads.
    "kv_heads": ("attention.head_count_kv", "attention.head_count"),
    "head_dim": ("attention.key_length",),
}


def gguf_header(path: str) -> dict[str, Any]:
    """Return what the GGUF file at path says of its model's shape: {architecture, layers, kv_heads,
    head_dim, keys}, each shape key present where the header gives it, keys naming the metadata key each
    came from; or {error} where the file cannot be read (the package gguf missing, not a GGUF file)."""
    try:
        import gguf  # pylint: disable=import-outside-toplevel  # a controller requirement only preflight needs
    except ImportError:
        return {
            "error": f"found no Python package gguf in the control node's Python {sys.executable}, expected it to "
            f"read the GGUF header (llama.cpp's reader): run {sys.executable} -m pip install -r requirements.txt "
            "(the collection's, which pins gguf)"
        }
    try:
        reader = gguf.GGUFReader(path, "r")
    except (OSError, ValueError, IndexError) as error:
        return {"error": f"found a file whose GGUF header cannot be read ({error}), expected a GGUF model file"}

    def value(key: str) -> Any:
        field = reader.get_field(key)
        return None if field is None else field.contents()

    arch = value("general.architecture")
    header: dict[str, Any] = {"architecture": arch, "keys": {}}
    for name, suffixes in SHAPE_METADATA.items():
        for key in [f"{arch}.{suffix}" for suffix in suffixes]:
            number = value(key)
            if _is_int(number) and number > 0:
                header[name], header["keys"][name] = number, key
                break
    embedding, heads = value(f"{arch}.embedding_length"), value(f"{arch}.attention.head_count")
    if "head_dim" not in header and all(_is_int(n) and n > 0 for n in (embedding, heads)) and embedding % heads == 0:
        header["head_dim"] = embedding // heads
        header["keys"]["head_dim"] = f"{arch}.embedding_length / {arch}.attention.head_count"
    return header
