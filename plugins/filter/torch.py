"""Filters that choose a PyTorch wheel for a node: which build (CPU or a CUDA variant) fits
the node's driver, and how pip must be told to fetch exactly that build."""

from __future__ import annotations

import re
from typing import Any

try:
    from ansible.errors import AnsibleFilterError
except ImportError:  # pragma: no cover - the filters are plain functions without Ansible too

    class AnsibleFilterError(Exception):  # type: ignore[no-redef]
        pass


# Every value python_env_torch_variant accepts; meta/argument_specs.yml lists the same
# choices (a unit test keeps the two equal).
KNOWN_VARIANTS: tuple[str, ...] = ("auto", "cpu", "cu118", "cu121", "cu124", "cu126", "cu128", "cu129", "cu130")

_VARIANT = re.compile(r"^cu(\d+)(\d)$")
_CUDA = re.compile(r"^\s*(\d+)\.(\d+)")


def variant_cuda(variant: str) -> tuple[int, int] | None:
    """Return the CUDA (major, minor) a wheel variant was built for: "cu128" -> (12, 8); "cpu" -> None."""
    match = _VARIANT.match(variant)
    return (int(match.group(1)), int(match.group(2))) if match else None


def parse_cuda_version(version: Any) -> tuple[int, int] | None:
    """Return NVML's CUDA driver version ("13.0", 12.4) as (major, minor); None when unknown."""
    if version is None:
        return None
    match = _CUDA.match(str(version))
    return (int(match.group(1)), int(match.group(2))) if match else None


def _check_known(variant: str) -> None:
    if variant not in KNOWN_VARIANTS:
        raise AnsibleFilterError(f"torch variant '{variant}' is unknown: expected one of {', '.join(KNOWN_VARIANTS)}")


def torch_variant(requested: str, driver_cuda: Any = None, candidates: list[str] | None = None) -> str:
    """Return the wheel variant to install.

    An explicit variant ("cpu", "cu128") is returned as it is. "auto" picks, among the CUDA
    variants published for the pinned torch version (candidates), the newest one the driver
    runs: built for a CUDA version not above the driver's. When every candidate is newer than
    the driver but shares its major version, the oldest such one is taken (CUDA's minor
    version compatibility). No driver, or a driver older than every candidate: "cpu".
    """
    _check_known(requested)
    if requested != "auto":
        return requested
    driver = parse_cuda_version(driver_cuda)
    if driver is None:
        return "cpu"
    cuda_variants = []
    for candidate in candidates if candidates is not None else KNOWN_VARIANTS:
        _check_known(candidate)
        built_for = variant_cuda(candidate)
        if built_for is not None:
            cuda_variants.append((built_for, candidate))
    cuda_variants.sort()
    fitting = [name for built_for, name in cuda_variants if built_for <= driver]
    if fitting:
        return fitting[-1]
    same_major = [name for built_for, name in cuda_variants if built_for[0] == driver[0]]
    return same_major[0] if same_major else "cpu"


def torch_variant_problem(variant: str, driver_cuda: Any = None) -> str:
    """Return why a wheel variant cannot run on a driver, or "" when it can (or no driver is known).

    A CUDA build runs on a driver of the same major CUDA version or newer (minor version
    compatibility covers a newer minor within one major).
    """
    _check_known(variant)
    built_for = variant_cuda(variant)
    driver = parse_cuda_version(driver_cuda)
    if built_for is None or driver is None or built_for[0] <= driver[0]:
        return ""
    return (
        f"torch variant {variant} needs a driver for CUDA {built_for[0]}.x or newer, "
        f"the driver supports CUDA {driver[0]}.{driver[1]}"
    )


def torch_requirement(version: str, variant: str) -> str:
    """Return the exact pip requirement for one build: ("2.13.0", "cu128") -> "torch==2.13.0+cu128"."""
    _check_known(variant)
    if variant == "auto":
        raise AnsibleFilterError("torch_requirement needs a resolved variant, not 'auto': apply torch_variant")
    base = str(version).split("+", 1)[0].strip()
    if not re.match(r"^\d+(\.\d+)*([a-z]+\d*)?$", base):
        raise AnsibleFilterError(f"torch version '{version}' is not an exact version such as 2.13.0")
    return f"torch=={base}+{variant}"


def torch_pip_index(variant: str, index_base: str = "https://download.pytorch.org/whl") -> str:
    """Return the PyTorch package index that serves one variant's wheels."""
    _check_known(variant)
    return f"{index_base.rstrip('/')}/{variant}"


class FilterModule:
    """PyTorch wheel selection."""

    def filters(self) -> dict[str, Any]:
        return {
            "torch_variant": torch_variant,
            "torch_variant_problem": torch_variant_problem,
            "torch_requirement": torch_requirement,
            "torch_pip_index": torch_pip_index,
        }
