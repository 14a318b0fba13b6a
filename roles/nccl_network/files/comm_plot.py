#!/usr/bin/env python3
"""Plot a communication-test report: bus and algorithm bandwidth against message size, with the
iperf3 baseline and the floor as horizontal lines. Runs on the control node (needs matplotlib).

Usage: comm_plot.py REPORT.json OUT.png
Exit 0 with the PNG written, 3 when matplotlib is missing (the caller reports it and goes on).
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("comm_plot: matplotlib is not installed on the control node: pip install matplotlib", file=sys.stderr)
        return 3
    with open(argv[0], encoding="utf-8") as handle:
        report = json.load(handle)
    rows = report["rows"]
    sizes = [row["bytes"] for row in rows]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    ax.plot(sizes, [row["busbw_gbs"] for row in rows], marker="o", label="all-reduce busbw")
    ax.plot(sizes, [row["algbw_gbs"] for row in rows], marker=".", linestyle="--", label="all-reduce algbw")
    if report.get("iperf3_min_gbs"):
        ax.axhline(report["iperf3_min_gbs"], color="tab:green", label=f"iperf3 TCP {report['iperf3_min_gbs']:.2f} GB/s")
    if report.get("floor_gbs"):
        ax.axhline(report["floor_gbs"], color="tab:red", linestyle=":", label=f"floor {report['floor_gbs']:.2f} GB/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes[::2])
    ax.set_xticklabels([_size(s) for s in sizes[::2]], rotation=45)
    ax.set_xlabel("message size")
    ax.set_ylabel("GB/s")
    verdict = "PASS" if report.get("passed") else "FAIL"
    ax.set_title(
        f"all-reduce, {report.get('backend')} on {report.get('world_size')} ranks "
        f"({', '.join(report.get('nodes') or [])}): {verdict}"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(argv[1])
    return 0


def _size(size: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size >= scale:
            return f"{size // scale}{unit}"
    return str(size)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
