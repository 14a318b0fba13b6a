#!/usr/bin/env python3
"""Plot a GPU benchmark report (playbooks/gpu_bench.yml): one panel per figure (matmul TFLOPS per
dtype, memory, H2D and D2H GB/s), a bar per GPU (red: a straggler in that figure), a black mark at
the median of its model and, on the copy panels, a dashed mark at what its PCIe link carries.
Runs on the control node (needs matplotlib).

Usage: gpu_bench_plot.py REPORT.json OUT.png
Exit 0 with the PNG written, 3 when matplotlib is missing (the caller reports it and goes on).
"""

from __future__ import annotations

import json
import sys

PANELS = (
    ("matmul_fp32", "fp32 matmul", "TFLOPS"),
    ("matmul_fp16", "fp16 matmul", "TFLOPS"),
    ("matmul_bf16", "bf16 matmul", "TFLOPS"),
    ("memory_gbs", "device memory", "GB/s"),
    ("h2d_gbs", "host to device (pinned)", "GB/s"),
    ("d2h_gbs", "device to host (pinned)", "GB/s"),
)


def figure(gpu: dict, metric: str) -> float | None:
    value = (gpu.get("matmul_tflops") or {}).get(metric[7:]) if metric.startswith("matmul_") else gpu.get(metric)
    return value if isinstance(value, int | float) else None


def marks(ax, positions: range, values: list, color: str, label: str) -> None:
    """A short horizontal mark over each bar (none where the value is unknown)."""
    shown = [value if value is not None else float("nan") for value in values]
    ax.scatter(positions, shown, marker="_", s=600, color=color, label=label, zorder=3)


def draw_panel(ax, gpus: list[dict], labels: list[str], metric: str, title: str, unit: str) -> None:
    """One metric's bars, one per GPU: red when slow, the median of its model and what its link carries as marks."""
    values = [figure(gpu, metric) or 0 for gpu in gpus]
    colors = ["tab:red" if metric in gpu["slow"] else "tab:blue" for gpu in gpus]
    positions = range(len(gpus))
    ax.bar(positions, values, color=colors)
    medians = [gpu["peer_median"].get(metric) for gpu in gpus]
    marks(ax, positions, medians, "black", "median of its model")
    if metric in ("h2d_gbs", "d2h_gbs"):
        links = [(gpu.get("link") or {}).get("bandwidth_gbps") for gpu in gpus]
        marks(ax, positions, links, "tab:green", "link carries")
    ax.set_xticks(list(positions))
    ax.set_xticklabels(labels, rotation=45, ha="right", fontsize=8)
    ax.set_title(title)
    ax.set_ylabel(unit)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="best", fontsize=7)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "gpu_bench_plot: matplotlib is not installed on the control node: pip install matplotlib", file=sys.stderr
        )
        return 3
    with open(argv[0], encoding="utf-8") as handle:
        report = json.load(handle)
    gpus = report["gpus"]
    labels = [f"{gpu['host']}:{gpu['index']}" for gpu in gpus]
    fig, axes = plt.subplots(2, 3, figsize=(max(9, 1.2 * len(gpus) * 3), 7), dpi=100)
    for ax, (metric, title, unit) in zip(axes.flat, PANELS, strict=True):
        draw_panel(ax, gpus, labels, metric, title, unit)
    verdict = (
        "PASS"
        if report.get("passed")
        else (f"{len(report['stragglers'])} straggler(s), {len(report['link_flags'])} copy flag(s)")
    )
    fig.suptitle(
        f"GPU benchmark, {len(gpus)} GPU(s): {verdict} (red: over {report['threshold'] * 100:.0f}% below the median)"
    )
    fig.tight_layout()
    fig.savefig(argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
