"""Filters of the NVIDIA driver domain; the logic lives in plugins/plugin_utils/driver.py and kernels.py. Role
nvidia_driver's decisions and its one input check are one call, nvidia_driver_plan."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils import driver, kernels, torch_build
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


def cuda_plan(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Return role cuda's plan on one node: {nccl (nccl_package's answer for the torch build the venv gets; None
    where auto cannot choose that build), toolkit_package (None where the inputs have problems), problems
    (cuda_input_problems)}. inputs: those of cuda_input_problems but variant_problem and nccl_problem, and
    torch_variant (cuda_torch_variant), cuda_variants, gpus (budgetgpu_gpus), simulated, nccl_versions."""
    host, gpus = inputs.get("host"), inputs.get("gpus") or {}
    runs = torch_build.driver_cuda(gpus, inputs.get("simulated"))
    requested = inputs.get("torch_variant")
    # auto on GPUs whose CUDA the NVML binding cannot read is refused; no build, hence no NCCL, is chosen then.
    variant_problem = torch_build.torch_variant_problem("auto", runs, gpus) if requested == "auto" else ""
    nccl = None
    if not variant_problem:
        variant = torch_build.torch_variant(requested, runs, inputs.get("cuda_variants"))
        nccl = torch_build.nccl_package(
            inputs.get("nccl_version"), inputs.get("nccl_versions"), variant, inputs.get("cuda_version"), host
        )
    checked = {**inputs, "variant_problem": variant_problem}
    problems = driver.cuda_input_problems({**checked, **({"nccl_problem": nccl["problem"]} if nccl else {})})
    if problems:
        toolkit_package = None
    elif inputs.get("toolkit_source") == "nvidia_repo":
        toolkit_package = f"cuda-toolkit-{driver.cuda_package_suffix(inputs.get('cuda_version'))}"
    else:
        toolkit_package = "nvidia-cuda-toolkit"
    return {"nccl": nccl, "toolkit_package": toolkit_package, "problems": problems}


def nvidia_driver_plan(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Return role nvidia_driver's decisions on one node: {secure_boot_on, flavor (module_flavor_decision),
    headers (kernel_headers), installed_branches, problems (driver_input_problems)}. inputs: those of
    driver_input_problems but flavor_problem, secure_boot_on and installed_branches, and secure_boot_var (the
    SecureBoot efivar as slurp reads it), kernel_modules, pcie_gpus, nvml_gpus, kernel, in_container, kernels
    (gpu_facts' installed kernels), kernel_series, packages (package_facts'), own_release_packages."""
    host = inputs.get("host")
    secure_boot_on = secure_boot_enabled(inputs.get("secure_boot_var"))
    flavor = module_flavor_decision(
        inputs.get("kernel_modules"), inputs.get("pcie_gpus"), inputs.get("nvml_gpus"), inputs.get("branch"), host
    )
    installed = driver.installed_branches(inputs.get("packages"), inputs.get("own_release_packages"))
    headers = kernels.kernel_headers(
        inputs.get("kernel"),
        bool(inputs.get("in_container")),
        inputs.get("kernels") or [],
        inputs.get("distribution"),
        inputs.get("version"),
        inputs.get("kernel_series") or "",
    )
    checked = {**inputs, "flavor_problem": flavor["problem"], "secure_boot_on": secure_boot_on}
    return {
        "secure_boot_on": secure_boot_on,
        "flavor": flavor,
        "headers": headers,
        "installed_branches": installed,
        "problems": driver.driver_input_problems({**checked, "installed_branches": installed}),
    }


class FilterModule:
    """budgetgpu NVIDIA filters."""

    def filters(self) -> dict[str, Any]:
        return {
            "nvidia_driver_plan": nvidia_driver_plan,
            "cuda_plan": as_filter(cuda_plan),
            "deb_upstream_version": deb_upstream_version,
            "nccl_cuda_version": nccl_cuda_version,
            "nccl_version_text": nccl_version_tuple_text,
            "nvidia_kernel_problems": kernels.kernel_module_problems,
        }
