"""Slurm filters, thin wrappers over plugins/plugin_utils/slurm.py: what slurm.conf, gres.conf and
cgroup.conf say about each node, from its facts. Bad input fails the task with the domain's message
(ValueError -> AnsibleFilterError).

Each filter is documented beside this file (<filter>.yml, ``ansible-doc -t filter``).
"""

from __future__ import annotations

from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils import slurm as _slurm
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils import slurm_batch as _slurm_batch
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.filter_errors import as_filter


class FilterModule:
    """Slurm filters."""

    def filters(self) -> dict[str, Any]:
        return {
            "slurm_nodes": as_filter(_slurm.slurm_nodes),
            "slurm_node_conf_line": as_filter(_slurm.node_conf_line),
            "slurm_gres_conf_lines": as_filter(_slurm.gres_conf_lines),
            "slurm_cgroup_settings": as_filter(_slurm.cgroup_settings),
            "slurm_mem_per_cpu": as_filter(_slurm.mem_per_cpu),
            "slurm_gres_problems": as_filter(_slurm.gres_problems),
            "slurm_job_costs": as_filter(_slurm.job_costs),
            "slurm_preflight_problems": _slurm.preflight_problems,
            "slurm_checkpoint_root_problems": _slurm.checkpoint_root_problems,
            "slurm_secret_action": as_filter(_slurm.secret_action),
            "slurm_record_line": _slurm.record_line,
            "slurm_batch_jobs": as_filter(_slurm_batch.batch_jobs),
        }
