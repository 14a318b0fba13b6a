"""Measured memory of GPT-2 models trained under FSDP2 at world size 1: ground truth for a training memory planner.

The issue "Models bigger than one GPU" asks preflight to predict, per GPU, the bytes of weights, gradients and
optimizer states (16 a parameter for fp32 AdamW), one gathered block and the activations, within 15% of the
measured peak. This program measures those parts on a real GPU, for the guide's GPT-2 sizes, so that the planner
can be held against them. Each case builds GPT-2 from its config (transformers, random weights, nothing
downloaded), wraps every block and then the root in `fully_shard` over an explicit one-GPU mesh (NCCL at world
size 1, or gloo on CPU for a dry run), trains a few AdamW steps on random tokens and prints one JSON line:
parameters, the memory after the model, after the first step (weights + gradients + optimizer states) and the
peak (`torch.cuda.max_memory_allocated`), and the time of a step.

    python3 tests/benchmarks/fsdp_memory.py --cases gpt2-124m,gpt2-1.5b            # on a GPU node
    python3 tests/benchmarks/fsdp_memory.py --device cpu --cases tiny --steps 2     # the code path, on CPU

Variants (--variants): `fsdp-bf16` (MixedPrecisionPolicy param bf16, reduce fp32), `fsdp-bf16-ckpt` (and
activation checkpointing), `fsdp-bf16-states` (the model itself in bf16: weights, gradients and AdamW states in
bf16, the job model's state_precision bf16), `fsdp-fp32`, `plain-fp32` (no FSDP: what a DDP rank holds). Runs as
one process; it
sets up its own process group (a free loopback port).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
from budgetgpu_node.gpt2 import GPT2_SIZES, GPT2_TINY  # tests/benchmarks/device-check.sh puts it on PYTHONPATH

# GPT-2's shapes as the example trainer and the planner read them (layers, width, heads); "tiny" is for a dry run
# on CPU (built here with GPT-2's vocabulary and context, as every case: the trainer's tiny one has bytes).
PRESETS = {
    name: (size["layers"], size["width"], size["heads"])
    for name, size in ({"tiny": GPT2_TINY} | {f"gpt2-{key}": value for key, value in GPT2_SIZES.items()}).items()
}
VARIANTS = ("fsdp-bf16", "fsdp-bf16-ckpt", "fsdp-bf16-states", "fsdp-fp32", "plain-fp32")
# Each variant as the job model says it (plugin_utils/training_memory.py plans it at world size 1: plain-fp32,
# no wrapper at all, is an unsharded fp32 rank without DDP's buckets).
JOB_OPTIONS = {
    "fsdp-bf16": {"mixed_precision": "bf16", "state_precision": "fp32", "activation_checkpointing": False},
    "fsdp-bf16-ckpt": {"mixed_precision": "bf16", "state_precision": "fp32", "activation_checkpointing": True},
    "fsdp-bf16-states": {"mixed_precision": "bf16", "state_precision": "bf16", "activation_checkpointing": False},
    "fsdp-fp32": {"mixed_precision": "none", "state_precision": "fp32", "activation_checkpointing": False},
    "plain-fp32": {"mixed_precision": "none", "state_precision": "fp32", "activation_checkpointing": False},
}


def planned_peak(preset: str, variant: str, batch: int, seq: int) -> int | None:
    """The training memory planner's peak for the case, where the collection is importable (a checkout)."""
    try:
        from ansible_collections.budgetgpu.cluster.plugins.plugin_utils import training_memory
    except ImportError:
        return None
    if preset not in training_memory.PRESETS:
        return None
    # This benchmark builds Hugging Face's GPT2LMHeadModel at the preset's shape (a preset alone is the example
    # trainer's GPT-2).
    spec = training_memory.model_spec(
        {"preset": preset, "batch_size": batch, "seq_len": seq, "implementation": "transformers"}
    )
    return round(training_memory.rank_plan(spec, {"parallelism": "fsdp", **JOB_OPTIONS[variant]}, 1)["peak"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(preset: str, variant: str, device: torch.device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, width, heads = PRESETS[preset]
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=1024, vocab_size=50257, use_cache=False)
    with device:
        model = GPT2LMHeadModel(config)
    if variant.endswith("-ckpt"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if variant.endswith("-states"):
        model.to(torch.bfloat16)
    if variant.startswith("fsdp"):
        # The mesh named explicitly: a default gloo group on a GPU host moved the model to CUDA (pytorch#132471).
        mesh = init_device_mesh(device.type, (1,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kwargs = {"mesh": mesh, **({"mp_policy": policy} if "bf16" in variant else {})}
        for block in model.transformer.h:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
    return model, config


def measure(preset: str, variant: str, batch: int, seq: int, steps: int, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    # FSDP's modules hold reference cycles: the previous case's tensors are freed only by a collection, and
    # would otherwise count in this case's base and be freed during it.
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    allocated = torch.cuda.memory_allocated if cuda else (lambda: 0)
    base = allocated()
    model, config = build(preset, variant, device)
    params = sum(p.numel() for p in model.parameters())
    after_model = allocated() - base
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator(device="cpu").manual_seed(0)
    times, after_step = [], 0
    for step in range(steps):
        tokens = torch.randint(0, config.vocab_size, (batch, seq), generator=generator).to(device)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # gradients stay allocated, as in a training loop that keeps them
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if step == 0:
            after_step = allocated() - base
    peak = (torch.cuda.max_memory_allocated() - base) if cuda else 0
    planned = planned_peak(preset, variant, batch, seq)
    result = {
        "case": preset, "variant": variant, "base_bytes": base, "layers": config.n_layer, "width": config.n_embd,
        "batch": batch, "seq": seq, "params": params, "model_bytes": after_model, "state_bytes": after_step,
        "peak_bytes": peak, "state_bytes_per_param": round(after_step / params, 2), "planned_peak_bytes": planned,
        "planned_over_measured": round(planned / peak, 3) if planned and peak else None,
        "step_s": round(sorted(times)[len(times) // 2], 4), "loss": round(float(loss.detach()), 3),
    }  # fmt: skip
    del model, optimizer, loss
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--cases", default="gpt2-124m,gpt2-355m,gpt2-1.5b", help="presets: " + ", ".join(PRESETS))
    parser.add_argument("--variants", default=",".join(VARIANTS), help="of: " + ", ".join(VARIANTS))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args(argv)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("fsdp_memory: no CUDA device (use --device cpu for a dry run)", file=sys.stderr)
        return 2
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    status = 0
    try:
        for preset in args.cases.split(","):
            for variant in args.variants.split(","):
                try:
                    print(json.dumps(measure(preset, variant, args.batch, args.seq, args.steps, device)), flush=True)
                except Exception as exc:  # one case failing (out of memory, an API change) must not hide the rest
                    status = 1
                    print(json.dumps({"case": preset, "variant": variant, "error": repr(exc)[:300]}), flush=True)
    finally:
        dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
