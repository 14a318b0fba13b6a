"""Filters of role container_runtime: thin wrappers of plugins/plugin_utils/container_runtime.py."""

from __future__ import annotations

from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.container_runtime import container_runtime_problems


class FilterModule:
    """budgetgpu container runtime filters."""

    def filters(self) -> dict[str, Any]:
        return {"container_runtime_problems": container_runtime_problems}
