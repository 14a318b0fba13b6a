"""Filters of the NVIDIA driver domain; the logic lives in plugins/plugin_utils/driver.py and kernels.py."""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleFilterError  # noqa: F401  re-exported for callers of the old module  # pylint: disable=unused-import
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils import driver, kernels
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.driver import (  # noqa: F401  the module's old names  # pylint: disable=unused-import
    BLACKWELL_FIRST_ID,
    DEVICE_ID_RANGES,
    FLAVORS,
    OPEN_DEFAULT_BRANCH,
    TURING_FIRST_ID,
    deb_upstream_version,
    driver_branch,
    gpu_architecture_from_device_id,
    gpu_generations,
    module_flavor_decision,
    module_options_problems,
    nccl_cuda_version,
    nccl_version_tuple_text,
    parse_compute_capability,
    secure_boot_enabled,
)
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.filter_errors import as_filter

cuda_package_suffix = as_filter(driver.cuda_package_suffix)


class FilterModule:
    """budgetgpu NVIDIA filters."""

    def filters(self) -> dict[str, Any]:
        return {
            "nvidia_module_flavor_decision": module_flavor_decision,
            "nvidia_driver_input_problems": driver.driver_input_problems,
            "cuda_input_problems": driver.cuda_input_problems,
            "nvidia_secure_boot_enabled": secure_boot_enabled,
            "nvidia_driver_branch": driver_branch,
            "deb_upstream_version": deb_upstream_version,
            "nccl_cuda_version": nccl_cuda_version,
            "cuda_package_suffix": cuda_package_suffix,
            "nccl_version_text": nccl_version_tuple_text,
            "nvidia_kernel_headers": kernels.kernel_headers,
            "nvidia_kernel_problems": kernels.kernel_module_problems,
        }
