"""Filters of the GPU health watch (role gpu_health): thin wrappers of plugins/module_utils/gpu_health.py."""

from __future__ import annotations

from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.module_utils.gpu_health import boot_links, expected_gpus


class FilterModule:
    """budgetgpu GPU health filters."""

    def filters(self) -> dict[str, Any]:
        return {"gpu_health_boot_links": boot_links, "gpu_health_expected_gpus": expected_gpus}
