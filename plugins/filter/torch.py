"""Filters of the torch build domain; the logic lives in plugins/plugin_utils/torch_build.py."""

from __future__ import annotations

from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils import torch_build
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.filter_errors import as_filter
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.torch_build import (  # noqa: F401  the module's old names  # pylint: disable=unused-import
    KNOWN_VARIANTS,
    driver_cuda,
    parse_cuda_version,
    variant_cuda,
)

torch_variant = as_filter(torch_build.torch_variant)
torch_variant_problem = as_filter(torch_build.torch_variant_problem)
torch_requirement = as_filter(torch_build.torch_requirement)
torch_pip_index = as_filter(torch_build.torch_pip_index)


class FilterModule:
    """PyTorch wheel selection, and the NCCL package that follows it."""

    def filters(self) -> dict[str, Any]:
        return {
            "torch_variant": torch_variant,
            "torch_variant_problem": torch_variant_problem,
            "torch_requirement": torch_requirement,
            "torch_pip_index": torch_pip_index,
            "torch_driver_cuda": driver_cuda,
            "python_env_problems": torch_build.python_env_problems,
        }
