"""Stragglers seen from inside a DDP job: each rank's compute time per step, apart from the time it
waits in the gradient all-reduce, gathered every N steps; rank 0 names the slowest rank against the
median of all ranks.

One slow GPU (bad thermal paste, a dead fan, a throttled card) makes every rank wait for it in the
all-reduce, so the step time of every rank is the same and says nothing. The time each rank spends
computing (forward and backward, before its gradients are reduced) does.

Installed by the torchrun role beside the example trainer (/opt/budgetgpu/examples) and on the
PYTHONPATH of every job unit, so a job's own training loop can use it:

    from budgetgpu_straggler import StepTimer, all_reduce_gradients

    timer = StepTimer.from_env(rank, world, device)        # every N steps: BUDGETGPU_STRAGGLER_EVERY_STEPS
    for batch in data:
        optimizer.zero_grad()
        with ddp.no_sync(), timer.compute():              # no all-reduce inside: compute time only
            loss = loss_fn(ddp(batch.inputs), batch.labels)
            loss.backward()
        all_reduce_gradients(model, world)                 # the all-reduce DDP would have done
        optimizer.step()
        line = timer.step_done()                           # a collective every N steps
        if line:                                           # rank 0 only
            print(line, flush=True)

The decision (median, ratio, which rank, the line) is plain Python below; only StepTimer and
all_reduce_gradients need torch (imported when they are used). Rank 0 may also write the job's
status for `playbooks/train.yml -e job_state=status` with write_status().
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class RankTime:
    """One rank's compute seconds over a report's window and where it runs."""

    rank: int
    host: str
    local_rank: int
    seconds: float
    device: str = "cuda"

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
        when even), the threshold, the window's steps and each rank's compute seconds per step. The
        health watch exports them (job_metrics.py: budgetgpu_job_straggler_ratio, _step_seconds)."""
        steps = max(self.steps, 1)
        return {
            "straggler_ratio": round(1 + self.ratio, 4),
            "straggler_threshold": self.threshold,
            "window_steps": self.steps,
            "ranks": [
                {"rank": t.rank, "host": t.host, "local_rank": t.local_rank, "step_s": round(t.seconds / steps, 6)}
                for t in sorted(self.times, key=lambda t: t.rank)
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


# --- torch: measuring and gathering -------------------------------------------------------


def all_reduce_gradients(model: Any, world: int) -> None:
    """Average the gradients of model across the ranks in one all-reduce (what DDP does in its
    backward; call it after a backward run under ddp.no_sync())."""
    if world <= 1:
        return
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


class StepTimer:
    """Sums one rank's compute seconds and, every `every` steps, gathers every rank's sum; rank 0
    gets the finding. step_done() is a collective every `every` steps: call it on every rank."""

    def __init__(
        self,
        rank: int,
        world: int,
        device: Any,
        every: int = DEFAULT_EVERY_STEPS,
        threshold: float = STRAGGLER_THRESHOLD,
        local_rank: int | None = None,
    ) -> None:
        self.rank, self.world, self.device = rank, world, device
        self.every, self.threshold = every, threshold
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
        self.window_s = 0.0
        self.window_steps = 0
        self.hosts: list[tuple[str, int]] | None = None
        self.last: Finding | None = None

    @classmethod
    def from_env(cls, rank: int, world: int, device: Any, threshold: float = STRAGGLER_THRESHOLD) -> StepTimer:
        return cls(rank, world, device, every_steps_from_env(), threshold)

    @property
    def device_type(self) -> str:
        return getattr(self.device, "type", str(self.device))

    def _sync(self) -> None:
        if self.device_type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    @contextmanager
    def compute(self) -> Iterator[None]:
        """Time the block (on a GPU up to the end of its kernels) as this rank's compute."""
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self.window_s += time.perf_counter() - start

    def step_done(self) -> str | None:
        """Count a step; every `every` steps gather the ranks' compute times and return rank 0's line
        (None on other ranks, between reports, or with `every` 0)."""
        self.window_steps += 1
        if self.every <= 0 or self.window_steps < self.every or self.world < 2:
            return None
        finding = self.gather()
        self.window_s, self.window_steps = 0.0, 0
        self.last = finding
        return finding.line if finding else None

    def gather(self) -> Finding | None:
        import torch
        import torch.distributed as dist

        if self.hosts is None:
            self.hosts = self._gather_hosts()
        mine = torch.tensor([self.window_s], dtype=torch.float64, device=self.device)
        every = [torch.zeros_like(mine) for _unused in range(self.world)]
        dist.all_gather(every, mine)
        if self.rank != 0:
            return None
        times = [
            RankTime(rank, host, local, float(t.item()), self.device_type)
            for rank, ((host, local), t) in enumerate(zip(self.hosts, every, strict=True))
        ]
        return slowest_against_median(times, self.window_steps, self.threshold)

    def _gather_hosts(self) -> list[tuple[str, int]]:
        """Every rank's host name and local rank, once (plain tensors: no pickling)."""
        import torch
        import torch.distributed as dist

        name = socket.gethostname().encode()[:HOST_BYTES].ljust(HOST_BYTES, b"\0")
        mine = torch.tensor([*name, self.local_rank], dtype=torch.int64, device=self.device)
        every = [torch.zeros_like(mine) for _unused in range(self.world)]
        dist.all_gather(every, mine)
        hosts = []
        for tensor in every:
            values = [int(v) for v in tensor.tolist()]
            hosts.append((bytes(values[:HOST_BYTES]).rstrip(b"\0").decode(errors="replace"), values[HOST_BYTES]))
        return hosts
