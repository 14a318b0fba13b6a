"""Prometheus' text format for node exporter's textfile collector, written by prometheus_client.

The node's writers keep their samples, (name, labels, value), and a table of their names, {name: (type,
help)}: the health watch (roles/gpu_health/files/gpu-health: gpu_metrics.py, job_metrics.py) and role node_exporter's
RAPL reader (energy.py). This writes them: a format someone else maintains comes from its library.

prometheus_client is imported when exposition is called (the watch's `check` and `fact` write no
metrics): Debian's and Ubuntu's python3-prometheus-client, which roles gpu_health and node_exporter
install (0.9.0 on Ubuntu 22.04, 0.16.0 on Debian 12: nothing newer than 0.9 is used). Standard-library
Python otherwise, with no imports from the rest of the collection: its callers import it from the node package.
"""

from __future__ import annotations

from typing import Any


def exposition(metrics: dict[str, tuple[str, str]], samples: list[tuple[str, dict[str, str], float]]) -> str:
    """Return the text of samples: one family per name of metrics that has samples, in metrics' order,
    labels sorted ("" for none: node exporter reads an empty file as no metrics). prometheus_client names
    a counter's samples <family>_total; a counter of dcgm-exporter's that keeps its name without _total
    goes out untyped (PromQL's rate() reads it alike). No _created series: no Counter objects."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import Metric

    families = []
    for name, (kind, words) in metrics.items():
        mine = [(labels, value) for metric, labels, value in samples if metric == name]
        if not mine:
            continue
        if kind == "counter" and name.endswith("_total"):
            family = Metric(name.removesuffix("_total"), words, kind)
        else:
            family = Metric(name, words, "unknown" if kind == "counter" else kind)
        for labels, value in mine:
            family.add_sample(name, labels, value)
        families.append(family)

    class Families:
        """The families, collected once."""

        def collect(self) -> list[Any]:
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Families())
    return generate_latest(registry).decode("utf-8")
