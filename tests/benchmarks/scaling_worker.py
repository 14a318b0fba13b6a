"""One node's process of the scaling benchmark (scaling.py beside it starts one per node container).

All nodes join one gloo group; the benchmark then runs, round after round, every option at 4 nodes,
2 nodes (a subgroup of ranks 0-1) and 1 node, at the same global batch, under two link shapings
(tbf on each container's eth0, set by the workers themselves at the start of each block). Rank 0
prints one JSON line per measured row; scaling.py collects them. Imports the trainer
(train_ddp: model, data) from --code and budgetgpu_node.straggler (wrap_ddp, the step timer) from the
node package (scaling.py mounts plugins/module_utils as /opt/node/budgetgpu_node, on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# The 2-node rows use ranks 0 and 1 (at the last ratio only: the 2 cores bound the run's time); the
# 1-node row rank 0. "ddp" is stock DDP (its built-in all-reduce); "ddp+timer" adds the timing hook.
OPTIONS_4 = ["legacy", "ddp", "ddp+timer", "fp16", "powersgd", "bucket5", "bucket100", "accumulate2"]
OPTIONS_2 = ["legacy", "ddp", "fp16", "powersgd"]


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--code", required=True, help="directory of train_ddp.py")
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ratios", default="0.1,0.6")
    parser.add_argument("--deadline", type=float, required=True, help="epoch seconds: no round starts after it")
    parser.add_argument("--options4", default=",".join(OPTIONS_4), help="the 4-node rows")
    parser.add_argument("--options2", default=",".join(OPTIONS_2), help="the 2-node rows (at the last ratio)")
    return parser.parse_args()


def emit(row: dict[str, Any]) -> None:
    print(json.dumps(row, sort_keys=True), flush=True)


def shape(rate_bit: float | None) -> None:
    """tbf on this container's eth0 (None: no shaping). 20 ms of burst, 200 ms of queue."""
    subprocess.run(["tc", "qdisc", "del", "dev", "eth0", "root"], capture_output=True, check=False)
    if rate_bit:
        rate_b = rate_bit / 8
        burst = max(int(rate_b * 0.02), 64 * 1024)
        limit = burst + int(rate_b * 0.2)
        subprocess.run(
            ["tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", f"{int(rate_bit)}bit",
             "burst", str(burst), "limit", str(limit)],
            check=True,
        )  # fmt: skip


def throttled_s() -> float:
    """Seconds this container has been held back by its CFS quota (cgroup v2 or v1), 0 if unknown."""
    for path, key, scale in (
        ("/sys/fs/cgroup/cpu.stat", "throttled_usec", 1e-6),
        ("/sys/fs/cgroup/cpu,cpuacct/cpu.stat", "throttled_time", 1e-9),
        ("/sys/fs/cgroup/cpu/cpu.stat", "throttled_time", 1e-9),
    ):
        try:
            fields = dict(line.split() for line in Path(path).read_text().splitlines())
        except OSError:
            continue
        return int(fields.get(key, 0)) * scale
    return 0.0


