"""Filters of the metrics (roles node_exporter and prometheus): thin wrappers of
plugins/plugin_utils/monitoring.py."""

from __future__ import annotations

from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.filter_errors import as_filter
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.monitoring import (
    alertmanager_problems,
    alertmanager_targets,
    alertmanager_url,
    inference_scrape_targets,
    prometheus_url,
    scrape_targets,
)


class FilterModule:
    """budgetgpu monitoring filters."""

    def filters(self) -> dict[str, Any]:
        return {
            "monitoring_scrape_targets": scrape_targets,
            "monitoring_prometheus_url": prometheus_url,
            "monitoring_alertmanager_url": alertmanager_url,
            "monitoring_alertmanager_targets": alertmanager_targets,
            "monitoring_alertmanager_problems": alertmanager_problems,
            "monitoring_inference_targets": as_filter(inference_scrape_targets),
        }
