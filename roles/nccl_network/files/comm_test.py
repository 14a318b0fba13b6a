#!/usr/bin/env python3
"""All-reduce sweep across the cluster, as nccl-tests' all_reduce_perf reports it, plus send/recv per pair.

Run under torchrun on every node (NCCL on GPUs, gloo on CPU). For each message size from --min-bytes
to --max-bytes (doubling): warm-up, then timed iterations; the time is the slowest rank's mean,
algbw = size / time, busbw = algbw * 2(n-1)/n. Each size's result is checked (every rank adds its
rank + 1, so every element must equal n(n+1)/2). Then node i's first rank sends the largest message
to node i+1's (the links a ring all-reduce uses), one pair at a time. Rank 0 writes one JSON file.

Environment: BUDGETGPU_NODE (inventory name) and BUDGETGPU_NODE_ADDR (NCCL address), set by Ansible.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time
from typing import Any

import torch
import torch.distributed as dist


def sizes(min_bytes: int, max_bytes: int) -> list[int]:
    out, size = [], min_bytes
    while size <= max_bytes:
        out.append(size)
        size *= 2
    return out


def busbw_factor(world_size: int) -> float:
    return 2.0 * (world_size - 1) / world_size if world_size > 1 else 1.0


class Timer:
    """Wall-clock timing that waits for the GPU when there is one."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def now(self) -> float:
        self.sync()
        return time.perf_counter()


def slowest(value: float, device: torch.device) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def sweep(args: argparse.Namespace, device: torch.device, timer: Timer) -> list[dict[str, Any]]:
    world = dist.get_world_size()
    rank = dist.get_rank()
    factor = busbw_factor(world)
    expected = world * (world + 1) / 2
    rows = []
    for size in sizes(args.min_bytes, args.max_bytes):
        count = max(size // 4, 1)
        tensor = torch.full((count,), float(rank + 1), dtype=torch.float32, device=device)
        dist.all_reduce(tensor)
        timer.sync()
        wrong = int((tensor != expected).sum().item())
        # Small messages are latency-bound and noisy: give them more iterations.
        iters = args.iters * (4 if size <= (1 << 20) else 1)
        for _unused in range(args.warmup):
            dist.all_reduce(tensor)
        dist.barrier()
        start = timer.now()
        for _unused in range(iters):
            dist.all_reduce(tensor)
        elapsed = (timer.now() - start) / iters
        elapsed = slowest(elapsed, device)
        algbw = size / elapsed / 1e9
        rows.append(
            {
                "bytes": size,
                "count": count,
                "iters": iters,
                "time_us": round(elapsed * 1e6, 1),
                "algbw_gbs": round(algbw, 4),
                "busbw_gbs": round(algbw * factor, 4),
                "wrong": wrong,
            }
        )
        if rank == 0:
            print(
                f"{size:>12} {elapsed * 1e6:>12.1f} us {algbw:>8.3f} GB/s algbw {algbw * factor:>8.3f} GB/s busbw",
                flush=True,
            )
    return rows


def pair_bandwidth(
    args: argparse.Namespace, device: torch.device, timer: Timer, nodes: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Send the largest message from each node's first rank to the next node's, one pair at a time."""
    rank = dist.get_rank()
    leaders: list[dict[str, Any]] = []
    for info in nodes:
        if info["node"] not in [leader["node"] for leader in leaders]:
            leaders.append(info)
    if len(leaders) < 2:
        return []
    count = max(args.max_bytes // 4, 1)
    tensor = torch.ones(count, dtype=torch.float32, device=device)
    pairs = []
    ring = list(zip(leaders, leaders[1:] + leaders[:1], strict=True))
    if len(leaders) == 2:
        ring = ring[:2]
    for src, dst in ring:
        dist.barrier()
        elapsed = 0.0
        if rank in (src["rank"], dst["rank"]):
            for index in range(args.warmup + args.pair_iters):
                if index == args.warmup:
                    start = timer.now()
                if rank == src["rank"]:
                    dist.send(tensor, dst=dst["rank"])
                else:
                    dist.recv(tensor, src=src["rank"])
            elapsed = (timer.now() - start) / args.pair_iters
        elapsed = slowest(elapsed, device)
        gbs = args.max_bytes / elapsed / 1e9
        pairs.append(
            {
                "src": src["node"],
                "dst": dst["node"],
                "src_addr": src["addr"],
                "dst_addr": dst["addr"],
                "bytes": args.max_bytes,
                "time_us": round(elapsed * 1e6, 1),
                "gbs": round(gbs, 4),
            }
        )
        if rank == 0:
            print(f"pair {src['node']} -> {dst['node']}: {gbs:.3f} GB/s", flush=True)
    return pairs


def all_gather_json(obj: dict[str, Any], device: torch.device, world: int) -> list[dict[str, Any]]:
    """Every rank's obj, in rank order. Plain tensor collectives: all_gather_object needs numpy,
    which a training venv need not have."""
    data = json.dumps(obj).encode()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _unused in range(world)]
    dist.all_gather(sizes, size)
    lengths = [int(s.item()) for s in sizes]
    buffer = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    buffer[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buffers = [torch.zeros_like(buffer) for _unused in range(world)]
    dist.all_gather(buffers, buffer)
    return [json.loads(bytes(b[:n].cpu().tolist())) for b, n in zip(buffers, lengths, strict=True)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["nccl", "gloo"], required=True)
    parser.add_argument("--min-bytes", type=int, default=1024)
    parser.add_argument("--max-bytes", type=int, default=64 << 20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--pair-iters", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    started = time.time()
    dist.init_process_group(backend=args.backend, timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = {
        "rank": rank,
        "local_rank": local_rank,
        "node": os.environ.get("BUDGETGPU_NODE", socket.gethostname()),
        "addr": os.environ.get("BUDGETGPU_NODE_ADDR", ""),
        "ifname": os.environ.get("GLOO_SOCKET_IFNAME", ""),
    }
    nodes = all_gather_json(me, device, world)
    timer = Timer(device)
    rows = sweep(args, device, timer)
    pairs = pair_bandwidth(args, device, timer, nodes)
    dist.barrier()
    if rank == 0:
        env_keys = sorted(k for k in os.environ if k.startswith(("NCCL_", "GLOO_")))
        result = {
            "backend": args.backend,
            "world_size": world,
            "nodes": sorted({n["node"] for n in nodes}, key=[n["node"] for n in nodes].index),
            "ranks": nodes,
            "busbw_factor": busbw_factor(world),
            "sizes": rows,
            "pairs": pairs,
            "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if args.backend == "nccl" else None,
            "env": {k: os.environ[k] for k in env_keys},
            "duration_s": round(time.time() - started, 2),
        }
        with open(args.out + ".tmp", "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=1)
        os.replace(args.out + ".tmp", args.out)
    dist.barrier()
    # Before the interpreter's teardown: NCCL wants its communicators destroyed, and a gloo group's worker
    # threads must be joined, or one that lets go of a finished collective's tensors during the teardown
    # cannot take the GIL and the rank aborts (train_ddp.exit_process). Nothing else holds this group.
    dist.destroy_process_group()
    wrong = sum(row["wrong"] for row in rows)
    if wrong:
        print(f"rank {rank}: {wrong} wrong elements after all-reduce: the transport corrupts data", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is written by now. gloo's threads can still abort a finished rank while the
    # interpreter tears down ("terminate called without an active exception", seen under load):
    # skip that teardown, so the exit status is this rank's result.
    os._exit(code)
