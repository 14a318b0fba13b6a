"""Preflight filters, on top of plugins/plugin_utils/preflight.py (the cluster checks).

Each filter is documented beside this file (<filter>.yml, ``ansible-doc -t filter``).
"""

from __future__ import annotations

from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.preflight import (
    cluster_check,
    preflight_script_paths,
)


class FilterModule:
    """Preflight filters."""

    def filters(self) -> dict[str, Any]:
        return {
            "cluster_check": cluster_check,
            "preflight_script_paths": preflight_script_paths,
        }
