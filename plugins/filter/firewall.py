"""Filters of role firewall: thin wrappers of plugins/plugin_utils/firewall.py."""

from __future__ import annotations

from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.filter_errors import as_filter
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.firewall import (
    firewall_record_lines,
    firewall_rules,
    firewall_stale_report,
)


class FilterModule:
    """budgetgpu firewall filters."""

    def filters(self) -> dict[str, Any]:
        return {
            "firewall_rules": as_filter(firewall_rules),
            "firewall_record_lines": firewall_record_lines,
            "firewall_stale_report": firewall_stale_report,
        }
