"""The sharded benchmark of docs/benchmarks/sharded.md: DDP, FSDP and HSDP side by side at one global batch on
the scaling benchmark's four node containers, CPU quota and link shaping (scaling.py: its containers, network and
torch; scaling_worker.py: its calibration and tbf), in one run, interleaved: samples/s, the bytes of parameters,
gradients and optimizer states each rank holds, its measured peak, and the training memory planner's peak and
link verdict (plugins/plugin_utils/training_memory.py) beside them.

    python3 tests/benchmarks/sharded.py --out /tmp/sharded.json      # then: --table /tmp/sharded.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from scaling import ROOT, cleanup, launch, spread, start, torch_dir

sys.path.insert(0, str(ROOT / ".collections"))  # the planner, from the checkout
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils import training_memory  # noqa: E402

MB = 1e6
# The shard group of each row (sharded_worker.HSDP_LOCAL: HSDP shards within pairs of containers).
SHARD = {"ddp": 1, "fsdp": 4, "hsdp": 2, "one node": 1}


def planned(head: dict[str, Any], row: dict[str, Any], one_node_s: float) -> dict[str, Any]:
    """The planner's rank for the row (fp32, AdamW, no checkpointing; one node as an unwrapped rank) and, for
    ddp and fsdp over the four nodes, its link verdict at the row's tbf rate (the effective rate of the unshaped
    all-reduce where no shaping ran)."""
    size = head["model"]
    spec = training_memory.model_spec(
        {"params": head["params"], **{k: size[k] for k in ("layers", "width", "vocab", "seq_len")},
         "batch_size": row["global_batch"] // row["nodes"], "one_node_step_s": one_node_s, "implementation": "example"}
    )  # fmt: skip
    parallelism = "fsdp" if row["nodes"] == 1 else row["parallelism"]  # fsdp at 1: no DDP buckets, as planned
    options = {"parallelism": parallelism, "mixed_precision": "none", "state_precision": "fp32",
               "activation_checkpointing": False, "accumulate_steps": 1}  # fmt: skip
    plan = training_memory.rank_plan(spec, options, SHARD[row["parallelism"]])
    link = None
    if row["parallelism"] in ("ddp", "fsdp"):
        link = training_memory.link_verdict(spec, options, {"nodes": 4, "nproc": 1, "world": 4}, row["link_bit"])
    return {"plan": plan, "link": link}


def table(rows: list[dict[str, Any]]) -> str:
    """Per shaping and row: samples/s and the step, median (min-max) over rounds; per rank the bytes held and the
    measured peak (median over rounds of the largest rank); the planner's peak and its ratio to the measured one;
    the planner's link verdict against the step measured. Then the goals."""
    head = next(r for r in rows if "model" in r)
    calibration = {r["calibration"]: r for r in rows if "calibration" in r}
    runs = [r for r in rows if "parallelism" in r]
    one = [r for r in runs if r["nodes"] == 1]
    one_node_s = statistics.median(r["step_s"] for r in one)
    lines = [f"model: {json.dumps(head['model'])}, {head['params']} parameters, global batch {head['global_batch']}"]
    lines += [f"calibration: {json.dumps(c)}" for c in calibration.values()]
    lines += ["", "| shaping | row | samples/s median (min-max) | step s | held MB a rank | measured peak MB a rank "
              "(beyond held) | planned peak MB (states + buckets + activations + gathered) | planned / measured | "
              "link verdict (planned step s) | rounds |", "| --- " * 10 + "|"]  # fmt: skip
    groups: dict[tuple[Any, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["ratio"], r["parallelism"]), []).append(r)
    held, ratios, verdicts = {}, [], []
    for (ratio, parallelism), found in sorted(groups.items(), key=lambda kv: (kv[0][0] is None, str(kv[0]))):
        cal = calibration.get(ratio) or {}
        # The link the planner is told: the tbf rate, else what the unshaped all-reduce carried (a ring sends
        # 1.5x the gradients' bytes from each of 4 nodes).
        unshaped = 1.5 * head["params"] * 4 * 8 / cal["unshaped_s"] if cal.get("unshaped_s") else None
        link_bit = cal.get("rate_bit") or unshaped
        plan = planned(head, {**found[0], "link_bit": link_bit}, one_node_s)
        peak = statistics.median(max(rank["peak_bytes"] for rank in r["ranks"]) for r in found)
        held[parallelism] = max(rank["held_bytes"] for rank in found[0]["ranks"])
        steps = [r["step_s"] for r in found]
        p = plan["plan"]
        ratios.append((parallelism, ratio, p["peak"] / peak))
        verdict = "-"
        if plan["link"]:
            link = plan["link"]
            measured_slower = statistics.median(steps) >= one_node_s
            verdicts.append((parallelism, ratio, link["slower"], measured_slower))
            verdict = f"{'slower' if link['slower'] else 'faster'} than one node ({link['step_s']:.2f})"
        shaping = "one node" if ratio is None else f"{ratio} ({(link_bit or 0) / 1e6:.0f} Mbit/s)"
        parts = " + ".join(f"{p[k] / MB:.1f}" for k in ("states", "ddp_buckets", "activations", "gathered"))
        lines.append(
            f"| {shaping} | {parallelism} | {spread([r['samples_per_s'] for r in found])} | {spread(steps, 3)} | "
            f"{held[parallelism] / MB:.1f} | {peak / MB:.1f} ({(peak - held[parallelism]) / MB:.1f}) | "
            f"{p['peak'] / MB:.1f} ({parts}) | "
            f"{p['peak'] / peak:.2f} | {verdict} | {len(found)} |"
        )
    block = (12 * head["model"]["width"] ** 2 + 13 * head["model"]["width"]) * 16  # fp32 AdamW: 16 bytes each
    lines += ["", f"one node's step: {one_node_s:.3f} s"]
    lines.append(
        "goal, planner within 15% of the measured peak: "
        + ", ".join(f"{p} at {r}: {x:.2f}" for p, r, x in ratios)
        + f" ({sum(abs(x - 1) <= 0.15 for _p, _r, x in ratios)} of {len(ratios)} rows within)"
    )
    if "ddp" in held and "fsdp" in held:
        limit = held["ddp"] / 4 + block
        lines.append(
            f"goal, FSDP's state a rank at most DDP's / 4 + one block: {held['fsdp'] / MB:.2f} MB against "
            f"{held['ddp'] / MB:.2f} / 4 + {block / MB:.2f} = {limit / MB:.2f} MB: "
            + ("met" if held["fsdp"] <= limit else "not met")
        )
    lines.append(
        "goal, the planner says when sharding over the link is slower than one node: "
        + ", ".join(
            f"{p} at {r}: planned {'slower' if a else 'faster'}, measured {'slower' if b else 'faster'}"
            for p, r, a, b in verdicts
        )  # fmt: skip
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/budgetgpu-sharded.json", help="the rows as JSON")
    parser.add_argument("--table", help="print the table of an earlier --out file and exit")
    parser.add_argument("--cpus", type=float, default=0.3, help="CPU quota of each node container")
    parser.add_argument("--cpu-period-ms", type=float, default=10, help="CFS period of the quota (docker: 100)")
    parser.add_argument("--minutes", type=float, default=10, help="no round starts after this")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per row (after 1 warm-up step)")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4, help="GPT-2's blocks")
    parser.add_argument("--width", type=int, default=256, help="GPT-2's width")
    parser.add_argument("--seq-len", type=int, default=64, help="GPT-2's context")
    parser.add_argument("--ratios", default="0.6,4", help="all-reduce over forward+backward time to shape for")
    parser.add_argument("--torch-dir", type=Path, default=Path("/tmp/budgetgpu-scaling-torch"))
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return 0
    started = time.monotonic()
    deadline = time.time() + args.minutes * 60
    worker = ["python3", "/opt/bench/sharded_worker.py", "--code", "/opt/code", "--deadline", str(deadline),
              "--rounds", str(args.rounds), "--global-batch", str(args.global_batch), "--steps", str(args.steps),
              "--layers", str(args.layers), "--width", str(args.width), "--seq-len", str(args.seq_len),
              "--ratios", args.ratios]  # fmt: skip
    try:
        start(args.cpus, args.cpu_period_ms, torch_dir(args.torch_dir))
        # Every tensor of 64 KiB or more its own mapping: the worker's peak counts it (sharded_worker.Peak).
        rows = launch(worker, args.out, args.minutes, env=("MALLOC_MMAP_THRESHOLD_=65536",))
    finally:
        cleanup()
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"{len(rows)} rows in {time.monotonic() - started:.0f} s, cpus {args.cpus} per node -> {args.out}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    os.umask(0o022)
    sys.exit(main())
