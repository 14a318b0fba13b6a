"""The NVIDIA driver domain: decisions of the nvidia_driver and cuda roles: which kernel-module flavor the GPUs need,
Debian version strings, Secure Boot state, NCCL/CUDA version matching.

Pure functions of their inputs (facts, strings); no I/O, no Ansible: bad input raises ValueError,
which plugins/filter/nvidia.py turns into AnsibleFilterError.

GPU generation from the PCI device id
-------------------------------------
NVIDIA allocates PCI device ids per chip in blocks that grow with each generation. The table
below (``DEVICE_ID_RANGES``) maps those blocks to architectures; every id from 0x1E00 upward
belongs to Turing or a newer generation, every id below it to Volta or an older one. Examples:

============  ======  ============  ===============================
device id     arch    CC            card
============  ======  ============  ===============================
0x1b06        Pascal  6.1           GeForce GTX 1080 Ti
0x1db1        Volta   7.0           Tesla V100 SXM2
0x1e04        Turing  7.5           GeForce RTX 2080 Ti
0x1eb8        Turing  7.5           Tesla T4
0x20b0        Ampere  8.0           A100 SXM4
0x2204        Ampere  8.6           GeForce RTX 3090
0x2335        Hopper  9.0           H200
0x2684        Ada     8.9           GeForce RTX 4090
0x2901        Blackw. 10.0          B200
0x2b85        Blackw. 12.0          GeForce RTX 5090
============  ======  ============  ===============================

The open kernel modules support Turing (compute capability 7.5) and newer only; Blackwell
and newer are supported by the open modules only. An id beyond the table is taken as newer
than Blackwell.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.module_utils.nvml_probe import known

FLAVORS = ("open", "proprietary")

# (first id, last id, architecture, compute capability major.minor of the family's first chip)
DEVICE_ID_RANGES: tuple[tuple[int, int, str, float], ...] = (
    (0x0FC0, 0x12FF, "kepler", 3.0),
    (0x1340, 0x17FF, "maxwell", 5.0),
    (0x15F0, 0x15FF, "pascal", 6.0),  # GP100, inside the Maxwell block: checked first below
    (0x1800, 0x1D7F, "pascal", 6.1),
    (0x1D80, 0x1DFF, "volta", 7.0),
    (0x1E00, 0x1FFF, "turing", 7.5),
    (0x2000, 0x20FF, "ampere", 8.0),
    (0x2100, 0x21FF, "turing", 7.5),  # TU116/TU117 refreshes
    (0x2200, 0x22FF, "ampere", 8.6),
    (0x2300, 0x23FF, "hopper", 9.0),
    (0x2400, 0x25FF, "ampere", 8.6),
    (0x2600, 0x28FF, "ada", 8.9),
    (0x2900, 0x2AFF, "blackwell", 10.0),
    (0x2B00, 0x2FFF, "blackwell", 12.0),
)
TURING_FIRST_ID = 0x1E00
BLACKWELL_FIRST_ID = 0x2900
_PRE_TURING = {"kepler", "maxwell", "pascal", "volta"}
_OPEN_ONLY = {"blackwell", "newer"}
# From this branch on NVIDIA installs the open modules by default where the GPUs allow it.
OPEN_DEFAULT_BRANCH = 560

_CC = re.compile(r"^\s*(\d+)\.(\d+)")


def _device_id_int(device_id: Any) -> int | None:
    if device_id is None:
        return None
    if isinstance(device_id, int):
        return device_id
    try:
        return int(str(device_id).strip(), 16)
    except ValueError:
        return None


def gpu_architecture_from_device_id(device_id: Any) -> str:
    """Return the architecture for an NVIDIA PCI device id ("0x2204" -> "ampere"); "unknown" if none."""
    number = _device_id_int(device_id)
    if number is None:
        return "unknown"
    # The GP100 block sits inside Maxwell's range: the narrower range wins.
    for first, last, arch, _cc in sorted(DEVICE_ID_RANGES, key=lambda row: row[1] - row[0]):
        if first <= number <= last:
            return arch
    return "newer" if number > DEVICE_ID_RANGES[-1][1] else "unknown"


def parse_compute_capability(value: Any) -> tuple[int, int] | None:
    """Return a compute capability ("8.6", 8.6, [8, 6], {"major": 8, "minor": 6}) as (8, 6)."""
    if not known(value):
        return None
    if isinstance(value, dict):
        try:
            return int(value["major"]), int(value["minor"])
        except (KeyError, TypeError, ValueError):
            return None
    if isinstance(value, list | tuple) and len(value) == 2:
        try:
            return int(value[0]), int(value[1])
        except (TypeError, ValueError):
            return None
    match = _CC.match(str(value))
    return (int(match.group(1)), int(match.group(2))) if match else None


def _architecture_from_cc(cc: tuple[int, int]) -> str:
    if cc < (7, 5):
        return "pre-turing"
    if cc >= (10, 0):
        return "blackwell"
    return "turing-or-newer"


def _arch_class(arch: str) -> str:
    if arch in _PRE_TURING or arch == "pre-turing":
        return "pre-turing"
    if arch in _OPEN_ONLY:
        return "blackwell"
    return "unknown" if arch == "unknown" else "turing-or-newer"


def gpu_generations(pcie_gpus: Any = None, nvml_gpus: Any = None) -> list[dict[str, Any]]:
    """Return one {bus_id, name, arch, source} per GPU, from NVML's compute capability where known,
    else from the PCI device id. GPUs are matched by bus id; an NVML GPU without a PCI entry counts too."""
    by_bus: dict[str, dict[str, Any]] = {}
    for gpu in pcie_gpus or []:
        bus = str(gpu.get("bus_id", f"pci{len(by_bus)}"))
        by_bus[bus] = {
            "bus_id": bus,
            "name": gpu.get("name") or gpu.get("device_id"),
            "arch": gpu_architecture_from_device_id(gpu.get("device_id")),
            "source": "pci_device_id",
        }
    for gpu in nvml_gpus or []:
        cc = parse_compute_capability(gpu.get("compute_capability"))
        bus = str(gpu.get("bus_id") or f"nvml{gpu.get('index', len(by_bus))}")
        entry = by_bus.setdefault(bus, {"bus_id": bus, "name": gpu.get("name"), "arch": "unknown", "source": "none"})
        if gpu.get("name"):
            entry["name"] = gpu["name"]
        if cc is not None:
            # NVML's capability is authoritative; the PCI table's family name is kept when both agree.
            arch = _architecture_from_cc(cc)
            if _arch_class(entry["arch"]) != arch:
                entry["arch"] = arch
            entry["source"] = "compute_capability"
            entry["compute_capability"] = f"{cc[0]}.{cc[1]}"
    return list(by_bus.values())


def _flavor_names(items: list[dict[str, Any]]) -> str:
    return ", ".join(f"{g['bus_id']} ({g['name'] or g['arch']}, {g['arch']})" for g in items)


def module_flavor_decision(
    requested: str,
    pcie_gpus: Any = None,
    nvml_gpus: Any = None,
    branch: Any = None,
    host: str = "this host",
) -> dict[str, str]:
    """Return {"flavor": "open"|"proprietary"|"", "problem": ""|why}: the requested flavor, or for
    "auto" what the GPUs need. A problem (an unknown value, a flavor a GPU cannot run, GPUs that
    need both) names the host and nvidia_driver_kernel_modules.

    auto: any pre-Turing GPU (GTX 1080 Ti, V100) -> proprietary; any Blackwell or newer ->
    open; all Turing..Ada/Hopper -> open; no GPU seen -> open from branch 560 (NVIDIA's own
    default), proprietary before.
    """
    if requested not in ("auto", *FLAVORS):
        return {
            "flavor": "",
            "problem": f"{host}: nvidia_driver_kernel_modules is '{requested}': expected auto, open or proprietary",
        }
    gpus = gpu_generations(pcie_gpus, nvml_gpus)
    old = [g for g in gpus if g["arch"] in _PRE_TURING or g["arch"] == "pre-turing"]
    new = [g for g in gpus if g["arch"] in _OPEN_ONLY]
    problem = ""
    if old and new:
        problem = (
            f"{host}: GPUs {_flavor_names(old)} need the proprietary kernel modules and {_flavor_names(new)} the open "
            "ones: one driver cannot serve both, move one kind of GPU to another node"
        )
    elif requested == "open" and old:
        problem = (
            f"{host}: nvidia_driver_kernel_modules is 'open' but {_flavor_names(old)} predates Turing and runs only "
            "the proprietary modules: set nvidia_driver_kernel_modules to proprietary or auto"
        )
    elif requested == "proprietary" and new:
        problem = (
            f"{host}: nvidia_driver_kernel_modules is 'proprietary' but {_flavor_names(new)} runs only the open "
            "modules: set nvidia_driver_kernel_modules to open or auto"
        )
    if problem:
        return {"flavor": "", "problem": problem}
    return {"flavor": _auto_flavor(requested, bool(old), bool(gpus), branch), "problem": ""}


def _auto_flavor(requested: str, any_old: bool, any_gpu: bool, branch: Any) -> str:
    if requested != "auto":
        return requested
    if any_old:
        return "proprietary"
    if any_gpu:
        return "open"
    try:
        number = int(branch)
    except (TypeError, ValueError):
        number = 0
    return "open" if number >= OPEN_DEFAULT_BRANCH else "proprietary"


def deb_upstream_version(version: Any) -> str | None:
    """Return the upstream part of a Debian version: "1:535.261.03-1~deb12u1" -> "535.261.03"."""
    if version is None or str(version).strip() == "":
        return None
    text = str(version).strip()
    text = text.split(":", 1)[1] if re.match(r"^\d+:", text) else text
    return text.rsplit("-", 1)[0] if "-" in text else text


def driver_branch(version: Any) -> int | None:
    """Return the branch of a driver version: "550.127.08" (or a Debian version) -> 550."""
    upstream = deb_upstream_version(version)
    match = re.match(r"^(\d+)\.", upstream or "")
    return int(match.group(1)) if match else None


# Packages whose versions are the driver's: their branches are the ones installed.
_DRIVER_PACKAGE = re.compile(r"^(nvidia-|libnvidia-|cuda-drivers)")


def installed_branches(packages: Mapping[str, Any] | None, own_release_packages: Any = ()) -> list[int]:
    """Return the driver branches (300 and above) of the installed packages (package_facts' {name: [{version}]})
    named like the driver's, less those whose versions follow releases of their own, sorted, once each."""
    versions = [
        entry.get("version")
        for name, entries in (packages or {}).items()
        if _DRIVER_PACKAGE.match(name) and name not in (own_release_packages or ())
        for entry in entries or []
    ]
    return sorted({branch for branch in map(driver_branch, versions) if branch is not None and branch >= 300})


def secure_boot_enabled(efivar_b64: Any) -> bool:
    """Return whether the SecureBoot EFI variable (base64 of its raw bytes: 4 attribute bytes and
    one value byte, as slurp returns it) says Secure Boot is on."""
    if not efivar_b64:
        return False
    try:
        raw = base64.b64decode(str(efivar_b64), validate=True)
    except (binascii.Error, ValueError):
        return False
    return len(raw) >= 5 and raw[4] == 1


_NCCL_CUDA = re.compile(r"\+cuda(\d+)(?:\.(\d+))?")


def nccl_cuda_version(nccl_version: Any) -> str | None:
    """Return the CUDA version an NCCL package was built for: "2.21.5-1+cuda12.4" -> "12.4"."""
    match = _NCCL_CUDA.search(str(nccl_version or ""))
    if not match:
        return None
    return match.group(1) if match.group(2) is None else f"{match.group(1)}.{match.group(2)}"


def cuda_major(version: Any) -> int | None:
    """Return the major of a CUDA version ("12.4", "12-4", "11.8.89~11.8.0-5", 12) -> 12."""
    match = re.match(r"^\s*(\d+)", str(version if version is not None else ""))
    return int(match.group(1)) if match else None


def cuda_package_suffix(version: Any) -> str:
    """Return a CUDA version as NVIDIA's package names spell it: "12.4" -> "12-4"."""
    match = re.match(r"^\s*(\d+)\.(\d+)", str(version or ""))
    if not match:
        raise ValueError(f"CUDA version '{version}' is not MAJOR.MINOR (e.g. 12.4)")
    return f"{match.group(1)}-{match.group(2)}"


def nccl_version_tuple_text(value: Any) -> str | None:
    """Return torch.cuda.nccl.version()'s answer ((2, 21, 5), 22105, "2.21.5") as "2.21.5"."""
    if value is None or value == "":
        return None
    if isinstance(value, list | tuple):
        return ".".join(str(int(part)) for part in value)
    if isinstance(value, int):
        # NCCL_VERSION_CODE: major*10000 + minor*100 + patch since 2.9; major*1000 + ... before.
        if value >= 10000:
            return f"{value // 10000}.{value % 10000 // 100}.{value % 100}"
        return f"{value // 1000}.{value % 1000 // 100}.{value % 100}"
    return str(value)


_OPTION_NAME = re.compile(r"^[A-Za-z0-9_]+$")
_MODULE_NAME = re.compile(r"^[a-z0-9_]+$")


def module_options_problems(options: Any, host: str = "this host") -> list[str]:
    """Return one problem per malformed nvidia_driver_module_options entry (module name -> {option: value})."""
    if not isinstance(options, dict):
        return [f"{host}: nvidia_driver_module_options is {type(options).__name__}, expected a mapping"]
    problems = []
    for module, values in options.items():
        if (
            not _MODULE_NAME.match(str(module))
            or not isinstance(values, dict)
            or not all(_OPTION_NAME.match(str(name)) for name in values)
        ):
            problems.append(
                f"{host}: nvidia_driver_module_options['{module}'] must map option names to values, "
                f"e.g. nvidia: {{NVreg_PreserveVideoMemoryAllocations: 1}}; found {values}"
            )
    return problems


def _branch_problems(inputs: Mapping[str, Any], host: str, where: str) -> list[str]:
    """nvidia_driver_branch: a three-digit branch; Debian's archive ships one."""
    branch, source = inputs.get("branch"), inputs.get("source")
    problems = []
    if branch is None or not re.match(r"^[0-9]{3}$", str(branch)):
        problems.append(
            f"{host}: nvidia_driver_branch is '{inputs.get('branch_asked')}' (source {source} on {where}): expected a "
            "driver branch number such as 550"
        )
    debian = inputs.get("debian_branch")
    if source == "debian" and str(branch) != str(debian):
        problems.append(
            f"{host}: nvidia_driver_branch is {branch} but Debian {inputs.get('major_version')}'s non-free archive "
            f"ships branch {debian}: leave nvidia_driver_branch unset, or set nvidia_driver_source to nvidia_repo for "
            "another branch"
        )
    return problems


def _branch_change_problems(inputs: Mapping[str, Any], host: str) -> list[str]:
    """Another branch installed than the one asked for: replaced only when allowed (a reboot follows)."""
    branch, installed = inputs.get("branch"), [str(b) for b in inputs.get("installed_branches") or []]
    if not [b for b in installed if b != str(branch)] or inputs.get("allow_branch_change"):
        return []
    return [
        f"{host}: driver branch {', '.join(installed)} is installed and nvidia_driver_branch asks for {branch}: set "
        "nvidia_driver_allow_branch_change: true to replace it (the node then needs a reboot), or set "
        "nvidia_driver_branch to the installed branch"
    ]


def _secure_boot_problems(inputs: Mapping[str, Any], host: str) -> list[str]:
    """Secure Boot on: refused unless the module will load (signed with an enrolled MOK, or validation off)."""
    if not inputs.get("secure_boot_on"):
        return []
    if inputs.get("secure_boot") == "refuse":
        return [
            f"{host}: Secure Boot is on and nvidia_driver_secure_boot is 'refuse': an unsigned nvidia module will not "
            "load. Either enroll a MOK for DKMS and set nvidia_driver_secure_boot: mok_signed, or disable validation "
            "(mokutil --disable-validation) and set nvidia_driver_secure_boot: unsigned, or turn Secure Boot off"
        ]
    if inputs.get("secure_boot") == "mok_signed" and inputs.get("mok_missing"):
        key, cert = inputs.get("mok_key"), inputs.get("mok_cert")
        return [
            f"{host}: nvidia_driver_secure_boot is mok_signed but {key} or {cert} is missing: create them (dkms "
            f"generate_mok), enroll the certificate (mokutil --import {cert}, confirm at the console on the next "
            "boot), then run again"
        ]
    return []


def driver_input_problems(inputs: Mapping[str, Any]) -> list[str]:
    """Return every problem of role nvidia_driver's inputs on one node, each naming the host and the
    variable (role nvidia_driver's one input check); an unsupported OS alone when it is one. inputs:
    host, distribution, version, major_version, supported_versions, source_asked, source,
    supported_sources, branch_asked, branch, debian_branch (the branch Debian's archive ships),
    ubuntu_server, module_options, flavor_problem, secure_boot_on, secure_boot, mok_key, mok_cert,
    mok_missing, installed_branches, allow_branch_change."""
    host, distribution, version = inputs.get("host"), inputs.get("distribution"), str(inputs.get("version"))
    versions = [str(v) for v in inputs.get("supported_versions") or []]
    if distribution not in ("Debian", "Ubuntu") or not re.match(
        rf"^({'|'.join(map(re.escape, versions))})(\.|$)", version
    ):
        supported = f"{distribution} {', '.join(versions)}" if distribution in ("Debian", "Ubuntu") else None
        return [
            f"{host}: runs {distribution} {version}; budgetgpu.cluster.nvidia_driver supports "
            f"{supported or 'Ubuntu 22.04/24.04 and Debian 12/13'}"
        ]
    problems = []
    sources = list(inputs.get("supported_sources") or [])
    if inputs.get("source") not in sources:
        problems.append(
            f"{host}: nvidia_driver_source is '{inputs.get('source_asked')}' but the node runs {distribution}: use one "
            f"of auto, {', '.join(sources)}"
        )
    problems += _branch_problems(inputs, host, f"{distribution} {version}")
    if inputs.get("ubuntu_server") and inputs.get("source") != "ubuntu":
        problems.append(
            f"{host}: nvidia_driver_ubuntu_server is true but the source is {inputs.get('source')}: the -server "
            "packages exist in Ubuntu's archive only"
        )
    problems += module_options_problems(inputs.get("module_options"), host)
    problems += [inputs["flavor_problem"]] if inputs.get("flavor_problem") else []
    return problems + _secure_boot_problems(inputs, host) + _branch_change_problems(inputs, host)


def _cuda_nccl_problems(inputs: Mapping[str, Any], host: str) -> list[str]:
    """NCCL: a version that is not NVIDIA's package form, else a torch variant refused, else the package's own
    problem (nccl_package's, given only when the variant is known)."""
    if not inputs.get("nccl_install"):
        return []
    version = str(inputs.get("nccl_version"))
    if version != "auto" and not re.match(str(inputs.get("nccl_version_pattern")), version):
        return [
            f"{host}: cuda_nccl_version is '{version}': expected auto or NVIDIA's package version such as "
            "2.21.5-1+cuda12.4"
        ]
    if inputs.get("variant_problem"):
        return [f"{host}: cuda_torch_variant auto: {inputs['variant_problem']}"]
    return [inputs["nccl_problem"]] if inputs.get("nccl_problem") else []


def cuda_input_problems(inputs: Mapping[str, Any]) -> list[str]:
    """Return every problem of role cuda's inputs on one node, each naming the host and the variable (its one
    input check). inputs: host, distribution, version, cuda_version, nccl_install, nccl_version,
    nccl_version_pattern, variant_problem (auto's, torch_variant_problem), nccl_problem (nccl_package's),
    toolkit_install, toolkit_source and distro_toolkit_version (on Debian and Ubuntu), driver_version and
    driver_cuda (the loaded driver's, from the probe)."""
    host, cuda = inputs.get("host"), str(inputs.get("cuda_version"))
    distribution, version = inputs.get("distribution"), inputs.get("version")
    problems = []
    if distribution not in ("Debian", "Ubuntu"):
        problems.append(
            f"{host}: runs {distribution} {version}; budgetgpu.cluster.cuda supports Ubuntu 22.04/24.04 and "
            "Debian 12/13"
        )
    if not re.fullmatch(r"[0-9]+\.[0-9]+", cuda):
        problems.append(f"{host}: cuda_version is '{cuda}': expected MAJOR.MINOR such as 12.4")
    problems += _cuda_nccl_problems(inputs, host)
    distro = inputs.get("distro_toolkit_version")
    if (
        inputs.get("toolkit_install")
        and inputs.get("toolkit_source") == "distro"
        and cuda_major(distro) != cuda_major(cuda)
    ):
        problems.append(
            f"{host}: cuda_version is {cuda} but {distribution} {version}'s nvidia-cuda-toolkit is CUDA {distro}: set "
            f"cuda_toolkit_source: nvidia_repo, or cuda_version to {distro}"
        )
    runs = inputs.get("driver_cuda")
    if cuda_major(runs) is not None and cuda_major(cuda) is not None and cuda_major(runs) < cuda_major(cuda):
        problems.append(
            f"{host}: cuda_version is {cuda} but the loaded driver {inputs.get('driver_version') or ''} runs CUDA "
            f"{runs} at most: upgrade the driver (nvidia_driver_branch) or pick an older cuda_version and NCCL"
        )
    return problems
