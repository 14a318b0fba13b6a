"""Filters of the control node's paths: thin wrappers of plugins/plugin_utils/paths.py."""

from __future__ import annotations

from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.paths import state_path


class FilterModule:
    """budgetgpu path filters."""

    def filters(self) -> dict[str, Any]:
        return {"state_path": state_path}
