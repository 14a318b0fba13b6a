"""Filters of the safety decisions; the logic lives in plugins/plugin_utils/disruption.py."""

from __future__ import annotations

from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.disruption import (
    disruption_allowed,
    job_action,
    pending_add,
    pending_extend,
    reboot_decision,
    restart_decision,
    slurm_drain_action,
)


class FilterModule:
    """Whether a run may interrupt a node's work, and the pending list of what it left."""

    def filters(self) -> dict[str, Any]:
        return {
            "disruption_allowed": disruption_allowed,
            "disruption_restart": restart_decision,
            "disruption_reboot": reboot_decision,
            "disruption_job_action": job_action,
            "disruption_slurm_drain": slurm_drain_action,
            "pending_add": pending_add,
            "pending_extend": pending_extend,
        }
