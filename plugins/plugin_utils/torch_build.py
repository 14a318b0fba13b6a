"""The torch build domain: which PyTorch wheel (CPU or a CUDA variant) fits a node's driver, how
pip must be told to fetch exactly that build, and which CUDA major the node's NCCL package
follows (the one of that build). python_env and cuda both read these decisions.

Pure functions, no Ansible: bad input raises ValueError (plugins/filter/torch.py turns it into
AnsibleFilterError).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# Every value python_env_torch_variant accepts; meta/argument_specs.yml lists the same
# choices (a unit test keeps the two equal).
KNOWN_VARIANTS: tuple[str, ...] = ("auto", "cpu", "cu118", "cu121", "cu124", "cu126", "cu128", "cu129", "cu130")

# driver_cuda's answer for GPUs whose driver's CUDA version the NVML binding could not read.
UNREADABLE = "unreadable"
_UNREADABLE_ADVICE = (
    "install nvidia-ml-py 10.418 or newer for the Python that runs the modules (Ubuntu 22.04's "
    "python3-pynvml is 7.352, from 2016), or set the variant to the CUDA build the driver runs (such as cu128)"
)

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
        raise ValueError(f"torch variant '{variant}' is unknown: expected one of {', '.join(KNOWN_VARIANTS)}")


def torch_variant(requested: str, driver_cuda: Any = None, candidates: list[str] | None = None) -> str:
    """Return the wheel variant to install.

    An explicit variant ("cpu", "cu128") is returned as it is. "auto" picks, among the CUDA
    variants published for the pinned torch version (candidates), the newest one the driver
    runs: built for a CUDA version not above the driver's. When every candidate is newer than
    the driver but shares its major version, the oldest such one is taken (CUDA's minor
    version compatibility). No driver, or a driver older than every candidate: "cpu". GPUs whose
    driver's CUDA version could not be read (UNREADABLE): ValueError, never "cpu"
    (torch_variant_problem says why, naming the binding, before anything uses this).
    """
    _check_known(requested)
    if requested != "auto":
        return requested
    if driver_cuda == UNREADABLE:
        raise ValueError(
            "torch variant auto: the node's NVIDIA driver lists GPUs but its CUDA version could not be read, "
            "so no torch build can be chosen (auto never installs the CPU build on GPUs): "
            f"{_UNREADABLE_ADVICE}"
        )
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


def binding_text(binding: Any) -> str:
    """Return how messages name the NVML binding gpu_facts read with (driver.binding):
    "pynvml 7.352.0 (nvidia-ml-py3, /usr/lib/python3/dist-packages/pynvml.py)"."""
    if not isinstance(binding, dict):
        return "an NVML binding gpu_facts did not name"
    version = binding.get("version") or "of unknown version"
    where = ", ".join(str(part) for part in (binding.get("distribution"), binding.get("path")) if part)
    return f"{binding.get('module') or 'pynvml'} {version}" + (f" ({where})" if where else "")


def _unreadable_problem(gpus_fact: Any) -> str:
    fact = gpus_fact if isinstance(gpus_fact, dict) else {}
    driver, count = fact.get("driver") or {}, fact.get("count")
    read = driver.get("cuda_driver_version")
    error = (driver.get("errors") or {}).get("cuda_driver_version")
    return (
        f"the node has {count} NVIDIA GPU(s) with driver {driver.get('version') or '(version unknown)'} loaded, but "
        f"{binding_text(driver.get('binding'))} cannot read the driver's CUDA version (NVML "
        f"nvmlSystemGetCudaDriverVersion: {error or read}), so auto cannot choose a torch build and will not "
        f"install the CPU build on GPUs: {_UNREADABLE_ADVICE}"
    )


def torch_variant_problem(variant: str, driver_cuda: Any = None, gpus_fact: Any = None) -> str:
    """Return why a wheel variant cannot run on a driver, or "" when it can (or no driver is known).

    A CUDA build runs on a driver of the same major CUDA version or newer (minor version
    compatibility covers a newer minor within one major). "auto" on GPUs whose driver's CUDA
    version could not be read (driver_cuda UNREADABLE) is refused, naming the NVML binding from
    gpus_fact (gpu_facts' budgetgpu_gpus).
    """
    _check_known(variant)
    if variant == "auto":
        return _unreadable_problem(gpus_fact) if driver_cuda == UNREADABLE else ""
    built_for = variant_cuda(variant)
    driver = parse_cuda_version(driver_cuda)
    if built_for is None or driver is None or built_for[0] <= driver[0]:
        return ""
    return (
        f"torch variant {variant} needs a driver for CUDA {built_for[0]}.x or newer, "
        f'the driver supports CUDA {driver[0]}.{driver[1]}: choose an older variant, "auto", or upgrade the driver'
    )


def torch_requirement(version: str, variant: str) -> str:
    """Return the exact pip requirement for one build: ("2.13.0", "cu128") -> "torch==2.13.0+cu128"."""
    _check_known(variant)
    if variant == "auto":
        raise ValueError("torch_requirement needs a resolved variant, not 'auto': apply torch_variant")
    base = str(version).split("+", 1)[0].strip()
    if not re.match(r"^\d+(\.\d+)*([a-z]+\d*)?$", base):
        raise ValueError(f"torch version '{version}' is not an exact version such as 2.13.0")
    return f"torch=={base}+{variant}"


def torch_pip_index(variant: str, index_base: str = "https://download.pytorch.org/whl") -> str:
    """Return the PyTorch package index that serves one variant's wheels."""
    _check_known(variant)
    return f"{index_base.rstrip('/')}/{variant}"


def driver_cuda(gpus_fact: Any, simulated: Any = False) -> str | None:
    """Return the CUDA version the node's loaded driver runs, from the probe's budgetgpu_gpus fact;
    None without a loaded driver. Simulated GPUs have a "driver" but no CUDA: their nodes train on CPU.
    UNREADABLE where the loaded driver lists GPUs but the version could not be read (an NVML binding
    without nvmlSystemGetCudaDriverVersion, such as Ubuntu 22.04's 7.352): not a node without GPUs."""
    if not isinstance(gpus_fact, dict) or _truthy(simulated):
        return None
    driver = gpus_fact.get("driver") or {}
    if not driver.get("loaded"):
        return None
    version = driver.get("cuda_driver_version")
    if parse_cuda_version(version) is not None:
        return str(version)
    count = gpus_fact.get("count")
    return UNREADABLE if isinstance(count, int) and count > 0 else None


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() in ("true", "yes", "1", "on")


def nccl_cuda_major(variant: str, cuda_version: Any) -> int | None:
    """Return the CUDA major the node's NCCL package must be built for: the one of the torch build
    the venv gets (variant, as torch_variant resolved it), or cuda_version's for the CPU build."""
    _check_known(variant)
    if variant == "auto":
        raise ValueError("nccl_cuda_major needs a resolved variant, not 'auto': apply torch_variant")
    built_for = variant_cuda(variant)
    if built_for is not None:
        return built_for[0]
    match = re.match(r"^\s*(\d+)", str(cuda_version if cuda_version is not None else ""))
    return int(match.group(1)) if match else None


def nccl_package(
    requested: Any, versions_by_major: Any, variant: str, cuda_version: Any, host: str = "this host"
) -> dict[str, Any]:
    """Return {"version", "cuda_major", "problem"}: NVIDIA's libnccl2 package version to install.

    requested is an exact version ("2.21.5-1+cuda12.4") or "auto": the entry of versions_by_major
    for the CUDA major of the torch build (nccl_cuda_major). A requested version built for another
    CUDA major than torch's is a problem (version None, problem naming host and variable)."""
    major = nccl_cuda_major(variant, cuda_version)
    why = (
        f"torch gets {variant}, built for CUDA {major}"
        if variant_cuda(variant)
        else f"cuda_version is {cuda_version} (torch gets the CPU build)"
    )
    result: dict[str, Any] = {"version": None, "cuda_major": major, "problem": ""}
    if str(requested) == "auto":
        versions = {str(key): value for key, value in (versions_by_major or {}).items()}
        if str(major) in versions:
            result["version"] = str(versions[str(major)])
        else:
            result["problem"] = (
                f"{host}: cuda_nccl_versions has no entry for CUDA {major} ({why}): expected one of "
                f"{', '.join(sorted(versions)) or 'nothing'}; add it or set cuda_nccl_version"
            )
        return result
    match = re.search(r"\+cuda(\d+)", str(requested))
    if match and int(match.group(1)) == major:
        result["version"] = str(requested)
    else:
        result["problem"] = (
            f"{host}: cuda_nccl_version is '{requested}' but {why}: expected auto or an NCCL package "
            f"built for CUDA {major} (+cuda{major}.x)"
        )
    return result


_NUMPY = re.compile(r"(?i)numpy([^A-Za-z0-9_.-]|$)")


def python_env_problems(inputs: Mapping[str, Any]) -> list[str]:
    """Return every problem of role python_env's inputs on one node, each naming the host and the
    variable (its one input check). inputs: host, os_family, distribution, version, owner, owner_create,
    owner_present, requirements, variant_asked, variant_problem (torch_variant_problem's), and where a
    wheelhouse is used and the variant is known, wheelhouse, torch_requirement, node_python,
    python_executable, torch_wheel (the file pattern) and torch_wheels (what matched on the control node)."""
    host, owner = inputs.get("host"), str(inputs.get("owner") or "")
    problems = []
    if inputs.get("os_family") != "Debian":
        problems.append(
            f"{host}: python_env supports Debian and Ubuntu, found {inputs.get('distribution')} {inputs.get('version')}"
        )
    if owner in ("root", ""):
        problems.append(
            f"{host}: python_env_owner is '{owner}', expected an unprivileged user: set budgetgpu_user (or "
            "python_env_owner) to the user that trains"
        )
    elif not (inputs.get("owner_create") or inputs.get("owner_present")):
        problems.append(
            f"{host}: python_env_owner '{owner}' does not exist and python_env_owner_create is false: create the user "
            "or set python_env_owner_create: true"
        )
    numpy = [str(r) for r in inputs.get("requirements") or [] if _NUMPY.match(str(r))]
    if numpy:
        problems.append(
            f"{host}: python_env_requirements names numpy ({', '.join(numpy)}): the role installs numpy itself, set "
            "python_env_numpy_version instead"
        )
    if inputs.get("variant_problem"):
        problems.append(f"{host}: python_env_torch_variant {inputs.get('variant_asked')}: {inputs['variant_problem']}")
    elif inputs.get("torch_wheels") == []:
        python, wheelhouse, wanted = (
            inputs.get("node_python"),
            inputs.get("wheelhouse"),
            inputs.get("torch_requirement"),
        )
        problems.append(
            f"{host}: python_env_wheelhouse {wheelhouse} has no wheel for {wanted} on Python {python} "
            f"({inputs.get('python_executable')} on the node): {inputs.get('torch_wheel')}: add that wheel and its "
            f"dependencies for Python {python} (scripts/fill-wheelhouse fetches them for Python 3.11), or set "
            'python_env_wheelhouse to "" to install from the package index'
        )
    return problems
