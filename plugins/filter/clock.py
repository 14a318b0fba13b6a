"""Filters of the clock checks (role preflight): thin wrappers of plugins/plugin_utils/clock.py."""

from __future__ import annotations

from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.clock import clock_skew_problems
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.filter_errors import as_filter


class FilterModule:
    """budgetgpu clock filters."""

    def filters(self) -> dict[str, Any]:
        return {"clock_skew_problems": as_filter(clock_skew_problems)}
