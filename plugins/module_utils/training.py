"""The job's side of budgetgpu's training contract, for the example trainer and a user's own script alike: join
the process group torchrun describes, spread the model as the job says (DDP with the job's communication hook and
step timer, or FSDP2/HSDP: sharding.wrap_model), save the job's checkpoints (model, optimizer, step and the data
position; sharded under fsdp/hsdp; the newest N kept; every N minutes and/or steps as the unit says), resume from
the newest checkpoint any node holds, stop every rank at the same step with a checkpoint when one is stopped
(SIGTERM), and write the job's status.json (step, rate, each rank's step breakdown, a change of world size) that
the health watch exports and `playbooks/train.yml -e job_state=status` reads.

Part of the node package (role node_venv), on the job venv's path as budgetgpu_node.training. Its settings are the
unit's environment (JobSettings.from_env: BUDGETGPU_CHECKPOINT_DIR, BUDGETGPU_CHECKPOINT_EVERY_MINUTES,
BUDGETGPU_CHECKPOINT_EVERY_STEPS, BUDGETGPU_DIST_BACKEND, BUDGETGPU_STATUS_FILE, BUDGETGPU_STRAGGLER_EVERY_STEPS and
what straggler.CommSettings and sharding.ShardSettings read). A loop (README.md has a whole script):

    job = Job()                                         # the process group; the job's settings
    model = job.wrap(net)                               # DDP, FSDP or HSDP as the job says
    optimizer = torch.optim.AdamW(model.module.parameters())
    job.resume(optimizer)                               # the newest checkpoint any node holds
    batches = job.batches(loader)                       # epoch after epoch, from the checkpoint's position
    while job.running(max_steps):                       # every rank stops at the same step
        optimizer.zero_grad()
        for fwd_bwd in model.micro_batches():           # accumulate_steps, timed; gradients synced on the last
            inputs, labels = next(batches)
            with fwd_bwd:
                model.backward(loss_fn(model(inputs.to(job.device)), labels.to(job.device)) / job.accumulate_steps)
        model.step(optimizer, clip=1.0)
        job.step_done(loss)                             # status, log line, checkpoint when due
    job.exit()                                          # the last checkpoint; exit 75 when a peer stopped

Everything torch is imported where it is used: the settings are plain Python.
"""

from __future__ import annotations

import ctypes
import io
import math
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from .sharding import ShardSettings, Wrapped, load_sharded, save_sharded, wrap_model
from .straggler import DEFAULT_EVERY_STEPS, CommSettings, Finding, StepTimer, every_steps_from_env, write_status

CHECKPOINT = re.compile(r"^step-(\d{8,})\.pt$")
# Exit status of a rank that stopped because another node was stopped (not finished, not failed).
STOPPED_BY_PEER = 75
# The ranks agree on a stop about this often (seconds), never more than every MAX_STOP_GAP steps apart.
STOP_CHECK_S = 1.0
MAX_STOP_GAP = 100


def log(msg: str) -> None:
    """A line of the job's log (its journal), at once."""
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


@dataclass(frozen=True)
class JobSettings:
    """What the job's unit says about its training (jobs.torchrun_environment writes the variables)."""

    checkpoint_dir: str = "checkpoints"
    checkpoint_every_minutes: float = 15.0  # 0: no checkpoint by time
    checkpoint_every_steps: int = 0  # 0: no checkpoint by steps
    keep_checkpoints: int = 3  # on each node
    backend: str = "auto"  # nccl with GPUs, else gloo
    straggler_every_steps: int = DEFAULT_EVERY_STEPS
    status_file: str = ""  # empty: none
    log_every: int = 10  # rank 0's step line and status, every N steps
    comm: CommSettings = field(default_factory=CommSettings)
    shard: ShardSettings = field(default_factory=ShardSettings)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> JobSettings:
        """Read the unit's variables; unset: the defaults above. A value out of range is refused (ValueError)."""
        env = os.environ if env is None else env
        base = cls()
        return cls(
            checkpoint_dir=env.get("BUDGETGPU_CHECKPOINT_DIR", base.checkpoint_dir),
            checkpoint_every_minutes=float(
                env.get("BUDGETGPU_CHECKPOINT_EVERY_MINUTES", base.checkpoint_every_minutes)
            ),
            checkpoint_every_steps=int(env.get("BUDGETGPU_CHECKPOINT_EVERY_STEPS", base.checkpoint_every_steps)),
            backend=env.get("BUDGETGPU_DIST_BACKEND", base.backend),
            straggler_every_steps=every_steps_from_env(env),
            status_file=env.get("BUDGETGPU_STATUS_FILE", base.status_file),
            comm=CommSettings.from_env(env),
            shard=ShardSettings.from_env(env),
        )


# --- full checkpoints (ddp) ----------------------------------------------------------------


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
    import torch

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
    import torch

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
    device: Any = "cpu"  # a torch.device


