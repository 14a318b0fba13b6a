"""tests/fixtures/tiny_gguf.py: the tiny GPT-2 of tiny_lm.py as one GGUF file, which llama.cpp's
llama-server reads (inference services of engine llamacpp). Read back with the gguf package's own
reader: the architecture, the tokenizer llama.cpp needs (its pre-tokenizer named, every token and
merge), the chat template, and every tensor at the shape llama.cpp's GPT-2 loader expects."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.gguf_header import gguf_header

gguf = pytest.importorskip("gguf", reason="gguf (requirements.txt) is not installed")
pytest.importorskip("torch", reason="torch (CPU) from .cache/wheelhouse is not installed in this venv")
pytest.importorskip("transformers", reason="transformers (tests/unit/requirements.txt) is not installed")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, FIXTURES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def text(reader, key: str) -> str:
    field = reader.fields[key]
    return bytes(field.parts[field.data[0]]).decode()


def test_the_tiny_gpt2_as_one_gguf_file(tmp_path):
    model_dir = _load("tiny_lm").build_tiny_lm(tmp_path / "tiny-lm")
    out = _load("tiny_gguf").build_tiny_gguf(model_dir, tmp_path / "tiny.gguf")
    config = json.loads((model_dir / "config.json").read_text())
    vocab = json.loads((model_dir / "tokenizer.json").read_text())
    reader = gguf.GGUFReader(out)

    assert text(reader, "general.architecture") == "gpt2"
    assert text(reader, "tokenizer.ggml.model") == "gpt2" and text(reader, "tokenizer.ggml.pre") == "gpt-2"
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == config["vocab_size"]
    assert len(reader.fields["tokenizer.ggml.merges"].data) == len(vocab["model"]["merges"])
    assert "tokenizer.chat_template" in reader.fields
    tensors = {t.name: [int(n) for n in t.shape] for t in reader.tensors}
    # GGUF lists a tensor's dimensions innermost first: token_embd is n_embd x n_vocab.
    assert tensors["token_embd.weight"] == [config["n_embd"], config["vocab_size"]]
    assert tensors["position_embd.weight"] == [config["n_embd"], config["n_positions"]]
    blocks = {name.split(".")[1] for name in tensors if name.startswith("blk.")}
    assert blocks == {str(i) for i in range(config["n_layer"])}
    assert len(tensors) == 4 + 12 * config["n_layer"] + (1 if "output.weight" in tensors else 0)
    # Preflight reads the model's shape from this header (filter inference_gguf_header): GPT-2 has no
    # head_count_kv (as many KV heads as heads) and no key_length (n_embd / n_head).
    assert gguf_header(str(out)) == {
        "architecture": "gpt2",
        "layers": config["n_layer"],
        "kv_heads": config["n_head"],
        "head_dim": config["n_embd"] // config["n_head"],
        "keys": {
            "layers": "gpt2.block_count",
            "kv_heads": "gpt2.attention.head_count",
            "head_dim": "gpt2.embedding_length / gpt2.attention.head_count",
        },
    }
