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
processes; `--data-delay` slows each batch on purpose (a loader that does not keep up). NCCL on GPUs,
gloo on CPU. Every node's local rank 0 writes a checkpoint every N minutes and/or steps, atomically
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

Defaults come from the environment the unit sets: BUDGETGPU_CHECKPOINT_DIR,
BUDGETGPU_CHECKPOINT_EVERY_MINUTES, BUDGETGPU_CHECKPOINT_EVERY_STEPS, BUDGETGPU_DIST_BACKEND,
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
import ctypes
import io
import math
import os
import re
import signal
import socket
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

# Installed beside this script (the script's directory is the first entry of sys.path).
from budgetgpu_node.gpt2 import GPT2_SIZES, GPT2_TINY
from budgetgpu_node.sharding import ShardSettings, Wrapped, load_sharded, local_shard_numel, save_sharded, wrap_model
from budgetgpu_node.straggler import CommSettings, Finding, StepTimer, every_steps_from_env, write_status
from torch import nn
from torch.utils.data import DataLoader, Dataset

CHECKPOINT = re.compile(r"^step-(\d{8,})\.pt$")
FEATURES, CLASSES = 32, 4
# --gpt2-size: the test size and GPT-2's released ones (budgetgpu_node.gpt2, the memory planner's table too).
GPT2 = {"tiny": GPT2_TINY, **GPT2_SIZES}
# Each model's defaults: the MLP's plain SGD, GPT-2's AdamW (the optimizer the memory planner plans: 16 bytes a
# parameter in fp32) and a micro-batch of 4 contexts (the planner's gpt2-1.5b example).
MODEL_DEFAULTS = {"mlp": {"lr": 0.05, "batch_size": 64}, "gpt2": {"lr": 6e-4, "batch_size": 4}}
# Exit status of a rank that stopped because another node was stopped (not finished, not failed).
STOPPED_BY_PEER = 75
# The ranks agree on a stop about this often (seconds), never more than every MAX_STOP_GAP steps apart.
STOP_CHECK_S = 1.0
MAX_STOP_GAP = 100


