"""One node's process of the sharded benchmark (sharded.py beside it starts one per node container).

All four nodes join one gloo group. The worker calibrates the link as the scaling benchmark does
(scaling_worker.calibrate: a tbf rate per ratio of one all-reduce of the gradients to a forward+backward), then,
round after round and at each shaping, trains the example trainer's GPT-2 (train_ddp.GPT2Model) under DDP, FSDP
and HSDP on the four nodes, as budgetgpu_node.sharding.wrap_model spreads it, at one global batch, the order
rotating each round; and once a round the whole global batch on one node (rank 0, no wrapper). Rank 0 prints one
JSON line per row: samples/s, and per rank the bytes of parameters, gradients and AdamW states it holds (its local
shards) and its peak of malloc'ed bytes in use during the row (memory_in_use), less what was in use before it.

On CPU there are no allocator statistics (torch.cuda.max_memory_allocated has no CPU twin), so the peak is glibc's:
mallinfo2's bytes in mmapped blocks plus the main arena's in use, sampled every 5 ms by a thread. sharded.py runs
the worker with MALLOC_MMAP_THRESHOLD_=65536, so every tensor of 64 KiB or more is a mapping of its own, counted
whichever thread allocated it, and freed memory is not held back in an arena.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import sys
import threading
import time
from typing import Any

from scaling_worker import calibrate, emit, shape, throttled_s

PARALLELISMS = ("ddp", "fsdp", "hsdp")
# HSDP on four containers of one rank each: a 2 x 2 mesh (two "nodes" of two ranks: replicate across the pairs,
# shard within a pair). Every container's link is shaped, so the pairs' own traffic crosses it too.
HSDP_LOCAL = 2


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--code", required=True, help="directory of train_ddp.py")
    parser.add_argument("--global-batch", type=int, default=16, help="sequences a step, over all ranks")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ratios", default="0.6,4")
    parser.add_argument("--deadline", type=float, required=True, help="epoch seconds: no round starts after it")
    return parser.parse_args()


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")
    ]  # fmt: skip


class Peak:
    """The most malloc'ed bytes in use (mmapped blocks + the main arena's) since reset(), sampled by a thread."""

    def __init__(self) -> None:
        self.libc = ctypes.CDLL("libc.so.6")
        self.libc.mallinfo2.restype = MallInfo2
        self.peak = 0
        # A sample in flight at reset() must not write the last row's peak into the new one.
        self.lock = threading.Lock()
        threading.Thread(target=self.sample, daemon=True).start()

    def in_use(self) -> int:
        info = self.libc.mallinfo2()
        return int(info.hblkhd + info.uordblks)

    def sample(self) -> None:
        while True:
            with self.lock:
                self.peak = max(self.peak, self.in_use())
            time.sleep(0.005)

    def reset(self) -> int:
        """Start a new peak; return the bytes in use now (the row's base)."""
        with self.lock:
            self.peak = self.in_use()
            return self.peak


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist

        sys.path.insert(0, args.code)
        import train_ddp
        from budgetgpu_node import sharding, straggler

        self.torch, self.dist, self.train, self.sharding, self.straggler = torch, dist, train_ddp, sharding, straggler
        self.args = args
        torch.set_num_threads(1)
        # Each container is a node of one rank as the job plans it (HSDP's LOCAL_WORLD_SIZE of 2 is the mesh's
        # only): no row is taken for a restart on fewer GPUs, whose accumulation would change the batch.
        os.environ[sharding.PLANNED_LOCAL_ENV] = "1"
        dist.init_process_group("gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.size = {"layers": args.layers, "width": args.width, "heads": args.heads, "vocab": 256,
                     "seq_len": args.seq_len}  # fmt: skip
        self.numel = sum(p.numel() for p in self.model().parameters())
        self.tokens = train_ddp.text_tokens()
        self.memory = Peak()

    def model(self) -> Any:
        self.torch.manual_seed(0)
        return self.train.GPT2Model(self.size)

    def batches(self, nodes: int) -> Any:
        """This rank's share of the global batch of each step: text windows of the trainer's own corpus."""
        batch = self.args.global_batch // nodes
        micro = 0
        while True:
            micro += 1
            yield self.train.text_batch(self.tokens, 0, nodes, self.args.seq_len, micro, self.rank, batch)

    def loss(self, model: Any, inputs: Any, labels: Any) -> Any:
        return self.torch.nn.functional.cross_entropy(model(inputs).flatten(0, -2), labels.flatten())

    def compute_and_allreduce(self) -> tuple[float, float]:
        """(forward+backward seconds of a 4-node share of the batch, seconds of one all-reduce of the gradients'
        size across the 4 nodes), medians of 3, all ranks at once: what scaling_worker.calibrate shapes for."""
        model, data = self.model(), self.batches(self.world)
        times = []
        for _repeat in range(3):
            inputs, labels = next(data)
            start = time.perf_counter()
            self.loss(model, inputs, labels).backward()
            times.append(time.perf_counter() - start)
        flat = self.torch.zeros(self.numel)
        reduce_times = []
        for _repeat in range(3):
            self.dist.barrier()
            start = time.perf_counter()
            self.dist.all_reduce(flat)
            reduce_times.append(time.perf_counter() - start)
        return statistics.median(times), statistics.median(reduce_times)

    def wrap(self, parallelism: str, nodes: int) -> Any:
        """The model as the job would spread it over `nodes` ranks; one node: the model itself, no wrapper."""
        sharding, straggler, cpu = self.sharding, self.straggler, self.torch.device("cpu")
        model = self.model()
        if nodes == 1:
            timer = straggler.StepTimer(0, 1, cpu, every=0, local_rank=0)
            return sharding.Wrapped(model, model, timer, sharding.ShardSettings())
        os.environ["LOCAL_WORLD_SIZE"] = str(HSDP_LOCAL if parallelism == "hsdp" else 1)
        timer = straggler.StepTimer(self.rank, nodes, cpu, every=0, local_rank=0)
        settings = sharding.ShardSettings(parallelism=parallelism)
        return sharding.wrap_model(model, cpu, settings, straggler.CommSettings(), timer=timer)

    def held_bytes(self, wrapped: Any, optimizer: Any) -> int:
        """The bytes of parameters, gradients and optimizer states this rank holds (its shards under FSDP)."""
        tensors = []
        for param in wrapped.module.parameters():
            tensors += [param, param.grad] if param.grad is not None else [param]
        tensors += [v for state in optimizer.state.values() for v in state.values() if self.torch.is_tensor(v)]
        local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
        return sum(t.numel() * t.element_size() for t in local)

    def run(self, parallelism: str, nodes: int, steps: int | None = None) -> dict[str, Any] | None:
        """Train warmup + steps steps on the first `nodes` ranks; rank 0's row with every rank's memory."""
        if self.rank >= nodes:
            return None
        steps = self.args.steps if steps is None else steps
        gc.collect()  # FSDP's modules hold reference cycles: the last row's tensors go now, not during this one
        base = self.memory.reset()
        wrapped = self.wrap(parallelism, nodes)
        optimizer = self.torch.optim.AdamW(wrapped.module.parameters(), lr=6e-4, betas=(0.9, 0.95))
        ctx = self.train.Dist(rank=self.rank, world=nodes)
        data = self.batches(nodes)
        walls = []
        for step in range(self.args.warmup + steps):
            if step == self.args.warmup:
                self.dist.barrier() if nodes > 1 else None
                throttled_from = throttled_s()
            started = time.perf_counter()
            self.train.train_step(wrapped, optimizer, data, ctx, 1.0)
            walls.append(time.perf_counter() - started)
        throttled = (throttled_s() - throttled_from) / steps
        mine = {"held_bytes": self.held_bytes(wrapped, optimizer), "peak_bytes": self.memory.peak - base}
        ranks = [mine]
        if nodes > 1:
            ranks = [None] * nodes
            self.dist.all_gather_object(ranks, mine)
        del wrapped, optimizer
        gc.collect()
        if self.rank != 0:
            return None
        wall = statistics.median(walls[self.args.warmup :])
        return {
            "parallelism": parallelism if nodes > 1 else "one node",
            "nodes": nodes,
            "global_batch": self.args.global_batch,
            "step_s": round(wall, 4),
            "samples_per_s": round(self.args.global_batch / wall, 3),
            "throttled_s": round(throttled, 4),
            "ranks": ranks,
        }


def main() -> int:
    args = parse()
    bench = Bench(args)
    if bench.rank == 0:
        emit({"model": bench.size, "params": bench.numel, "global_batch": args.global_batch})
    ratios = [float(r) for r in args.ratios.split(",")]
    rates = calibrate(bench, ratios)
    # One step of each row first, not reported: what the process allocates once and keeps (gloo's buffers, the
    # autograd engine's) would otherwise count in the peak of whichever row came first.
    for parallelism in PARALLELISMS:
        bench.run(parallelism, bench.world, steps=1)
        bench.dist.barrier()
    for round_ in range(args.rounds):
        go = bench.torch.tensor([1 if time.time() < args.deadline else 0])
        bench.dist.broadcast(go, src=0)
        if not int(go.item()):
            break
        for ratio in ratios:
            shape(rates[ratio])
            bench.dist.barrier()
            order = PARALLELISMS[round_ % 3 :] + PARALLELISMS[: round_ % 3]  # no row always first after a reshape
            for parallelism in order:
                row = bench.run(parallelism, bench.world)
                bench.dist.barrier()
                if row:
                    emit({**row, "round": round_, "ratio": ratio, "rate_bit": rates[ratio]})
            if ratio == ratios[0]:  # one node has no link: once a round
                row = bench.run("ddp", 1)
                bench.dist.barrier()
                if row:
                    emit({**row, "round": round_, "ratio": None, "rate_bit": None})
    shape(None)
    bench.dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
