"""Filters for torchrun jobs, on top of the job model (plugins/plugin_utils/jobs.py): fill a job
with its defaults, turn a job into one node's unit; and what each node knows about itself
(plugins/plugin_utils/nodes.py).

Each filter is documented beside this file (<filter>.yml, ``ansible-doc -t filter``).
"""

from __future__ import annotations

from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.module_utils.unit_sandbox import unit_hardening
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils import jobs, nodes
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.filter_errors import as_filter

# Other plugins import these names from here.
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.jobs import (  # noqa: F401  # pylint: disable=unused-import
    JOB_DEFAULTS,
    job_hosts,
    job_master,
    job_master_addr,
    job_node_ranks,
    job_nproc,
)

torchrun_jobs_normalize = as_filter(jobs.torchrun_jobs_normalize)
torchrun_plan = as_filter(jobs.torchrun_plan)
torchrun_argv = as_filter(jobs.torchrun_argv)
torchrun_environment = jobs.torchrun_environment
torchrun_masters_unknown = jobs.torchrun_masters_unknown
torchrun_recorded_masters = jobs.torchrun_recorded_masters
cluster_nodes = nodes.cluster_nodes
systemd_quote = jobs.systemd_quote
systemd_exec = jobs.systemd_exec
systemd_show = jobs.systemd_show
running_units = jobs.running_units
torchrun_job_status = jobs.torchrun_job_status
torchrun_image_problems = as_filter(jobs.torchrun_image_problems)
torchrun_image_differences = as_filter(jobs.torchrun_image_differences)
torchrun_images_found = jobs.images_found
torchrun_image_tarball_problems = jobs.image_tarball_problems
torchrun_image_environment = jobs.image_environment
torchrun_engine_user_problems = jobs.engine_user_problems


class FilterModule:
    """torchrun job filters."""

    def filters(self) -> dict[str, Any]:
        return {
            "torchrun_job_status": torchrun_job_status,
            "torchrun_jobs_normalize": torchrun_jobs_normalize,
            "torchrun_plan": torchrun_plan,
            "torchrun_image_problems": torchrun_image_problems,
            "torchrun_image_differences": torchrun_image_differences,
            "torchrun_images_found": torchrun_images_found,
            "torchrun_image_tarball_problems": torchrun_image_tarball_problems,
            "torchrun_image_environment": torchrun_image_environment,
            "torchrun_engine_user_problems": torchrun_engine_user_problems,
            "torchrun_masters_unknown": torchrun_masters_unknown,
            "torchrun_recorded_masters": torchrun_recorded_masters,
            "cluster_nodes": cluster_nodes,
            "systemd_quote": systemd_quote,
            "systemd_exec": systemd_exec,
            "systemd_show": systemd_show,
            "running_units": running_units,
            "unit_hardening": unit_hardening,
        }