def setup(backend: str) -> Dist:
    """Join the process group torchrun describes in the environment (or run alone without one)."""
    import torch
    import torch.distributed as dist

    env = os.environ
    if "WORLD_SIZE" not in env:
        return Dist(device=torch.device("cpu"))
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
    import torch
    import torch.distributed as dist

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


# --- stopping together ---------------------------------------------------------------------


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
        import torch
        import torch.distributed as dist

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


def leave(ctx: Dist, stop: StopRequest, step: int) -> int:
    """Say how the run ended, leave the process group and return the exit code."""
    if ctx.rank == 0:
        log(f"{'stopped' if stop.stopping else 'finished'} at step {step}")
    if ctx.enabled:
        import torch.distributed as dist

        # Every rank past its last checkpoint before any rank exits (exit_process says why the exit is abrupt).
        dist.barrier()
        dist.destroy_process_group()
    if stop.by_peer:
        # This node was not asked to stop: the job is not finished, it waits for the stopped
        # node. A non-zero exit has torchrun (or systemd) start the rendezvous again.
        log(f"rank {ctx.rank}: a peer stopped at step {step}; waiting for it to come back")
        return STOPPED_BY_PEER
    return 0


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


# --- the job's status ----------------------------------------------------------------------


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

    def report(self, step: int, loss: Any, logged: bool) -> None:
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
                import torch

                status["peak_memory_bytes"] = torch.cuda.max_memory_allocated(ctx.device)
            status.update(self.settings or {})
            status.update(self.breakdown or {})
            try:
                write_status(self.status_file, {**status, "restarts": ctx.restarts})
            except OSError as err:
                log(f"warning: cannot write the status file {self.status_file}: {err}")


def settings_status(settings: JobSettings, ctx: Dist, wrapped: Wrapped) -> dict[str, Any]:
    """What the job runs, for its status: the backend, the communication settings and, on fewer ranks than the
    job plans, the world it planned and why it runs fewer (planned_world, world_change)."""
    backend = "none"
    if ctx.enabled:
        import torch.distributed as dist

        backend = str(dist.get_backend())
    comm = settings.comm
    return {
        "backend": backend,
        "parallelism": settings.shard.parallelism,
        "mixed_precision": settings.shard.mixed_precision,
        "gradient_compression": comm.gradient_compression,
        "bucket_cap_mb": comm.bucket_cap_mb,
        "accumulate_steps": wrapped.timer.accumulate_steps,
        **wrapped.world_change,
    }


# --- the job -------------------------------------------------------------------------------


