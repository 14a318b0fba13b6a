"""Slurm filters over plugins/plugin_utils/slurm.py and slurm_batch.py: role slurm's plan (what slurm.conf,
gres.conf and the hosts file say about each node, from its facts, and slurm_jobs checked against the nodes) in
one call, and the checks made at their own moments. Bad input fails the task with the domain's message
(ValueError -> AnsibleFilterError).

Each filter is documented beside this file (<filter>.yml, ``ansible-doc -t filter``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils import slurm as _slurm
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils import slurm_batch as _slurm_batch
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.filter_errors import as_filter


def slurm_plan(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Return role slurm's plan: {nodes (slurm_nodes), conf_lines ({host: its NodeName line}), gres_lines
    (gres.conf's, node by node), record_lines (the hosts file's entry of each node), def_mem_per_cpu (the
    smallest node's RealMemory per CPU), batch_jobs (slurm_jobs, batch_jobs)}. inputs: hosts (slurm_node_hosts),
    hostvars, services, margin_pct, absent, recorded (the hosts file an earlier run wrote), jobs
    (slurm_jobs), host."""
    nodes = _slurm.slurm_nodes(
        list(inputs.get("hosts") or []),
        inputs.get("hostvars"),
        inputs.get("services"),
        inputs.get("margin_pct"),
        list(inputs.get("absent") or []),
        inputs.get("recorded"),
    )
    return {
        "nodes": nodes,
        "conf_lines": {node["host"]: _slurm.node_conf_line(node) for node in nodes},
        "gres_lines": [line for node in nodes for line in _slurm.gres_conf_lines(node)],
        "record_lines": [_slurm.record_line(node) for node in nodes],
        "def_mem_per_cpu": min((_slurm.mem_per_cpu(node) for node in nodes), default=None),
        "batch_jobs": _slurm_batch.batch_jobs(inputs.get("jobs"), nodes, inputs.get("hostvars"), inputs.get("host")),
    }


class FilterModule:
    """Slurm filters."""

    def filters(self) -> dict[str, Any]:
        return {
            "slurm_plan": as_filter(slurm_plan),
            "slurm_cgroup_settings": as_filter(_slurm.cgroup_settings),
            "slurm_gres_problems": as_filter(_slurm.gres_problems),
            "slurm_job_costs": as_filter(_slurm.job_costs),
            "slurm_preflight_problems": _slurm.preflight_problems,
            "slurm_checkpoint_root_problems": _slurm.checkpoint_root_problems,
            "slurm_secret_action": as_filter(_slurm.secret_action),
        }
