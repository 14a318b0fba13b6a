"""GPT-2's sizes, in one table: the example trainer (roles/torchrun/files/train_ddp.py --model gpt2) builds its
model from them, and the training memory planner (plugin_utils/training_memory.py) plans its presets gpt2-124m ...
gpt2-1.5b from the same numbers.

Part of the node package (on the job venv's path as budgetgpu_node.gpt2); the controller imports it too. Plain
Python: no torch.
"""

from __future__ import annotations

from collections.abc import Mapping

# OpenAI's released GPT-2 sizes: blocks, width, attention heads, GPT-2's BPE vocabulary and its 1024-token
# context. The guide's benchmark table trains the 1.5B.
GPT2_SIZES: dict[str, dict[str, int]] = {
    "124m": {"layers": 12, "width": 768, "heads": 12, "vocab": 50257, "seq_len": 1024},
    "355m": {"layers": 24, "width": 1024, "heads": 16, "vocab": 50257, "seq_len": 1024},
    "774m": {"layers": 36, "width": 1280, "heads": 20, "vocab": 50257, "seq_len": 1024},
    "1.5b": {"layers": 48, "width": 1600, "heads": 25, "vocab": 50257, "seq_len": 1024},
}
# A GPT-2 for tests on CPU: bytes as tokens (a vocabulary of 256) and a 64-token context.
GPT2_TINY: dict[str, int] = {"layers": 2, "width": 64, "heads": 2, "vocab": 256, "seq_len": 64}


def gpt2_params(size: Mapping[str, int]) -> int:
    """The parameters of a GPT-2 of this size: token and position embeddings (the output head is the token
    embedding, tied), per block two LayerNorms (4 w), attention (4 w^2 + 4 w) and MLP (8 w^2 + 5 w), and the
    final LayerNorm (2 w)."""
    width = size["width"]
    block = 12 * width**2 + 13 * width
    return (size["vocab"] + size["seq_len"]) * width + size["layers"] * block + 2 * width