class Job:
    """One rank of the job: wrap(), resume(), then `while running(max_steps)` a step and step_done(), then
    finish() (or exit()). The step is `step`; `data` is where the job is in its data beyond the step
    ({"epoch", "batch"}: batches() keeps it), saved in every checkpoint and restored by resume()."""

    def __init__(self, settings: JobSettings | None = None) -> None:
        try:
            self.settings = settings or JobSettings.from_env()
        except ValueError as err:
            raise SystemExit(str(err)) from None
        self.ctx = setup(self.settings.backend)
        self.stop = StopRequest()
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        self.step = 0
        self.data = {"epoch": 0, "batch": 0}
        self.wrapped: Wrapped | None = None
        self.optimizer: Any = None
        self.policy = CheckpointPolicy(0, 0, 0.0, 0)
        self.progress: Progress | None = None
        self._loss: Any = None

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world(self) -> int:
        return self.ctx.world

    @property
    def device(self) -> Any:
        return self.ctx.device

    @property
    def accumulate_steps(self) -> int:
        """Micro-batches per step: the job's, raised where it runs on fewer ranks than it plans (wrap_model)."""
        return self.wrapped.timer.accumulate_steps

    @property
    def sharded(self) -> bool:
        """fsdp/hsdp in a process group: every rank writes its shards of each checkpoint."""
        return self.settings.shard.sharded and self.ctx.enabled

    def wrap(self, model: Any, blocks: list[Any] | None = None) -> Wrapped:
        """Spread model as the job says (sharding.wrap_model) with a step timer of the job's straggler report."""
        ctx, settings = self.ctx, self.settings
        timer = StepTimer(ctx.rank, ctx.world, ctx.device, settings.straggler_every_steps, local_rank=ctx.local_rank)
        try:
            self.wrapped = wrap_model(model, ctx.device, settings.shard, settings.comm, timer, blocks)
        except ValueError as err:
            raise SystemExit(f"rank {ctx.rank}: {err}") from None
        return self.wrapped

    def resume(self, optimizer: Any) -> int:
        """Load the newest checkpoint into the wrapped model, optimizer and data position; return its step. DDP:
        the newest any node holds, from that node; fsdp/hsdp: the newest sharded one every node holds, resharded
        to this world size."""
        settings, self.optimizer = self.settings, optimizer
        directory, keep = Path(settings.checkpoint_dir), settings.keep_checkpoints
        if self.sharded:
            self.step = load_sharded(str(directory), self.wrapped, optimizer, keep, self.data)
            where = f"sharded checkpoint {directory}/step-{self.step:08d}.dcp"
        else:
            self.step, state, where = agree_on_resume(self.ctx, directory)
            if state is not None:
                self.wrapped.model.load_state_dict(state["model"])
                optimizer.load_state_dict(state["optimizer"])
                self.data.update(state.get("data", {}))
        if self.ctx.local_rank == 0:
            start = f"resumed from step {self.step} ({where})"
            log(start if self.step else f"no checkpoint in {directory}: starting at step 0")
        now = time.monotonic()
        self.policy = CheckpointPolicy(
            settings.checkpoint_every_minutes, settings.checkpoint_every_steps, now, self.step
        )
        status = settings_status(settings, self.ctx, self.wrapped)
        self.progress = Progress(self.ctx, self.step, now, settings.status_file, settings=status)
        if self.wrapped.world_change and self.rank == 0:
            log(f"world changed: {self.wrapped.world_change['world_change']}")
        return self.step

    def batches(self, loader: Any) -> Iterator[Any]:
        """The loader's batches epoch after epoch, from the data position of the checkpoint resumed: a sampler's
        set_epoch(epoch) at each epoch (DistributedSampler: each rank its share, shuffled by epoch), and the
        batches of the epoch trained before the checkpoint read and skipped. The wait counts as data (timer)."""
        while True:
            sampler = getattr(loader, "sampler", None)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self.data["epoch"])
            batches = iter(loader)
            for _skipped in range(self.data["batch"]):
                next(batches, None)
            while True:
                with self.wrapped.timer.data():
                    batch = next(batches, None)
                if batch is None:
                    break
                self.data["batch"] += 1
                yield batch
            self.data = {"epoch": self.data["epoch"] + 1, "batch": 0}

    def running(self, max_steps: int) -> bool:
        """Whether to take another step: before max_steps and not stopped (every rank agrees on the same step)."""
        due = self.policy.due(self.step, time.monotonic())
        return self.step < max_steps and not self.stop.agreed(self.ctx, self.step, due)

    def step_done(self, loss: Any) -> None:
        """Count the step: the timer's report every straggler_every_steps, rank 0's line and status every
        log_every steps, and the checkpoint when due."""
        self.step += 1
        self._loss = loss
        step, timer, progress = self.step, self.wrapped.timer, self.progress
        line = timer.step_done()
        if line:
            progress.straggler, progress.finding = line, timer.last
            log(line)
        if timer.window_steps == 0:
            progress.breakdown = timer.window_status() or progress.breakdown
        logged = step % self.settings.log_every == 0
        if self.rank == 0 and (logged or line):
            progress.report(step, loss, logged)
        now = time.monotonic()
        due = self.policy.due(step, now)
        if self.sharded:
            # Every rank saves at the same step: by steps (the same on every rank) or by minutes as agreed.
            due = self.policy.due(step, -math.inf) or self.stop.checkpoint_due
        self.stop.checkpoint_due = False
        if due and self._writer:
            self.checkpoint()
            self.policy.saved(step, now)

    @property
    def _writer(self) -> bool:
        # DDP: one writer per node, every node keeps its own copy; fsdp/hsdp: every rank writes its shards.
        return self.sharded or self.ctx.local_rank == 0

    def checkpoint(self, reason: str = "") -> None:
        """Save this step's checkpoint (a collective under fsdp/hsdp: every rank calls it; DDP: a node's first)."""
        directory, keep, step = Path(self.settings.checkpoint_dir), self.settings.keep_checkpoints, self.step
        if self.sharded:
            path = save_sharded(str(directory), step, self.wrapped, self.optimizer, keep, self.data)
            if self.ctx.local_rank != 0:
                return
        else:
            model, optimizer = self.wrapped.model.state_dict(), self.optimizer.state_dict()
            state = {"step": step, "model": model, "optimizer": optimizer, "data": dict(self.data)}
            path = save_checkpoint(directory, step, state, keep)
        log(f"checkpoint step={step} path={path}{reason}")

    def finish(self) -> int:
        """The last step's checkpoint where none holds it yet, rank 0's last status, the end of the process group;
        return the exit code (STOPPED_BY_PEER where another node was stopped: the job waits for it)."""
        if self._writer and self.policy.last_step != self.step:
            self.checkpoint(" (stop requested)" if self.stop.stopping else " (final)")
        if self.rank == 0 and self._loss is not None and self.progress.start_step != self.step:
            self.progress.report(self.step, self._loss, False)
        return leave(self.ctx, self.stop, self.step)

    def exit(self) -> NoReturn:
        """finish(), then end the process with its code (exit_process says why not through sys.exit)."""
        exit_process(self.finish())
