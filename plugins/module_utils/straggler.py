"""Where a DDP job's step time goes, seen from inside the job: each rank's compute, the communication
its backward did not hide, and the time it waited for data, gathered every N steps; rank 0 names the
slowest rank against the median of all ranks and writes the breakdown to the job's status.

One slow GPU (bad thermal paste, a dead fan, a throttled card) makes every rank wait for it in the
all-reduce, so the step time of every rank is the same and says nothing. The time each rank spends
computing does. DDP all-reduces the gradients in buckets while backward still runs (the overlap that
hides communication on a slow network), so compute is measured without turning that off: a
communication hook that wraps the job's compression hook (DDP takes one hook per model) marks when
the rank's last bucket became ready. Before that mark the rank computed; from there to the end of
backward it waited for communication that compute did not hide (and for slower ranks).

Part of the node package (role node_venv), which python_env's root-owned .pth puts on the job venv's
path, so a job's own training loop can use it. One call wraps the model in
DDP with the job's communication settings (gradient_compression, powersgd_rank,
powersgd_start_step, bucket_cap_mb, accumulate_steps: the unit's environment) and the timer:

    from budgetgpu_node.straggler import wrap_ddp

    ddp, timer = wrap_ddp(model)                    # after dist.init_process_group()
    batches = iter(loader)
    for step in range(steps):
        optimizer.zero_grad()
        for fwd_bwd in timer.micro_batches(ddp):    # accumulate_steps; DDP syncs on the last only
            with timer.data():                      # waiting for the next batch
                inputs, labels = next(batches)
            with fwd_bwd:                           # compute, then communication not hidden
                (loss_fn(ddp(inputs), labels) / timer.accumulate_steps).backward()
        with timer.compute():
            optimizer.step()
        line = timer.step_done()                    # a collective every N steps
        if line:                                    # rank 0 only
            print(line, flush=True)

The decisions (median, ratio, which rank, the line, the settings from the environment) are plain
Python below; only the timer and wrap_ddp need torch (imported when they are used). Rank 0 may also
write the job's status for `playbooks/train.yml -e job_state=status` with write_status().
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

# A rank this much slower than the median is a straggler: the one place for the threshold
# (the same 15% the GPU benchmark uses for a slow card).
STRAGGLER_THRESHOLD = 0.15
# How many steps one report covers when BUDGETGPU_STRAGGLER_EVERY_STEPS is not set (outside a
# budgetgpu unit). A job's default is the job model's (plugin_utils/jobs.py JOB_DEFAULTS), which a
# unit test holds equal to this.
DEFAULT_EVERY_STEPS = 200
HOST_BYTES = 64
# The job's status lists at most this many ranks (the status file's schema, shared with the health
# watch that exports it); the straggler line and ratio still cover every rank.
MAX_STATUS_RANKS = 1024


@dataclass(frozen=True)
class RankTime:
    """One rank's compute seconds over a report's window and where it runs."""

    rank: int
    host: str
    local_rank: int
    seconds: float  # compute: forward, backward up to the last bucket, the optimizer step
    device: str = "cuda"
    comm_s: float = 0.0  # communication backward did not hide (waiting for slower ranks too)
    data_s: float = 0.0  # waiting for the next batch
    wall_s: float = 0.0  # the steps, end to end (checkpoints and the trainer's --step-sleep apart)

    @property
    def where(self) -> str:
        unit = "GPU" if self.device == "cuda" else "CPU process"
        return f"{self.host} {unit} {self.local_rank}"


@dataclass(frozen=True)
class Finding:
    """The slowest rank of a window against the median of all ranks."""

    slowest: RankTime
    median_s: float
    ratio: float  # slowest / median - 1: 0.31 is 31% slower
    steps: int
    threshold: float
    times: tuple[RankTime, ...] = ()  # every rank's, for the status (and the job's metrics)

    @property
    def straggler(self) -> bool:
        # Rounded: 1.15 / 1.0 - 1 is 0.1499999... in floating point, and 15% slower is a straggler.
        return round(self.ratio, 9) >= self.threshold

    @property
    def line(self) -> str:
        return straggler_line(self)

    def status(self) -> dict[str, Any]:
        """Return the finding's part of the job's status: the straggler ratio (slowest over median: 1.0
        when even), the threshold, the window's steps and each rank's step breakdown (ranks_status).
        The health watch exports them (job_metrics.py)."""
        return {
            "straggler_ratio": round(1 + self.ratio, 4),
            "straggler_threshold": self.threshold,
            **ranks_status(self.times, self.steps),
        }


def ranks_status(times: Sequence[RankTime], steps: int) -> dict[str, Any]:
    """Return the window's steps and each rank's seconds per step (at most MAX_STATUS_RANKS ranks):
    step_s compute, comm_s communication not hidden, data_s waiting for data, wall_s the whole step."""
    per = max(steps, 1)
    return {
        "window_steps": steps,
        "ranks": [
            {
                "rank": t.rank,
                "host": t.host,
                "local_rank": t.local_rank,
                "step_s": round(t.seconds / per, 6),
                "comm_s": round(t.comm_s / per, 6),
                "data_s": round(t.data_s / per, 6),
                "wall_s": round(t.wall_s / per, 6),
            }
            for t in sorted(times, key=lambda t: t.rank)[:MAX_STATUS_RANKS]
        ],
    }


def median(values: Sequence[float]) -> float:
    """Return the median (the mean of the two middle values for an even count)."""
    if not values:
        raise ValueError("median of no values")
    return float(statistics.median(values))


def slowest_against_median(
    times: Sequence[RankTime], steps: int, threshold: float = STRAGGLER_THRESHOLD
) -> Finding | None:
    """Return the slowest rank and how much slower it is than the median; None with fewer than two
    ranks or no compute time measured (nothing to compare). On a tie the lowest rank is named."""
    if len(times) < 2:
        return None
    mid = median([t.seconds for t in times])
    if mid <= 0:
        return None
    slowest = max(times, key=lambda t: (t.seconds, -t.rank))
    return Finding(slowest, mid, slowest.seconds / mid - 1, steps, threshold, tuple(times))


def straggler_line(finding: Finding) -> str:
    """Return the log line of a finding:

    straggler: rank 5 (node2 GPU 1): 31% slower than the median over the last 200 steps
    step times: slowest rank 2 (node1 GPU 2) 4% slower than the median over the last 200 steps (straggler from 15%)
    """
    pct = round(finding.ratio * 100)
    who = f"rank {finding.slowest.rank} ({finding.slowest.where})"
    window = f"over the last {finding.steps} steps"
    if finding.straggler:
        return f"straggler: {who}: {pct}% slower than the median {window}"
    return (
        f"step times: slowest {who} {pct}% slower than the median {window} "
        f"(straggler from {round(finding.threshold * 100)}%)"
    )


def every_steps_from_env(env: Mapping[str, str] | None = None) -> int:
    """Return BUDGETGPU_STRAGGLER_EVERY_STEPS (the job key straggler_every_steps), else the default."""
    text = (os.environ if env is None else env).get("BUDGETGPU_STRAGGLER_EVERY_STEPS", "")
    value = int(text) if text.strip() else DEFAULT_EVERY_STEPS
    if value < 0:
        raise ValueError(f"BUDGETGPU_STRAGGLER_EVERY_STEPS={text}: expected 0 (off) or a number of steps")
    return value


def write_status(path: str, status: Mapping[str, Any]) -> None:
    """Write status as JSON to path atomically (a reader sees the old file or the new one)."""
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=".status.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(dict(status, time=time.time()), handle, sort_keys=True)
            handle.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# --- the job's communication settings ----------------------------------------------------------

COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")


@dataclass(frozen=True)
class CommSettings:
    """A job's communication options (the job model's keys of the same names; the defaults are
    JOB_DEFAULTS', which a unit test holds equal)."""

    gradient_compression: str = "none"
    powersgd_rank: int = 1
    powersgd_start_step: int = 1000
    bucket_cap_mb: float = 25.0
    accumulate_steps: int = 1

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> CommSettings:
        """Read BUDGETGPU_GRADIENT_COMPRESSION, BUDGETGPU_POWERSGD_RANK, BUDGETGPU_POWERSGD_START_STEP,
        BUDGETGPU_BUCKET_CAP_MB and BUDGETGPU_ACCUMULATE_STEPS (the unit sets them); unset: the default."""
        env = os.environ if env is None else env
        base = cls()

        def number(name: str, kind: type, default: float, least: float) -> Any:
            text = env.get(f"BUDGETGPU_{name.upper()}", "").strip()
            if not text:
                return default
            try:
                value = kind(text)
            except ValueError:
                value = None
            if value is None or value < least:
                raise ValueError(f"BUDGETGPU_{name.upper()}={text}: expected a {kind.__name__} of at least {least}")
            return value

        compression = env.get("BUDGETGPU_GRADIENT_COMPRESSION", "").strip() or base.gradient_compression
        if compression not in COMPRESSIONS:
            raise ValueError(f"BUDGETGPU_GRADIENT_COMPRESSION={compression}: expected one of {', '.join(COMPRESSIONS)}")
        return cls(
            gradient_compression=compression,
            powersgd_rank=number("powersgd_rank", int, base.powersgd_rank, 1),
            # PowerSGD's error feedback needs plain all-reduce steps first (torch refuses fewer than 2).
            powersgd_start_step=number("powersgd_start_step", int, base.powersgd_start_step, 2),
            bucket_cap_mb=number("bucket_cap_mb", float, base.bucket_cap_mb, 0.001),
            accumulate_steps=number("accumulate_steps", int, base.accumulate_steps, 1),
        )

    def refusal(self, backend: str) -> str | None:
        """Why these settings cannot run on backend (None: they can). bf16 needs NCCL: torch's bf16
        hook refuses gloo ("required CUDA 11+ and NCCL 2.10+")."""
        if self.gradient_compression == "bf16" and backend != "nccl":
            return f"gradient_compression bf16 needs the nccl backend, this job runs {backend}: use fp16 or powersgd"
        return None


