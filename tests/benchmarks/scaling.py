"""The scaling benchmark of docs/benchmarks/scaling.md: samples/s and scaling efficiency of the
example trainer's model at 1, 2 and 4 nodes, for the old trainer's pattern, stock DDP, DDP with the
step timer, fp16, PowerSGD, two bucket sizes and accumulation, with each node's link shaped (tbf) so
that one all-reduce takes 0.1 and 0.6 of a forward+backward.

Four containers of the node image (scaling-node1..4, network scaling-net: names of this benchmark
alone), each with the same CPU quota and one process of one thread; torch from the wheelhouse,
installed once into --torch-dir and mounted read-only with the trainer's files. Every container and
the network are removed at the end, and before the start if an earlier run left them.

    python3 tests/benchmarks/scaling.py --out /tmp/scaling.json      # then: --table /tmp/scaling.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
NODES = [f"scaling-node{i}" for i in range(1, 5)]
NETWORK, SUBNET = "scaling-net", "10.231.227.0/24"
IMAGE = "budgetgpu-node:bookworm"
PORT = 29577


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check)


def cleanup() -> None:
    for name in NODES:
        sh("docker", "rm", "-f", name, check=False)
    sh("docker", "network", "rm", NETWORK, check=False)


def torch_dir(path: Path) -> Path:
    """torch (CPU) from .cache/wheelhouse in a directory of its own, installed once."""
    if not (path / "torch" / "__init__.py").exists():
        wheelhouse = ROOT / ".cache" / "wheelhouse"
        pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", str(wheelhouse)]
        # numpy too: PowerSGD seeds its projections with it (python_env puts it in every job venv).
        sh(*pip, "--target", str(path), "torch==2.13.0", "numpy")
    return path


def start(cpus: float, period_ms: float, torch_path: Path) -> None:
    """The four node containers, each with the CFS quota cpus x period_ms every period_ms: a throttled
    container waits up to the rest of its period, which a chain of small collectives pays each time."""
    cleanup()
    period_us = int(period_ms * 1000)
    sh("docker", "network", "create", "--subnet", SUBNET, NETWORK)
    for index, name in enumerate(NODES, start=1):
        sh("docker", "run", "-d", "--name", name, "--hostname", name, "--network", NETWORK,
           "--ip", f"10.231.227.{10 + index}", f"--cpu-period={period_us}",
           f"--cpu-quota={int(cpus * period_us)}", "--cap-add", "NET_ADMIN",
           "-v", f"{torch_path}:/opt/torch:ro", "-v", f"{ROOT / 'roles/torchrun/files'}:/opt/code:ro",
           "-v", f"{ROOT / 'plugins/module_utils'}:/opt/node/budgetgpu_node:ro",
           "-v", f"{HERE}:/opt/bench:ro", "--entrypoint", "sleep", IMAGE, "infinity")  # fmt: skip


def launch(worker: list[str], out: str, minutes: float, env: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Run worker (a command line) in every node container as one gloo group of 4 ranks (RANK by container),
    with `env` ("NAME=value") added; return rank 0's JSON lines. Each rank's output goes to out.rankN.log."""
    base = ("PYTHONPATH=/opt/torch:/opt/node", "OMP_NUM_THREADS=1", "GLOO_SOCKET_IFNAME=eth0",
            "MASTER_ADDR=10.231.227.11", f"MASTER_PORT={PORT}", f"WORLD_SIZE={len(NODES)}", "LOCAL_RANK=0")  # fmt: skip
    logs = [Path(f"{out}.rank{rank}.log") for rank in range(len(NODES))]
    procs = []
    for rank, (name, log) in enumerate(zip(NODES, logs, strict=True)):
        with open(log, "w") as handle:  # rank 0's rows as they come: tail -f it
            variables = [word for value in (*base, *env, f"RANK={rank}") for word in ("-e", value)]
            command = ["docker", "exec", *variables, name, *worker]
            procs.append(subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, text=True))
    # A round started before the deadline finishes after it: allow one more round's time.
    for proc, log in zip(procs, logs, strict=True):
        if proc.wait(timeout=minutes * 60 * 2 + 300) != 0:
            raise SystemExit(f"a worker failed ({proc.returncode}):\n{log.read_text()[-3000:]}")
    return [json.loads(line) for line in logs[0].read_text().splitlines() if line.startswith("{")]


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    deadline = time.time() + args.minutes * 60
    worker = ["python3", "/opt/bench/scaling_worker.py", "--code", "/opt/code", "--deadline", str(deadline),
              "--rounds", str(args.rounds), "--global-batch", str(args.global_batch), "--steps", str(args.steps),
              "--hidden", str(args.hidden), "--layers", str(args.layers), "--ratios", args.ratios,
              "--options4", args.options4, "--options2", args.options2]  # fmt: skip
    return launch(worker, args.out, args.minutes)


