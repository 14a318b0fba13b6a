#!/usr/bin/env python3
"""budgetgpu's example DDP job: the guide's train_distributed.py, made to survive crashes.

Launch it with torchrun (the budgetgpu-job-<name> unit does):

    torchrun --nproc-per-node=4 --nnodes=2:2 --rdzv-backend=c10d --rdzv-endpoint=node1:29500 \\
        --rdzv-id=demo train_ddp.py --max-steps 100000

An MLP learns a fixed random "teacher" on synthetic data (the same for a given seed and step, so
a resumed run sees the data it would have seen), with gradient clipping. By default it is small; with
`--hidden 2048 --layers 3` it has 12.6 M parameters (50 MB of gradients per step), enough for the
all-reduce to show on a slow network. `--model gpt2 --gpt2-size tiny|124m|355m|774m|1.5b` trains GPT-2 instead,
the guide's benchmark row at 1.5b: its architecture in plain torch with random weights (nothing downloaded), on
real text that ships with Python (the reference manual's help topics, pydoc_data) tokenised as bytes, each rank
from its own shard of the text (docs/training.md). Batches come from a DataLoader with `--data-workers` worker
processes; `--data-delay` slows each batch on purpose (a loader that does not keep up); a batch is drawn from the
seed, the micro-batch's number and the rank, so the step is the data position. NCCL on GPUs, gloo on CPU.

The job's side of the contract is budgetgpu_node.training's Job (the node package on the job venv's path, which a
user's own script uses the same way: README.md); this script adds its models, data and options. Every node's
local rank 0 writes a checkpoint every N minutes and/or steps, atomically
(temporary file, fsync, rename); at start all ranks agree on the newest checkpoint any node has
and load it from that node, so a node with an empty disk rejoins too. SIGTERM (systemctl stop)
on any node stops every rank at the same step boundary, with a checkpoint of that one step on
every node; the ranks of a node that was not stopped exit 75 and wait for it to come back. Log
lines are `key=value`, for people and tests:

    resumed from step 120 (checkpoint /var/lib/budgetgpu/jobs/demo/checkpoints/step-00000120.pt)
    step=130 loss=0.4312 world=4 restarts=1 steps_per_s=9.8
    checkpoint step=140 path=/var/lib/budgetgpu/jobs/demo/checkpoints/step-00000140.pt
    straggler: rank 5 (node2 GPU 1): 31% slower than the median over the last 200 steps

DDP all-reduces the gradients in buckets during backward, with the job's gradient compression and
bucket size, and accumulates gradients over accumulate_steps micro-batches (budgetgpu_node.straggler's
wrap_ddp, the node package on the job venv's path). Each rank splits its step into compute, communication that
backward did not hide, and waiting for data; every N steps rank 0 names the slowest rank against the
median, and writes the job's status (step, steps per second since the last report, the latest
straggler line, each rank's breakdown and the straggler ratio) to a JSON file that the health watch
exports as metrics and `playbooks/train.yml -e job_state=status` reads.

Defaults come from the environment the unit sets (budgetgpu_node.training.JobSettings.from_env):
BUDGETGPU_CHECKPOINT_DIR, BUDGETGPU_CHECKPOINT_EVERY_MINUTES, BUDGETGPU_CHECKPOINT_EVERY_STEPS, BUDGETGPU_DIST_BACKEND,
BUDGETGPU_STRAGGLER_EVERY_STEPS, BUDGETGPU_STATUS_FILE, and the communication settings
(budgetgpu_node.straggler.CommSettings.from_env: BUDGETGPU_GRADIENT_COMPRESSION, BUDGETGPU_POWERSGD_RANK,
BUDGETGPU_POWERSGD_START_STEP, BUDGETGPU_BUCKET_CAP_MB, BUDGETGPU_ACCUMULATE_STEPS).

How the model is spread comes from the job too (budgetgpu_node.sharding.ShardSettings.from_env:
BUDGETGPU_PARALLELISM, BUDGETGPU_MIXED_PRECISION, BUDGETGPU_STATE_PRECISION,
BUDGETGPU_ACTIVATION_CHECKPOINTING). Under fsdp or hsdp every rank holds only its shards of the model, its
gradients and its optimizer state, and every rank writes its shards of each checkpoint
(step-<step>.dcp, a directory: torch.distributed.checkpoint), which the ranks load again at whatever world size
the job restarts with (fsdp over several nodes: on the same layout, or from a directory every node shares);
hsdp keeps a whole checkpoint on each node. At start the ranks take the newest step every node holds.

A job restarted on fewer ranks than it plans (the health watch took a GPU out, and the launcher started one rank
per GPU still in service) resumes from its newest checkpoint as any restart does, keeps its global batch by
raising accumulate_steps where the new world size divides the planned one (budgetgpu_node.sharding's
keep_global_batch: the launcher's BUDGETGPU_PLANNED_LOCAL_WORLD_SIZE is what each node planned), and says so in
its log (`world changed: ...`) and status (world, planned_world, world_change).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import signal
import time
import traceback
from functools import partial
from typing import Any

import torch

# Installed beside this script (the script's directory is the first entry of sys.path).
from budgetgpu_node.gpt2 import GPT2_SIZES, GPT2_TINY
from budgetgpu_node.sharding import Wrapped, local_shard_numel
from budgetgpu_node.training import Dist, Job, JobSettings, exit_process, log
from torch import nn
from torch.utils.data import DataLoader, Dataset

FEATURES, CLASSES = 32, 4
# --gpt2-size: the test size and GPT-2's released ones (budgetgpu_node.gpt2, the memory planner's table too).
GPT2 = {"tiny": GPT2_TINY, **GPT2_SIZES}
# Each model's defaults: the MLP's plain SGD, GPT-2's AdamW (the optimizer the memory planner plans: 16 bytes a
# parameter in fp32) and a micro-batch of 4 contexts (the planner's gpt2-1.5b example).
MODEL_DEFAULTS = {"mlp": {"lr": 0.05, "batch_size": 64}, "gpt2": {"lr": 6e-4, "batch_size": 4}}


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model's options (the learning rate and batch size default by model: MODEL_DEFAULTS)."""
    parser.add_argument(
        "--model", choices=tuple(MODEL_DEFAULTS), default="mlp", help="an MLP on synthetic data, or GPT-2 on text"
    )
    parser.add_argument("--gpt2-size", choices=tuple(GPT2), default="tiny", help="--model gpt2: GPT-2's size")
    parser.add_argument(
        "--batch-size", type=int, help="samples (gpt2: contexts) per process and micro-batch; mlp 64, gpt2 4"
    )
    parser.add_argument("--lr", type=float, help="learning rate; mlp 0.05 (SGD), gpt2 6e-4 (AdamW)")
    parser.add_argument("--hidden", type=int, default=64, help="width of the MLP's hidden layers")
    parser.add_argument(
        "--layers", type=int, default=0, help="hidden x hidden layers between input and output (3 with 2048: 50 MB)"
    )