def option_fields(option: str) -> dict[str, Any]:
    """The job's options (CommSettings' fields) of a row name: "+"-joined fp16, powersgd, bucketN
    (MB), accumulateN, and legacy, ddp or timer, which leave the defaults. ValueError names a word
    that is none of these (scaling.py checks the rows with it before it starts the containers)."""
    fields: dict[str, Any] = {}
    for word in option.split("+"):
        number = word.removeprefix("bucket") if word.startswith("bucket") else word.removeprefix("accumulate")
        if word == "fp16":
            fields["gradient_compression"] = word
        elif word == "powersgd":
            fields.update(gradient_compression=word, powersgd_start_step=2)  # the 2 warm-up steps
        elif word.startswith("bucket") and number.replace(".", "", 1).isdigit():
            fields["bucket_cap_mb"] = float(number)
        elif word.startswith("accumulate") and number.isdigit() and int(number) > 0:
            fields["accumulate_steps"] = int(number)
        elif word not in ("legacy", "ddp", "timer"):
            raise ValueError(
                f"row {option!r}: found {word!r}, expected fp16, powersgd, bucketN, accumulateN, legacy, ddp or timer"
            )
    return fields


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist

        sys.path.insert(0, args.code)
        import train_ddp
        from budgetgpu_node import straggler as helper

        self.torch, self.dist, self.helper, self.train = torch, dist, helper, train_ddp
        self.args = args
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.groups = {4: None, 2: dist.new_group([0, 1]), 1: dist.new_group([0])}
        self.base = train_ddp.make_model(args.hidden, 0, args.layers)
        self.numel = sum(p.numel() for p in self.base.parameters())
        self.loaders: dict[int, Any] = {}

    def data(self, batch: int) -> Any:
        """A DataLoader with one worker (the trainer's default) per per-rank batch size, kept."""
        if batch not in self.loaders:
            ns = argparse.Namespace(seed=0, batch_size=batch, max_steps=10**6, data_delay=0.0, data_workers=1)
            self.loaders[batch] = iter(self.train.batches(ns, self.rank, 0, 1))
        return self.loaders[batch]

    def compute_and_allreduce(self) -> tuple[float, float]:
        """(forward+backward seconds of the 4-node batch, seconds of one all-reduce of the gradients
        across 4 nodes), medians of 3, all ranks at once (the same CPU contention as the runs)."""
        torch, nn = self.torch, self.torch.nn
        model = copy.deepcopy(self.base)
        data = self.data(self.args.global_batch // 4)
        times = []
        for _repeat in range(3):
            inputs, labels = next(data)
            start = time.perf_counter()
            nn.functional.cross_entropy(model(inputs), labels).backward()
            times.append(time.perf_counter() - start)
        flat = torch.zeros(self.numel)
        reduce_times = []
        for _repeat in range(3):
            self.dist.barrier()
            start = time.perf_counter()
            self.dist.all_reduce(flat)
            reduce_times.append(time.perf_counter() - start)
        return statistics.median(times), statistics.median(reduce_times)

    def settings(self, option: str) -> Any:
        return self.helper.CommSettings(**option_fields(option))

    def run(self, option: str, nodes: int) -> dict[str, Any] | None:
        """Train warmup + steps steps of option on the first `nodes` ranks; rank 0's row."""
        torch, dist, helper = self.torch, self.dist, self.helper
        if self.rank >= nodes:
            return None
        group = self.groups[nodes]
        settings = self.settings(option)
        model = copy.deepcopy(self.base)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        timer = helper.StepTimer(self.rank, nodes, torch.device("cpu"), self.args.steps, local_rank=0, group=group)
        ddp: Any = model
        if nodes > 1 and option != "legacy":
            ddp = torch.nn.parallel.DistributedDataParallel(
                model, process_group=group, bucket_cap_mb=settings.bucket_cap_mb
            )
            if option != "ddp":  # stock DDP: its built-in all-reduce, no hook, no timer mark
                state, hook = helper.compression_hook(settings, group)
                ddp.register_comm_hook(state, helper.timed_hook(timer, hook))
        timer.accumulate_steps = settings.accumulate_steps
        data = self.data(self.args.global_batch // nodes)
        walls = []
        for step in range(self.args.warmup + self.args.steps):
            if step == self.args.warmup:
                dist.barrier(group=group) if nodes > 1 else None
                throttled_from = throttled_s()
                timer.sums, timer.window_steps, timer._step_start = [0.0] * 4, 0, None  # warm-up: no step's
            started = time.perf_counter()
            if option == "legacy" and nodes > 1:
                self.legacy_step(model, optimizer, data, timer, group, nodes)
            else:
                self.train.train_step(ddp, optimizer, data, self.train.Dist(world=nodes), timer, 1.0)
            walls.append(time.perf_counter() - started)
            timer.step_done() if step >= self.args.warmup else None
        times = timer.times
        throttled = (throttled_s() - throttled_from) / self.args.steps
        del ddp, model, optimizer
        gc.collect()
        if self.rank != 0:
            return None
        row = self.row(option, nodes, settings, walls[self.args.warmup :], times)
        return {**row, "throttled_s": round(throttled, 4)}

    def legacy_step(self, model: Any, optimizer: Any, data: Any, timer: Any, group: Any, nodes: int) -> None:
        """The trainer before this change: forward and backward without DDP, then one all-reduce of
        a torch.cat of every gradient, copied back."""
        torch, nn = self.torch, self.torch.nn
        optimizer.zero_grad(set_to_none=True)
        with timer.data():
            inputs, labels = next(data)
        with timer.compute():
            nn.functional.cross_entropy(model(inputs), labels).backward()
        start = time.perf_counter()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.dist.all_reduce(flat, group=group)
        flat /= nodes
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
        timer.sums[1] += time.perf_counter() - start
        with timer.compute():
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()

    def row(self, option: str, nodes: int, settings: Any, walls: list[float], times: list[Any]) -> dict[str, Any]:
        wall = statistics.median(walls)
        batch = self.args.global_batch * settings.accumulate_steps
        parts = {"compute": 0.0, "comm": 0.0, "data": 0.0, "wall": 0.0}
        for t in times:
            for key, value in zip(parts, (t.seconds, t.comm_s, t.data_s, t.wall_s), strict=True):
                parts[key] += value / len(times) / self.args.steps
        return {
            "option": option,
            "nodes": nodes,
            "global_batch": batch,
            "step_s": round(wall, 4),
            "samples_per_s": round(batch / wall, 3),
            "breakdown_s": {k: round(v, 4) for k, v in parts.items()},
        }


def calibrate(bench: Bench, ratios: list[float]) -> dict[float, float | None]:
    """tbf rates (bit/s) that make one 4-node all-reduce take each ratio of forward+backward; None
    where the unshaped all-reduce is already slower than that (the CPU quota bounds it)."""
    torch, dist = bench.torch, bench.dist
    shape(None)
    compute, unshaped = bench.compute_and_allreduce()
    rates: dict[float, float | None] = {}
    # A ring all-reduce sends 2 (N-1) / N of the tensor from every node.
    wire = 2 * 3 / 4 * bench.numel * 4 * 8
    for ratio in ratios:
        target = ratio * compute
        rate = None if unshaped >= target else wire / target
        for _correction in range(2):  # two corrections: the CPU's share is not on the wire
            if rate is None:
                break
            shape(rate)
            dist.barrier()
            _unused, shaped = bench.compute_and_allreduce()
            rate *= shaped / target
            rate = None if rate > 40e9 else rate  # the CPU, not the wire, bounds it: no shaping reaches it
        vote = torch.tensor([rate or 0.0], dtype=torch.float64)
        dist.all_reduce(vote, op=dist.ReduceOp.MAX)  # one rate for all nodes
        rates[ratio] = float(vote.item()) or None
        if bench.rank == 0:
            emit({"calibration": ratio, "compute_s": compute, "unshaped_s": unshaped, "rate_bit": rates[ratio]})
    shape(None)
    return rates


def main() -> int:
    args = parse()
    bench = Bench(args)
    ratios = [float(r) for r in args.ratios.split(",")]
    rates = calibrate(bench, ratios)
    four, two = ([o for o in text.split(",") if o] for text in (args.options4, args.options2))
    for round_ in range(args.rounds):
        go = bench.torch.tensor([1 if time.time() < args.deadline else 0])
        bench.dist.broadcast(go, src=0)
        if not int(go.item()):
            break
        shift = round_  # rotate the order: no option always first after a reshape
        for ratio in ratios:
            shape(rates[ratio])
            bench.dist.barrier()
            blocks = ((4, four), (2, two)) if ratio == ratios[-1] else ((4, four),)
            for nodes, options in (block for block in blocks if block[1]):  # --options2 "": no 2-node rows
                for option in options[shift % len(options) :] + options[: shift % len(options)]:
                    row = bench.run(option, nodes)
                    bench.dist.barrier()
                    if row:
                        emit({**row, "round": round_, "ratio": ratio, "rate_bit": rates[ratio]})
            if ratio == ratios[0]:
                row = bench.run("ddp", 1)
                bench.dist.barrier()
                if row:
                    emit({**row, "round": round_, "ratio": None, "rate_bit": None})
    shape(None)
    bench.dist.barrier()
    os._exit(0)  # the loaders' worker processes need no orderly goodbye


if __name__ == "__main__":
    sys.exit(main())
