"""The roles whose filters were folded into a plan (issue 41) call that plan and only the filters of later
moments (what a task found on the host) or of every role: a new one-role filter is a new public name."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

ROLES = Path(__file__).resolve().parents[4] / "roles"
FILTERS_CALLED = {
    "cuda": {
        "cuda_plan",
        # The versions installed, read after the install; deb_upstream_version is nvidia_driver's too.
        "deb_upstream_version",
        "nccl_cuda_version",
        "nccl_version_text",
    },
    # nccl_env and nccl_env_file: the decision and the env file, made at their own moments; state_path is every role's.
    "nccl_network": {
        "nccl_network_plan",
        "nccl_network_reachability",
        "nccl_network_report",
        "nccl_env",
        "nccl_env_file",
        "state_path",
    },
    # nvidia_driver_branch is also the name of a variable, not a filter any more.
    "nvidia_driver": {
        "nvidia_driver_plan",
        # After the group is made (its gid), and after the install (what the installed kernels lack).
        "gpu_driver_device_options",
        "nvidia_kernel_problems",
        # Shared with other roles.
        "deb_upstream_version",
        "disruption_reboot",
        "disruption_restart",
        "gpu_group",
        "pending_add",
    },
    "slurm": {
        "slurm_plan",
        # Each reads what a task found on the host.
        "slurm_preflight_problems",
        "slurm_checkpoint_root_problems",
        "slurm_cgroup_settings",
        "slurm_gres_problems",
        "slurm_secret_action",
        # Shared with other roles.
        "cluster_nodes",
        "disruption_restart",
        "disruption_slurm_drain",
        "pending_add",
        "state_path",
        # The Slurm hosts' addresses as role _firewall's table admits them, which table budgetgpu_slurm_jobs guards.
        "firewall_rules",
        # An image job's environment, as torchrun's image tasks (which role slurm includes) write it for a unit.
        "torchrun_image_environment",
        # The Slurm nodes' own slurm_jobs naming one image for a job, judged as torchrun judges its jobs' nodes.
        "torchrun_image_differences",
    },
}


def collection_filters() -> set[str]:
    package = importlib.import_module("ansible_collections.budgetgpu.cluster.plugins.filter")
    return {
        name
        for info in pkgutil.iter_modules(package.__path__)
        for name in importlib.import_module(f"{package.__name__}.{info.name}").FilterModule().filters()
    }


@pytest.mark.parametrize("role", sorted(FILTERS_CALLED))
def test_the_role_calls_only_its_plan_and_the_filters_of_later_moments_or_other_roles(role: str) -> None:
    text = "\n".join(path.read_text() for path in sorted((ROLES / role).rglob("*")) if path.suffix in (".yml", ".j2"))
    assert set(re.findall(r"budgetgpu\.cluster\.(\w+)", text)) & collection_filters() == FILTERS_CALLED[role]