def add_job_arguments(parser: argparse.ArgumentParser, unit: JobSettings) -> None:
    """The job's options (budgetgpu_node.training.JobSettings), each defaulting to what the unit's environment says."""
    parser.add_argument("--log-every", type=int, default=unit.log_every, help="rank 0 logs every N steps")
    parser.add_argument("--checkpoint-dir", default=unit.checkpoint_dir)
    parser.add_argument(
        "--checkpoint-every-minutes",
        type=float,
        default=unit.checkpoint_every_minutes,
        help="0 turns the time-based checkpoint off",
    )
    parser.add_argument(
        "--checkpoint-every-steps",
        type=int,
        default=unit.checkpoint_every_steps,
        help="0 turns the step-based checkpoint off",
    )
    parser.add_argument(
        "--keep-checkpoints", type=int, default=unit.keep_checkpoints, help="how many checkpoints each node keeps"
    )
    parser.add_argument("--backend", choices=("auto", "nccl", "gloo"), default=unit.backend)
    parser.add_argument(
        "--straggler-every-steps",
        type=int,
        default=unit.straggler_every_steps,
        help="rank 0 compares the ranks' compute times every N steps; 0 turns it off",
    )
    parser.add_argument(
        "--status-file",
        default=unit.status_file,
        help="rank 0 writes the job's status (JSON) here at every log line; empty: none",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    try:
        unit = JobSettings.from_env()
    except ValueError as err:
        parser.error(str(err))
    parser.add_argument("--max-steps", type=int, default=1000, help="stop after this many optimizer steps")
    add_model_arguments(parser)
    parser.add_argument("--data-workers", type=int, default=1, help="DataLoader worker processes (0: in the rank)")
    parser.add_argument(
        "--data-delay", type=float, default=0.0, help="seconds each batch takes to load, on purpose (a slow loader)"
    )
    parser.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (tests, demos)")
    add_job_arguments(parser, unit)
    args = parser.parse_args(argv)
    for key, value in MODEL_DEFAULTS[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.max_steps < 0 or args.log_every < 1 or args.keep_checkpoints < 1 or args.straggler_every_steps < 0:
        parser.error("--max-steps and --straggler-every-steps must be >= 0, --log-every and --keep-checkpoints >= 1")
    if args.layers < 0 or args.data_workers < 0 or args.data_delay < 0:
        parser.error("--layers, --data-workers and --data-delay must be >= 0")
    options = {field.name: getattr(args, field.name) for field in dataclasses.fields(unit) if hasattr(args, field.name)}
    args.job = dataclasses.replace(unit, **options)
    return args


# --- model and data ------------------------------------------------------------------------


def make_model(hidden: int, seed: int, layers: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    middle: list[nn.Module] = []
    for _layer in range(layers):
        middle += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), *middle, nn.Linear(hidden, CLASSES))


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        heads = (t.view(batch, seq, self.heads, width // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        attended = nn.functional.scaled_dot_product_attention(*heads, is_causal=True)
        return self.proj(attended.transpose(1, 2).reshape(batch, seq, width))


class Block(nn.Module):
    """GPT-2's block: LayerNorm before attention and before the MLP, each added to the residual stream."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT2Model(nn.Module):
    """GPT-2's architecture from a size of budgetgpu_node.gpt2 (layers, width, heads, vocab, seq_len), with
    GPT-2's initialisation and random weights: token and position embeddings, the blocks (a ModuleList: the units
    budgetgpu_node.sharding's blocks_of finds, that FSDP shards one by one), a final LayerNorm, and an output head
    tied to the token embedding."""

    def __init__(self, size: dict[str, int]) -> None:
        super().__init__()
        width = size["width"]
        self.tokens = nn.Embedding(size["vocab"], width)
        self.positions = nn.Embedding(size["seq_len"], width)
        self.blocks = nn.ModuleList(Block(width, size["heads"]) for _block in range(size["layers"]))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, size["vocab"], bias=False)
        self.head.weight = self.tokens.weight
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif param.dim() > 1:
                # GPT-2 scales the projections into the residual stream by 1/sqrt(2 x layers).
                residual = name.endswith(("attn.proj.weight", "mlp.2.weight"))
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * size["layers"]) if residual else 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def batch_generator(seed: int, micro: int, rank: int) -> torch.Generator:
    """The random numbers of micro-batch `micro` of `rank`: the same for a given seed, so a resumed run sees the
    data an uninterrupted one would have."""
    return torch.Generator().manual_seed(seed * 1_000_003 + micro * 1009 + rank)


def synthetic_batch(seed: int, step: int, rank: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the batch of (step, rank): inputs and the labels a fixed random teacher gives them."""
    teacher = torch.Generator().manual_seed(seed)
    weights = torch.randn(FEATURES, CLASSES, generator=teacher)
    inputs = torch.randn(batch, FEATURES, generator=batch_generator(seed, step, rank))
    return inputs, (inputs @ weights).argmax(dim=1)


def text_tokens() -> torch.Tensor:
    """The corpus, tokenised as bytes (0-255): the English text of the Python reference manual's help topics,
    which ships with every CPython in its standard library (pydoc_data.topics, about 460 KB; the PSF licence),
    its topics in order of name. Every rank reads the same text on a node (the job venv's Python)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[name] for name in sorted(topics))
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).long()


def text_batch(
    tokens: torch.Tensor, seed: int, world: int, context: int, micro: int, rank: int, batch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return micro-batch `micro` of `rank`: `batch` windows of `context` tokens from the rank's shard of the
    text (the windows that start at rank, rank + world, rank + 2 world, ...) and each token's next token."""
    starts = (len(tokens) - context - 1 - rank) // world + 1
    first = torch.randint(starts, (batch, 1), generator=batch_generator(seed, micro, rank)) * world + rank
    windows = tokens[first + torch.arange(context + 1)]
    return windows[:, :-1], windows[:, 1:]


class Batches(Dataset):
    """The batches of one rank from micro-batch `first` on (batch_of(micro, rank, batch)), each `delay` seconds
    late on purpose; a DataLoader's workers build them while the rank trains."""

    def __init__(self, batch_of: Any, rank: int, batch: int, first: int, count: int, delay: float = 0.0) -> None:
        self.batch_of, self.rank, self.batch, self.first, self.count = batch_of, rank, batch, first, count
        self.delay = delay

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay:
            time.sleep(self.delay)
        return self.batch_of(self.first + index, self.rank, self.batch)


def _quiet_worker(_worker_id: int) -> None:
    # systemd's stop sends SIGTERM to every process of the unit: a loader worker that died of it would
    # fail the rank's next batch before the rank could checkpoint. The rank stops its workers itself.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def batches(args: argparse.Namespace, rank: int, step: int, accumulate: int, world: int = 1) -> DataLoader:
    """The loader of the micro-batches after `step` (micro-batch n of step s is (s - 1) * accumulate + n): the
    MLP's synthetic ones, or GPT-2's windows of the text from this rank's shard of it."""
    first, count = step * accumulate + 1, max(args.max_steps - step, 0) * accumulate
    if args.model == "gpt2":
        batch_of = partial(text_batch, text_tokens(), args.seed, world, GPT2[args.gpt2_size]["seq_len"])
    else:
        batch_of = partial(synthetic_batch, args.seed)
    dataset = Batches(batch_of, rank, args.batch_size, first, count, args.data_delay)
    workers = args.data_workers
    return DataLoader(dataset, batch_size=None, num_workers=workers, worker_init_fn=_quiet_worker if workers else None)


# --- the loop ------------------------------------------------------------------------------


def train_step(wrapped: Wrapped, optimizer: torch.optim.Optimizer, data: Any, ctx: Dist, clip: float) -> torch.Tensor:
    """One optimizer step over accumulate_steps micro-batches from data; return the last one's loss.
    DDP all-reduces the gradients in buckets during the last backward (the earlier ones run under
    no_sync), so communication overlaps compute; FSDP reduce-scatters them; the timer splits the step
    (budgetgpu_node.straggler)."""
    timer = wrapped.timer
    optimizer.zero_grad(set_to_none=True)
    loss = torch.zeros(())
    for fwd_bwd in wrapped.micro_batches():
        with timer.data():
            inputs, labels = next(data)
        with fwd_bwd:
            logits = wrapped.forward(inputs.to(ctx.device))
            # GPT-2's logits are (batch, context, vocab): every position predicts its next token.
            loss = nn.functional.cross_entropy(logits.float().flatten(0, -2), labels.to(ctx.device).flatten())
            wrapped.backward(loss / timer.accumulate_steps)
    wrapped.step(optimizer, clip)
    return loss.detach()


def prepare(args: argparse.Namespace, job: Job) -> tuple[Wrapped, torch.optim.Optimizer]:
    """Return the model as the job spreads it and its optimizer."""
    if args.model == "gpt2":
        torch.manual_seed(args.seed)
        model: nn.Module = GPT2Model(GPT2[args.gpt2_size])
    else:
        model = make_model(args.hidden, args.seed, args.layers)
    wrapped = job.wrap(model)
    # After wrapping: FSDP replaces the parameters with its shards.
    if args.model == "gpt2":
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(wrapped.module.parameters(), lr=args.lr, betas=(0.9, 0.95))
    else:
        optimizer = torch.optim.SGD(wrapped.module.parameters(), lr=args.lr, momentum=0.9)
    return wrapped, optimizer


def model_name(args: argparse.Namespace) -> str:
    return f"gpt2-{args.gpt2_size}" if args.model == "gpt2" else "mlp"


def train(args: argparse.Namespace) -> int:
    job = Job(args.job)
    wrapped, optimizer = prepare(args, job)
    step = job.resume(optimizer)
    # The job's accumulate_steps, raised where it restarted on fewer ranks than it plans (wrap_model).
    data = iter(batches(args, job.rank, step, job.accumulate_steps, job.world))
    if job.rank == 0:
        shard = args.job.shard
        log(
            f"training world={job.world} restarts={job.ctx.restarts} backend={args.backend} max_steps={args.max_steps} "
            f"parallelism={shard.parallelism} mixed_precision={shard.mixed_precision} "
            f"params_local={local_shard_numel(wrapped.module)} model={model_name(args)}"
        )
    while job.running(args.max_steps):
        job.step_done(train_step(wrapped, optimizer, data, job.ctx, args.clip))
        if args.step_sleep:
            time.sleep(args.step_sleep)  # between steps: in no step's time (StepTimer)
    return job.finish()


def main(argv: list[str] | None = None) -> int:
    return train(parse_args(argv))


if __name__ == "__main__":
    try:
        code = main()
    except Exception:  # noqa: BLE001 - every failure ends the rank the same way, below
        # A rank whose step fails (a peer's death breaks its collective) must end now. At the interpreter's
        # exit, multiprocessing would terminate() the loader workers the traceback still holds, which ignore
        # SIGTERM (_quiet_worker), and join() them until torchrun's SIGKILL 30 s later, on each node in turn.
        traceback.print_exc()
        code = 1
    exit_process(code)
