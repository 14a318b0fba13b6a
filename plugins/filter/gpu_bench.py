"""Filters of the GPU benchmark (playbooks/gpu_bench.yml): thin wrappers of plugins/module_utils/gpu_bench.py."""

from __future__ import annotations

from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.module_utils.gpu_bench import analyze, report_table


class FilterModule:
    """budgetgpu GPU benchmark filters."""

    def filters(self) -> dict[str, Any]:
        return {"gpu_bench_report": analyze, "gpu_bench_table": report_table}