def log(msg: str) -> None:
    print(msg, flush=True)


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=1000, help="stop after this many optimizer steps")
    add_model_arguments(parser)
    parser.add_argument("--data-workers", type=int, default=1, help="DataLoader worker processes (0: in the rank)")
    parser.add_argument(
        "--data-delay", type=float, default=0.0, help="seconds each batch takes to load, on purpose (a slow loader)"
    )
    parser.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10, help="rank 0 logs every N steps")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (tests, demos)")
    parser.add_argument("--checkpoint-dir", default=env.get("BUDGETGPU_CHECKPOINT_DIR", "checkpoints"))
    parser.add_argument(
        "--checkpoint-every-minutes",
        type=float,
        default=float(env.get("BUDGETGPU_CHECKPOINT_EVERY_MINUTES", "15")),
        help="0 turns the time-based checkpoint off",
    )
    parser.add_argument(
        "--checkpoint-every-steps",
        type=int,
        default=int(env.get("BUDGETGPU_CHECKPOINT_EVERY_STEPS", "0")),
        help="0 turns the step-based checkpoint off",
    )
    parser.add_argument("--keep-checkpoints", type=int, default=3, help="how many checkpoints each node keeps")
    parser.add_argument(
        "--backend", choices=("auto", "nccl", "gloo"), default=env.get("BUDGETGPU_DIST_BACKEND", "auto")
    )
    parser.add_argument(
        "--straggler-every-steps",
        type=int,
        default=every_steps_from_env(env),
        help="rank 0 compares the ranks' compute times every N steps; 0 turns it off",
    )
    parser.add_argument(
        "--status-file",
        default=env.get("BUDGETGPU_STATUS_FILE", ""),
        help="rank 0 writes the job's status (JSON) here at every log line; empty: none",
    )
    args = parser.parse_args(argv)
    for key, value in MODEL_DEFAULTS[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.max_steps < 0 or args.log_every < 1 or args.keep_checkpoints < 1 or args.straggler_every_steps < 0:
        parser.error("--max-steps and --straggler-every-steps must be >= 0, --log-every and --keep-checkpoints >= 1")
    if args.layers < 0 or args.data_workers < 0 or args.data_delay < 0:
        parser.error("--layers, --data-workers and --data-delay must be >= 0")
    try:
        args.comm = CommSettings.from_env(env)
        args.shard = ShardSettings.from_env(env)
    except ValueError as err:
        parser.error(str(err))
    return args


# --- checkpoints ---------------------------------------------------------------------------


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step-{step:08d}.pt"


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """Return (step, path) of every complete checkpoint in directory, oldest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), directory / name) for name in names if (m := CHECKPOINT.match(name))]
    return sorted(found)


def save_checkpoint(directory: Path, step: int, state: dict[str, Any], keep: int = 3) -> Path:
    """Write state as step-<step>.pt atomically (a reader sees the old file or the new, never half
    of one), then drop all but the newest `keep` checkpoints."""
    directory.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(directory, step)
    tmp = directory / f".{final.name}.{socket.gethostname()}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    for _step, old in list_checkpoints(directory)[:-keep]:
        old.unlink(missing_ok=True)
    return final


def load_latest(directory: Path) -> tuple[int, dict[str, Any] | None, Path | None]:
    """Return (step, state, path) of the newest readable checkpoint, or (0, None, None)."""
    for step, path in reversed(list_checkpoints(directory)):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - a damaged file must not stop the resume
            log(f"warning: checkpoint {path} is unreadable ({err.__class__.__name__}: {err}); trying an older one")
            continue
        if state.get("step") == step:
            return step, state, path
        log(f"warning: checkpoint {path} holds step {state.get('step')}, not {step}; trying an older one")
    return 0, None, None


@dataclass
class CheckpointPolicy:
    """When a checkpoint is due: every `minutes` of wall time and/or every `steps` steps."""

    minutes: float
    steps: int
    last_time: float
    last_step: int

    def due(self, step: int, now: float) -> bool:
        by_steps = self.steps > 0 and step - self.last_step >= self.steps
        by_time = self.minutes > 0 and now - self.last_time >= self.minutes * 60
        return by_steps or by_time

    def saved(self, step: int, now: float) -> None:
        self.last_step, self.last_time = step, now


# --- distributed setup ---------------------------------------------------------------------


@dataclass
class Dist:
    rank: int = 0
    local_rank: int = 0
    world: int = 1
    restarts: int = 0
    enabled: bool = False
    device: torch.device = torch.device("cpu")


def setup(backend: str) -> Dist:
    """Join the process group torchrun describes in the environment (or run alone without one)."""
    env = os.environ
    if "WORLD_SIZE" not in env:
        return Dist()
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    local_rank = int(env["LOCAL_RANK"])
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    dist.init_process_group(backend=backend)
    return Dist(
        rank=dist.get_rank(),
        local_rank=local_rank,
        world=dist.get_world_size(),
        restarts=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
        enabled=True,
        device=device,
    )


def agree_on_resume(ctx: Dist, directory: Path) -> tuple[int, dict[str, Any] | None, str]:
    """Return the newest checkpoint any node has: every node reads its own disk, the lowest rank
    holding the newest one sends it to all (checkpoints are local to each node unless the
    directory is shared). Plain tensor collectives: no pickling, no numpy."""
    step, state, path = load_latest(directory) if ctx.local_rank == 0 else (0, None, None)
    if not ctx.enabled:
        return step, state, f"checkpoint {path}" if path else ""
    best = torch.tensor([step], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(best, op=dist.ReduceOp.MAX)
    best_step = int(best.item())
    if best_step == 0:
        return 0, None, ""
    owner = torch.tensor([ctx.rank if step == best_step else ctx.world], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(owner, op=dist.ReduceOp.MIN)
    source = int(owner.item())
    size = torch.zeros(1, dtype=torch.int64, device=ctx.device)
    if ctx.rank == source:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8).to(ctx.device)
        size += payload.numel()
    dist.broadcast(size, src=source)
    if ctx.rank != source:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=ctx.device)
    dist.broadcast(payload, src=source)
    payload = payload.cpu()
    received = torch.load(
        io.BytesIO(ctypes.string_at(payload.data_ptr(), payload.numel())), map_location="cpu", weights_only=True
    )
    where = f"checkpoint {path}" if ctx.rank == source else f"checkpoint of rank {source}"
    return best_step, received, where


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


class StopRequest:
    """Set by SIGTERM/SIGINT; the loop stops at the next agreed step boundary with a checkpoint.

    Ranks see the signal at different steps (one node is stopped before another, or alone), so they
    agree: a stop any rank has seen is a stop for all at this same step, and the checkpoint every node
    writes holds that one step. They agree in one all-reduce of two numbers (a stop seen; the step of
    the next agreement) about every STOP_CHECK_S seconds rather than at every step: a blocking
    collective per step is a latency-bound sync per step.
    """

    def __init__(self, check_s: float = STOP_CHECK_S) -> None:
        self.signal: int | None = None
        self.by_peer = False
        # A checkpoint by minutes that any rank found due at the last agreement (sharded jobs save together).
        self.checkpoint_due = False
        self.check_s = check_s
        self.next_check = 0
        self._last: tuple[int, float] | None = None

    def __call__(self, signum: int, _frame: Any) -> None:
        self.signal = signum

    @property
    def stopping(self) -> bool:
        """Whether this rank stops because it or a peer was asked to."""
        return self.signal is not None or self.by_peer

    def _gap(self, step: int, now: float) -> int:
        """Steps to the next agreement: about check_s seconds at this rank's pace since the last one."""
        last, self._last = self._last, (step, now)
        if last is None or step <= last[0]:
            return 1
        per_step = (now - last[1]) / (step - last[0])
        return max(1, min(MAX_STOP_GAP, int(self.check_s / max(per_step, 1e-9))))

    def agreed(self, ctx: Dist, step: int = 0, due: bool = False) -> bool:
        """Return whether any rank was asked to stop, as agreed at this step (False between agreements).
        `due`: this rank's clock says a checkpoint is due; checkpoint_due is then whether any rank's said so."""
        if not ctx.enabled:
            self.checkpoint_due = due
            return self.signal is not None
        if step < self.next_check:
            return False
        seen = 1 if self.signal is not None else 0
        # MAX of the negated proposals: every rank takes the nearest next step any rank proposed.
        proposal = [seen, -(step + self._gap(step, time.monotonic())), int(due)]
        flag = torch.tensor(proposal, dtype=torch.int64, device=ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        stop, self.next_check = bool(flag[0].item()), -int(flag[1].item())
        self.checkpoint_due = bool(flag[2].item())
        if stop and self.signal is None:
            self.by_peer = True
        return stop


def restore(ctx: Dist, wrapped: Wrapped, optimizer: torch.optim.Optimizer, directory: Path, keep: int = 3) -> int:
    """Load the newest checkpoint into model and optimizer; return its step. DDP: the newest any node holds,
    from that node; fsdp/hsdp: the newest sharded one every node holds, resharded to this world size."""
    writer = ctx.local_rank == 0
    if wrapped.settings.sharded and ctx.enabled:
        step = load_sharded(str(directory), wrapped, optimizer, keep)
        if writer:
            where = f"sharded checkpoint {directory}/step-{step:08d}.dcp" if step else f"no checkpoint in {directory}"
            log(f"resumed from step {step} ({where})" if step else f"{where}: starting at step 0")
        return step
    model = wrapped.model
    step, state, source = agree_on_resume(ctx, directory)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if writer:
            log(f"resumed from step {step} ({source})")
    elif writer:
        log(f"no checkpoint in {directory}: starting at step 0")
    return step


def leave(ctx: Dist, stop: StopRequest, step: int) -> int:
    """Say how the run ended, leave the process group and return the exit code."""
    if ctx.rank == 0:
        log(f"{'stopped' if stop.stopping else 'finished'} at step {step}")
    if ctx.enabled:
        # Every rank past its last checkpoint before any rank exits (exit_process says why the exit is abrupt).
        dist.barrier()
        dist.destroy_process_group()
    if stop.by_peer:
        # This node was not asked to stop: the job is not finished, it waits for the stopped
        # node. A non-zero exit has torchrun (or systemd) start the rendezvous again.
        log(f"rank {ctx.rank}: a peer stopped at step {step}; waiting for it to come back")
        return STOPPED_BY_PEER
    return 0


@dataclass
class Progress:
    """Rank 0's step lines and the job's status file (for `train.yml -e job_state=status`)."""

    ctx: Dist
    start_step: int
    started: float
    status_file: str
    straggler: str = ""
    finding: Finding | None = None
    # What the job runs (the verdict in job_state=status never suggests what the backend cannot run).
    settings: dict[str, Any] | None = None
    breakdown: dict[str, Any] | None = None

    def report(self, step: int, loss: torch.Tensor, logged: bool) -> None:
        """Log the step line and write the status. The rate is the current one, since the previous
        report (a job that slows down shows it at once; a rate since the start hides it for hours)."""
        ctx, now = self.ctx, time.monotonic()
        rate = (step - self.start_step) / max(now - self.started, 1e-9)
        self.start_step, self.started = step, now
        if logged:
            log(f"step={step} loss={loss.item():.4f} world={ctx.world} restarts={ctx.restarts} steps_per_s={rate:.1f}")
        if self.status_file:
            status = {"step": step, "steps_per_s": round(rate, 3), "straggler": self.straggler, "world": ctx.world}
            if ctx.device.type == "cuda":
                status["peak_memory_bytes"] = torch.cuda.max_memory_allocated(ctx.device)
            status.update(self.settings or {})
            status.update(self.breakdown or {})
            try:
                write_status(self.status_file, {**status, "restarts": ctx.restarts})
            except OSError as err:
                log(f"warning: cannot write the status file {self.status_file}: {err}")


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


def prepare(args: argparse.Namespace, ctx: Dist) -> tuple[Wrapped, torch.optim.Optimizer, int]:
    """Return (the model as the job spreads it, optimizer, step) of a run, resumed from the newest checkpoint."""
    if args.model == "gpt2":
        torch.manual_seed(args.seed)
        model: nn.Module = GPT2Model(GPT2[args.gpt2_size])
    else:
        model = make_model(args.hidden, args.seed, args.layers)
    timer = StepTimer(ctx.rank, ctx.world, ctx.device, args.straggler_every_steps, local_rank=ctx.local_rank)
    try:
        wrapped = wrap_model(model, ctx.device, args.shard, args.comm, timer=timer)
    except ValueError as err:
        raise SystemExit(f"rank {ctx.rank}: {err}") from None
    # After wrapping: FSDP replaces the parameters with its shards.
    if args.model == "gpt2":
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(wrapped.module.parameters(), lr=args.lr, betas=(0.9, 0.95))
    else:
        optimizer = torch.optim.SGD(wrapped.module.parameters(), lr=args.lr, momentum=0.9)
    step = restore(ctx, wrapped, optimizer, Path(args.checkpoint_dir), args.keep_checkpoints)
    return wrapped, optimizer, step


def model_name(args: argparse.Namespace) -> str:
    return f"gpt2-{args.gpt2_size}" if args.model == "gpt2" else "mlp"


def log_start(args: argparse.Namespace, ctx: Dist, wrapped: Wrapped) -> None:
    """Rank 0's first lines: what the run trains with, and why it runs fewer ranks than the job plans."""
    shard = args.shard
    log(
        f"training world={ctx.world} restarts={ctx.restarts} backend={args.backend} max_steps={args.max_steps} "
        f"parallelism={shard.parallelism} mixed_precision={shard.mixed_precision} "
        f"params_local={local_shard_numel(wrapped.module)} model={model_name(args)}"
    )
    if wrapped.world_change:
        log(f"world changed: {wrapped.world_change['world_change']}")


def train(args: argparse.Namespace) -> int:
    ctx = setup(args.backend)
    stop = StopRequest()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    directory = Path(args.checkpoint_dir)
    wrapped, optimizer, step = prepare(args, ctx)
    timer, sharded = wrapped.timer, wrapped.settings.sharded and ctx.enabled
    # DDP: one writer per node, every node keeps its own copy; fsdp/hsdp: every rank writes its shards.
    writer = sharded or ctx.local_rank == 0
    policy = CheckpointPolicy(args.checkpoint_every_minutes, args.checkpoint_every_steps, time.monotonic(), step)
    progress = Progress(ctx, step, time.monotonic(), args.status_file, settings=settings_status(args, ctx, wrapped))
    # The job's accumulate_steps, raised where it restarted on fewer ranks than it plans (wrap_model).
    data = iter(batches(args, ctx.rank, step, timer.accumulate_steps, ctx.world))

    def checkpoint(reason: str = "") -> None:
        if sharded:
            path = save_sharded(str(directory), step, wrapped, optimizer, args.keep_checkpoints)
            if ctx.local_rank != 0:
                return
        else:
            state = {"step": step, "model": wrapped.model.state_dict(), "optimizer": optimizer.state_dict()}
            path = save_checkpoint(directory, step, state, args.keep_checkpoints)
        log(f"checkpoint step={step} path={path}{reason}")

    if ctx.rank == 0:
        log_start(args, ctx, wrapped)
    while step < args.max_steps and not stop.agreed(ctx, step, policy.due(step, time.monotonic())):
        loss = train_step(wrapped, optimizer, data, ctx, args.clip)
        step += 1
        line = timer.step_done()
        if line:
            progress.straggler, progress.finding = line, timer.last
            log(line)
        if timer.window_steps == 0:
            progress.breakdown = timer.window_status() or progress.breakdown
        if ctx.rank == 0 and (step % args.log_every == 0 or line):
            progress.report(step, loss, step % args.log_every == 0)
        now = time.monotonic()
        # Sharded: every rank saves at the same step, by steps (the same on every rank) or by minutes as agreed.
        due = (policy.due(step, -math.inf) or stop.checkpoint_due) if sharded else policy.due(step, now)
        stop.checkpoint_due = False
        if writer and due:
            checkpoint()
            policy.saved(step, now)
        if args.step_sleep:
            time.sleep(args.step_sleep)  # between steps: in no step's time (StepTimer)
    if writer and policy.last_step != step:
        checkpoint(" (stop requested)" if stop.stopping else " (final)")
    return leave(ctx, stop, step)


def settings_status(args: argparse.Namespace, ctx: Dist, wrapped: Wrapped) -> dict[str, Any]:
    """What the job runs, for its status: the backend, the communication settings and, on fewer ranks than the
    job plans, the world it planned and why it runs fewer (planned_world, world_change)."""
    backend = str(dist.get_backend()) if ctx.enabled else "none"
    comm = args.comm
    return {
        "backend": backend,
        "parallelism": args.shard.parallelism,
        "mixed_precision": args.shard.mixed_precision,
        "gradient_compression": comm.gradient_compression,
        "bucket_cap_mb": comm.bucket_cap_mb,
        "accumulate_steps": wrapped.timer.accumulate_steps,
        **wrapped.world_change,
    }


def main(argv: list[str] | None = None) -> int:
    return train(parse_args(argv))


def exit_process(code: int) -> NoReturn:
    """End this rank without the interpreter's teardown. In torch 2.13 a gloo group that fully_shard has
    used keeps its worker threads after destroy_process_group, and one of them that lets go of a finished
    collective's tensors while the interpreter is finalizing cannot take the GIL: the finished rank aborts
    ("terminate called without an active exception") and torchrun reports the run failed. Under CPU load,
    4 of 40 three-rank runs of tests/unit/roles/sharding_worker.py did, with or without
    destroy_process_group (CI, stop 47). Everything the job writes is closed and in place before this."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_process(main())