# --- torch: measuring and gathering -------------------------------------------------------

COMPUTE, COMM, DATA, WALL = range(4)


class StepTimer:
    """Sums one rank's step breakdown (compute, communication not hidden, data wait, wall) and, every
    `every` steps, gathers every rank's sums; rank 0 gets the finding (self.last) and every rank's
    times (self.times). step_done() is a collective every `every` steps: call it on every rank."""

    def __init__(
        self,
        rank: int,
        world: int,
        device: Any,
        every: int = DEFAULT_EVERY_STEPS,
        threshold: float = STRAGGLER_THRESHOLD,
        local_rank: int | None = None,
        group: Any = None,
        accumulate_steps: int = 1,
    ) -> None:
        self.rank, self.world, self.device, self.group = rank, world, device, group
        self.every, self.threshold, self.accumulate_steps = every, threshold, accumulate_steps
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
        self.sums = [0.0, 0.0, 0.0, 0.0]
        self.window_steps = 0
        self.hosts: list[tuple[str, int]] | None = None
        self.last: Finding | None = None
        self.times: list[RankTime] = []
        self.times_steps = 0
        self.comm_state: Any = None  # the compression hook's state (PowerSGD's error feedback)
        # A step's wall time runs from its first timed part to step_done(): what a loop does between
        # steps (logging, checkpoints, a deliberate sleep, a loader starting) is no step's.
        self._step_start: float | None = None
        self._ready: Any = None  # when the last bucket of this backward was ready (the hook's mark)

    @classmethod
    def from_env(cls, rank: int, world: int, device: Any, threshold: float = STRAGGLER_THRESHOLD) -> StepTimer:
        return cls(rank, world, device, every_steps_from_env(), threshold)

    @property
    def window_s(self) -> float:
        """This window's compute seconds (what the straggler report compares)."""
        return self.sums[COMPUTE]

    @property
    def device_type(self) -> str:
        return getattr(self.device, "type", str(self.device))

    def _begin(self) -> None:
        if self._step_start is None:
            self._step_start = time.perf_counter()

    def _mark(self) -> Any:
        """A point in time: on a GPU an event in its stream (the host runs ahead of the kernels)."""
        self._begin()
        if self.device_type == "cuda":
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _between(self, start: Any, end: Any) -> float:
        if self.device_type == "cuda":
            end.synchronize()
            return max(start.elapsed_time(end) / 1000, 0.0)
        return max(end - start, 0.0)

    @contextmanager
    def compute(self) -> Iterator[None]:
        """Time the block (on a GPU up to the end of its kernels) as this rank's compute."""
        start = self._mark()
        yield
        self.sums[COMPUTE] += self._between(start, self._mark())

    @contextmanager
    def data(self) -> Iterator[None]:
        """Time the block as waiting for data (fetching the next batch from the loader)."""
        self._begin()
        start = time.perf_counter()
        yield
        self.sums[DATA] += time.perf_counter() - start

    def bucket_ready(self) -> None:
        """Called by the timing hook when the last gradient bucket of a backward is ready."""
        self._ready = self._mark()

    @contextmanager
    def forward_backward(self, ddp: Any = None, sync: bool = True) -> Iterator[None]:
        """Time one micro-batch's forward and backward: compute up to the mark of the last bucket,
        communication from there to the end of backward. sync=False runs it under ddp.no_sync()
        (gradient accumulation: no all-reduce, all compute)."""
        quiet = ddp.no_sync() if not sync and hasattr(ddp, "no_sync") else contextlib.nullcontext()
        self._ready = None
        start = self._mark()
        with quiet:
            yield
        end = self._mark()
        ready = self._ready if sync and self._ready is not None else end
        self.sums[COMPUTE] += self._between(start, ready)
        self.sums[COMM] += self._between(ready, end)

    def micro_batches(self, ddp: Any) -> Iterator[contextlib.AbstractContextManager[None]]:
        """One forward_backward per micro-batch of a step: accumulate_steps, DDP syncing on the last."""
        for index in range(self.accumulate_steps):
            yield self.forward_backward(ddp, sync=index == self.accumulate_steps - 1)

    def step_done(self) -> str | None:
        """Count a step; every `every` steps gather the ranks' times and return rank 0's line (None on
        other ranks, between reports, with `every` 0, or alone: no one to compare with)."""
        now = time.perf_counter()
        self.sums[WALL] += now - (now if self._step_start is None else self._step_start)
        self._step_start = None
        self.window_steps += 1
        if self.every <= 0 or self.window_steps < self.every:
            return None
        self.times, self.times_steps = self.gather(), self.window_steps
        finding = slowest_against_median(self.times, self.window_steps, self.threshold) if self.times else None
        self.last = finding
        self.sums, self.window_steps = [0.0, 0.0, 0.0, 0.0], 0
        return finding.line if finding else None

    def window_status(self) -> dict[str, Any]:
        """Rank 0's status of the last window: the finding's, or alone the breakdown of this rank."""
        if self.last is not None:
            return self.last.status()
        return ranks_status(self.times, self.times_steps) if self.times else {}

    def gather(self) -> list[RankTime]:
        """Every rank's sums of this window on rank 0 ([] elsewhere): one all_gather of four numbers."""
        if self.world < 2:
            host = socket.gethostname()
            return [RankTime(self.rank, host, self.local_rank, *self.sums[:1], self.device_type, *self.sums[1:])]
        import torch
        import torch.distributed as dist

        if self.hosts is None:
            self.hosts = self._gather_hosts()
        mine = torch.tensor(self.sums, dtype=torch.float64, device=self.device)
        every = [torch.zeros_like(mine) for _unused in range(self.world)]
        dist.all_gather(every, mine, group=self.group)
        if self.rank != 0:
            return []
        out = []
        for rank, ((host, local), sums) in enumerate(zip(self.hosts, every, strict=True)):
            compute, comm, data, wall = (float(v) for v in sums.tolist())
            out.append(RankTime(rank, host, local, compute, self.device_type, comm, data, wall))
        return out

    def _gather_hosts(self) -> list[tuple[str, int]]:
        """Every rank's host name and local rank, once (plain tensors: no pickling)."""
        import torch
        import torch.distributed as dist

        name = socket.gethostname().encode()[:HOST_BYTES].ljust(HOST_BYTES, b"\0")
        mine = torch.tensor([*name, self.local_rank], dtype=torch.int64, device=self.device)
        every = [torch.zeros_like(mine) for _unused in range(self.world)]
        dist.all_gather(every, mine, group=self.group)
        hosts = []
        for tensor in every:
            values = [int(v) for v in tensor.tolist()]
            hosts.append((bytes(values[:HOST_BYTES]).rstrip(b"\0").decode(errors="replace"), values[HOST_BYTES]))
        return hosts


