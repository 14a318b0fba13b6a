"""Filters for torchrun jobs, on top of the job model (plugins/plugin_utils/jobs.py): fill a job
with its defaults, summarise what each node knows about itself, turn a job into one node's unit.

Each filter is documented beside this file (<filter>.yml, ``ansible-doc -t filter``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ansible.errors import AnsibleFilterError
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils import jobs

# Other plugins import these names from here.
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.jobs import (  # noqa: F401
    JOB_DEFAULTS,
    job_hosts,
    job_master,
    job_master_addr,
    job_node_ranks,
    job_nproc,
)


def _filter_errors(function: Callable[..., Any]) -> Callable[..., Any]:
    """Bad input (ValueError) as AnsibleFilterError: the task fails with the message, no traceback."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except ValueError as error:
            raise AnsibleFilterError(str(error)) from error

    return wrapper


torchrun_job_normalize = _filter_errors(jobs.torchrun_job_normalize)
torchrun_jobs_normalize = _filter_errors(jobs.torchrun_jobs_normalize)
torchrun_plan = _filter_errors(jobs.torchrun_plan)
torchrun_argv = _filter_errors(jobs.torchrun_argv)
torchrun_environment = jobs.torchrun_environment
torchrun_masters_unknown = jobs.torchrun_masters_unknown
torchrun_recorded_masters = jobs.torchrun_recorded_masters
cluster_nodes = jobs.cluster_nodes
systemd_quote = jobs.systemd_quote
systemd_exec = jobs.systemd_exec
systemd_show = jobs.systemd_show


class FilterModule:
    """torchrun job filters."""

    def filters(self) -> dict[str, Any]:
        return {
            "torchrun_job_normalize": torchrun_job_normalize,
            "torchrun_jobs_normalize": torchrun_jobs_normalize,
            "torchrun_plan": torchrun_plan,
            "torchrun_masters_unknown": torchrun_masters_unknown,
            "torchrun_recorded_masters": torchrun_recorded_masters,
            "torchrun_unit_name": jobs.unit_name,
            "cluster_nodes": cluster_nodes,
            "systemd_quote": systemd_quote,
            "systemd_exec": systemd_exec,
            "systemd_show": systemd_show,
        }