def spread(values: list[float], digits: int = 2) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table: per ratio, nodes and option the median samples/s over rounds (min-max),
    the scaling efficiency against the 1-node run, the ratio to stock DDP in the same rounds, and the
    breakdown (rank mean of seconds per step), and the time rank 0's container was held back by its
    CPU quota (seconds per step)."""
    cal = [r for r in rows if "calibration" in r]
    runs = [r for r in rows if "option" in r]
    one = [r["samples_per_s"] for r in runs if r["nodes"] == 1]
    base = statistics.median(one) if one else float("nan")
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        groups[(r["ratio"], r["nodes"], r["option"])].append(r)
    lines = [f"calibration: {json.dumps(c)}" for c in cal]
    lines += [
        f"1 node, global batch {runs[0]['global_batch'] if runs else '?'}: {spread(one) if one else '-'} samples/s",
        "",
    ]
    lines += ["| ratio | nodes | option | batch | samples/s median (min-max) | efficiency | vs stock DDP | "
              "compute / comm not hidden / data (s per step) | throttled (s per step) | rounds |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for (ratio, nodes, option), found in sorted(groups.items(), key=lambda kv: (str(kv[0][0]), -kv[0][1])):
        if nodes == 1:
            continue
        sps = [r["samples_per_s"] for r in found]
        stock = {r["round"]: r["samples_per_s"] for r in groups.get((ratio, nodes, "ddp"), [])}
        vs = [r["samples_per_s"] / stock[r["round"]] for r in found if r["round"] in stock]
        b = [r["breakdown_s"] for r in found]
        parts = " / ".join(f"{statistics.median([x[k] for x in b]):.3f}" for k in ("compute", "comm", "data"))
        throttled = [r["throttled_s"] for r in found if "throttled_s" in r]
        eff = statistics.median(sps) / (nodes * base) * (runs[0]["global_batch"] / found[0]["global_batch"])
        lines.append(
            f"| {ratio} | {nodes} | {option} | {found[0]['global_batch']} | {spread(sps)} | {eff:.0%} | "
            f"{spread(vs) if vs else '-'} | {parts} | {spread(throttled, 3) if throttled else '-'} | {len(found)} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/budgetgpu-scaling.json", help="the rows as JSON")
    parser.add_argument("--table", help="print the table of an earlier --out file and exit")
    parser.add_argument("--cpus", type=float, default=0.3, help="CPU quota of each node container")
    parser.add_argument("--cpu-period-ms", type=float, default=10, help="CFS period of the quota (docker: 100)")
    parser.add_argument("--minutes", type=float, default=10, help="no round starts after this")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per row (after 2 warm-up steps)")
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=2048, help="the trainer's --hidden")
    parser.add_argument("--layers", type=int, default=3, help="the trainer's --layers")
    parser.add_argument("--ratios", default="0.1,0.6", help="all-reduce over forward+backward time to shape for")
    parser.add_argument("--options4", default="legacy,ddp,ddp+timer,fp16,powersgd,bucket5,bucket100,accumulate2")
    parser.add_argument("--options2", default="legacy,ddp,fp16,powersgd")
    parser.add_argument("--torch-dir", type=Path, default=Path("/tmp/budgetgpu-scaling-torch"))
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return 0
    sys.path.insert(0, str(HERE))
    from scaling_worker import option_fields

    try:  # a mistyped row fails here, not after the containers have started and calibrated
        for option in filter(None, f"{args.options4},{args.options2}".split(",")):
            option_fields(option)
    except ValueError as err:
        parser.error(str(err))
    started = time.monotonic()
    try:
        start(args.cpus, args.cpu_period_ms, torch_dir(args.torch_dir))
        rows = run(args)
    finally:
        cleanup()
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(
        f"{len(rows)} rows in {time.monotonic() - started:.0f} s, cpus {args.cpus} per node "
        f"(CFS period {args.cpu_period_ms:g} ms) -> {args.out}"
    )
    print(table(rows))
    return 0


if __name__ == "__main__":
    os.umask(0o022)
    sys.exit(main())