def compression_hook(settings: CommSettings, process_group: Any = None) -> tuple[Any, Any]:
    """Return (state, hook) of torch's communication hook for the job's gradient_compression."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if settings.gradient_compression == "powersgd":
        try:
            import numpy  # noqa: F401  # PowerSGDState seeds its random projections with numpy
        except ImportError:
            why = "gradient_compression powersgd needs numpy in the job's venv (python_env installs it)"
            raise ValueError(why) from None
        import torch.distributed as dist

        state = powerSGD_hook.PowerSGDState(
            process_group=process_group,
            matrix_approximation_rank=settings.powersgd_rank,
            start_powerSGD_iter=settings.powersgd_start_step,
        )
        gloo = dist.get_backend(process_group) == "gloo"
        return state, one_bucket_at_a_time(powerSGD_hook.powerSGD_hook) if gloo else powerSGD_hook.powerSGD_hook
    hooks = {
        "none": default_hooks.allreduce_hook,
        "fp16": default_hooks.fp16_compress_hook,
        "bf16": default_hooks.bf16_compress_hook,
    }
    return process_group, hooks[settings.gradient_compression]


def one_bucket_at_a_time(inner: Any) -> Any:
    """Wrap a communication hook so that each bucket's hook starts after the previous bucket's
    communication has ended. gloo pairs the ranks' collectives in the order each rank issues them;
    PowerSGD issues a bucket's second all-reduce from the callback of its first (gloo's thread) while
    backward issues the next bucket's first (the autograd thread), in an order that differs between
    ranks, and gloo fails ("op.preamble.length <= op.nbytes ... collective mismatch"; 2 ranks with
    0.05 MB buckets, 4 ranks with 50 MB of gradients). NCCL's futures complete as the work is queued,
    so the callbacks run in order there: it keeps the overlap."""
    last: list[Any] = []

    # No annotations: DDP checks a hook's annotations against its own types.
    def hook(state, bucket):  # noqa: ANN001, ANN202
        if last:
            last.pop().wait()
        future = inner(state, bucket)
        last.append(future)
        return future

    return hook


def timed_hook(timer: StepTimer, inner: Any) -> Any:
    """Wrap a communication hook so that the timer learns when the last bucket became ready. DDP
    takes one hook per model: the timer wraps the compression hook rather than sit beside it."""

    # No annotations: DDP checks a hook's annotations against its own types, and this module's
    # postponed annotations would be strings.
    def hook(state, bucket):  # noqa: ANN001, ANN202
        if bucket.is_last():
            timer.bucket_ready()
        return inner(state, bucket)

    return hook


def wrap_ddp(
    model: Any,
    device: Any = None,
    settings: CommSettings | None = None,
    process_group: Any = None,
    timer: StepTimer | None = None,
    **ddp_kwargs: Any,
) -> tuple[Any, StepTimer]:
    """Return (DDP of model with the job's bucket size and compression hook wrapped by the timer, the
    timer). Outside a process group: (model, a timer of one rank). settings default to the unit's
    environment (CommSettings.from_env); bf16 on a backend other than NCCL is refused (ValueError)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    settings = settings or CommSettings.from_env()
    if device is None:
        device = next(model.parameters()).device
    device = torch.device(device)
    if not dist.is_initialized():
        alone = timer or StepTimer(0, 1, device, every_steps_from_env(), local_rank=0)
        alone.accumulate_steps = settings.accumulate_steps
        return model, alone
    refusal = settings.refusal(str(dist.get_backend(process_group)))
    if refusal:
        raise ValueError(refusal)
    rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    if timer is None:
        timer = StepTimer(rank, world, device, every_steps_from_env(), group=process_group)
    timer.accumulate_steps = settings.accumulate_steps
    if device.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [device.index])
    ddp = DistributedDataParallel(
        model, process_group=process_group, bucket_cap_mb=settings.bucket_cap_mb, **ddp_kwargs
    )
    state, hook = compression_hook(settings, process_group)
    ddp.register_comm_hook(state, timed_hook(timer, hook))
    timer.comm_state = state
    return ddp, timer
