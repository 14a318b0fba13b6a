"""Filters of who may open a node's GPUs: thin wrappers of plugins/plugin_utils/gpu_devices.py."""

from __future__ import annotations

from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils import gpu_devices
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.filter_errors import as_filter


class FilterModule:
    """budgetgpu GPU device filters."""

    def filters(self) -> dict[str, Any]:
        return {
            "gpu_group": as_filter(gpu_devices.gpu_group),
            "gpu_unit_device_allow": as_filter(gpu_devices.unit_device_allow),
            "gpu_driver_device_options": as_filter(gpu_devices.driver_device_options),
        }
