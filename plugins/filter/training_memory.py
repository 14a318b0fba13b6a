"""Filters of the training memory planner (plugins/plugin_utils/training_memory.py): preflight's check of
every job's planned peak against each GPU of its nodes, and the planned peak beside the measured one for
train.yml -e job_state=status.

Each filter is documented beside this file (<filter>.yml, ``ansible-doc -t filter``).
"""

from __future__ import annotations

from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.training_memory import (
    training_memory_check,
    training_memory_status,
)


class FilterModule:
    """Training memory filters."""

    def filters(self) -> dict[str, Any]:
        return {
            "training_memory_check": training_memory_check,
            "training_memory_status": training_memory_status,
        }
