"""The real NVML bindings of the distros over a fake libnvidia-ml.so.1 (tests/fixtures/nvml-shim).

- bindings(): the bindings of tests/fixtures/nvml-shim/bindings.txt, each installed with
  `pip install --target` into its own folder under .cache/nvml-bindings (they all provide the module
  `pynvml`, so they cannot share a venv). scripts/fill-wheelhouse installs them there before CI's
  tests; a test that finds one missing installs it, and skips only where pip cannot reach PyPI.
- build_shim(): the C shim compiled with gcc; flat_profile(): a gpu_sim profile (with faults laid
  over, as gpu_sim's faults file does) in the shim's "key value" lines.
- run(): a child Python with one binding first on sys.path and the shim on LD_LIBRARY_PATH, as a
  node's python3 finds /usr/lib/python3/dist-packages/pynvml.py and the driver's library.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.module_utils import nvml_probe as _nvml_probe

REPO = Path(__file__).resolve().parents[2]
# The directory that holds ansible_collections/budgetgpu/cluster as this test process imports it: the
# checkout's .collections under pytest, ansible-test's copy of the tree under `make unit`.
COLLECTIONS_ROOT = Path(_nvml_probe.__file__).absolute().parents[5]
SHIM = REPO / "tests" / "fixtures" / "nvml-shim"
PROFILES = REPO / "roles" / "gpu_sim" / "files" / "profiles"
BINDINGS_DIR = Path(os.environ.get("BUDGETGPU_NVML_BINDINGS_DIR", REPO / ".cache" / "nvml-bindings"))

# nvml.h's return codes, by the names gpu_sim's profiles give their errors (ERR:NVMLError_<Name>).
_CODES = {"InvalidArgument": 2, "NotSupported": 3, "NoPermission": 4, "DriverNotLoaded": 9, "LibraryNotFound": 12}
_CODES |= {"FunctionNotFound": 13, "GpuIsLost": 15, "LibRmVersionMismatch": 18, "Unknown": 999}
_GEN_BY_GTS = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}


@dataclass(frozen=True)
class Binding:
    release: str  # the distro release whose python3-pynvml this is
    requirement: str  # pip's: nvidia-ml-py3==7.352.0
    path: Path | None  # the --target folder; None when it could not be installed
    why_missing: str = ""

    @property
    def version(self) -> str:
        return self.requirement.partition("==")[2]


def binding_list() -> list[tuple[str, str]]:
    rows = (line.split() for line in (SHIM / "bindings.txt").read_text().splitlines())
    return [(row[0], row[1]) for row in rows if row and not row[0].startswith("#")]


def binding_folder(requirement: str) -> Path:
    """Where scripts/fill-wheelhouse and the tests install one binding: nvidia-ml-py3-7.352.0."""
    return BINDINGS_DIR / requirement.replace("==", "-")


def install_binding(release: str, requirement: str) -> Binding:
    folder = binding_folder(requirement)
    if (folder / "pynvml.py").exists():
        return Binding(release, requirement, folder)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile", "--target", str(partial)]
    done = subprocess.run([*pip, requirement], capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        why = f"pip could not install {requirement} (PyPI unreachable?): {tail[0]}"
        return Binding(release, requirement, None, why)
    partial.rename(folder)
    return Binding(release, requirement, folder)


def build_shim(folder: Path, old_driver: bool = False) -> Path:
    """Compile the shim into folder/libnvidia-ml.so.1 (the soname the bindings load); return folder."""
    folder.mkdir(parents=True, exist_ok=True)
    flags = ["-DOLD_DRIVER"] if old_driver else []
    command = ["gcc", "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror", *flags]
    command += ["-Wl,-soname,libnvidia-ml.so.1", "-o", str(folder / "libnvidia-ml.so.1"), str(SHIM / "libnvidia-ml.c")]
    subprocess.run(command, check=True, capture_output=True, text=True)
    return folder


def _code(value: Any) -> Any:
    if isinstance(value, str) and value.startswith("ERR:") and not value[4:].isdigit():
        name = value[4:].split(":")[0].removeprefix("NVMLError_")
        return f"ERR:{_CODES.get(name, 999)}"
    return value


def _gen(speed: Any) -> int | None:
    match = re.match(r"\s*([0-9.]+)\s*GT/s", str(speed or ""))
    return _GEN_BY_GTS.get(float(match.group(1))) if match else None


def _width(text: Any) -> int | None:
    return int(text) if str(text).strip().isdigit() else None


def _pcie(function: dict[str, Any], parent: dict[str, Any]) -> dict[str, Any]:
    """The link keys, from the profile's NVML answers or, as gpu_sim does, from the sysfs attributes."""
    possible = [g for g in (_gen(function.get("max_link_speed")), _gen(parent.get("max_link_speed"))) if g]
    return {
        "pcie_gen_cur": _gen(function.get("current_link_speed")),
        "pcie_gen_gpu_max": _gen(function.get("max_link_speed")),
        "pcie_gen_max": min(possible) if possible else None,
        "pcie_width_cur": _width(function.get("current_link_width")),
        "pcie_width_max": _width(function.get("max_link_width")),
    }


def _fans(nvml: dict[str, Any]) -> dict[str, Any]:
    fans = nvml.get("fans")
    if fans is None:
        speed = nvml.get("fan", "ERR:NVMLError_NotSupported")
        if isinstance(speed, str):
            return {"fans": _code(speed), "fan.0.speed": _code(speed)}
        fans = [{"speed": speed, "target": nvml.get("fan_target", speed)}]
    lines: dict[str, Any] = {"fans": len(fans)}
    for number, fan in enumerate(fans):
        lines[f"fan.{number}.speed"], lines[f"fan.{number}.target"] = _code(fan["speed"]), _code(fan["target"])
    return lines


def _nvlinks(links: Any) -> dict[str, Any]:
    if not isinstance(links, dict):
        return {"nvlinks": _code(links if links is not None else "ERR:NVMLError_NotSupported")}
    return {"nvlinks": len(links), **{f"nvlink.{link}": _code(state) for link, state in links.items()}}


def _retired(pages: Any) -> dict[str, Any]:
    if not isinstance(pages, dict):
        code = _code(pages if pages is not None else "ERR:NVMLError_NotSupported")
        return {"retired.single": code, "retired.double": code, "retired.pending": code}
    return {
        "retired.single": " ".join(str(page) for page in pages.get("single_bit", [])),
        "retired.double": " ".join(str(page) for page in pages.get("double_bit", [])),
        "retired.pending": int(pages.get("pending", 0)),
    }


def _gpu_lines(index: int, function: dict[str, Any], parent: dict[str, Any]) -> dict[str, Any]:
    nvml = function["nvml"]
    domain, bus, rest = function["bdf"].split(":")
    device = int(str(function.get("device", "0")), 16)
    vendor = int(str(function.get("vendor", "0x10de")), 16)
    keys: dict[str, Any] = {
        "uuid": f"GPU-00000000-0000-0000-0000-{index:012d}",
        "vbios": "94.02.42.00.A9",
        "bus_id": f"{int(domain, 16):08X}:{bus.upper()}:{rest.upper()}",
        "bus_id_legacy": f"{int(domain, 16):04X}:{bus.upper()}:{rest.upper()}",
        "domain": int(domain, 16),
        "bus": int(bus, 16),
        "device": int(rest.split(".")[0], 16),
        "pci_device_id": device << 16 | vendor,
        "pci_subsys": 0,
        "mem_used": 0,
        "util_gpu": 0,
        "util_mem": 0,
        "persistence": 0,
        **_pcie(function, parent),
    }
    plain = ("name", "uuid", "serial", "vbios", "bus_id", "pci_device_id", "pci_subsys", "mem_total", "temp")
    plain += ("power_mw", "throttle", "sm_clock", "sm_clock_max", "persistence", "pcie_replay", "energy_mj")
    plain += ("power_limit_min_mw", "power_limit_max_mw", "power_limit_default_mw", "util_gpu", "util_mem")
    plain += ("pcie_gen_cur", "pcie_gen_max", "pcie_gen_gpu_max", "pcie_width_cur", "pcie_width_max")
    keys |= {key: nvml[key] for key in plain if key in nvml}
    keys["power_limit_mw"] = nvml.get("power_limit_default_mw", nvml.get("power_limit_mw"))
    for key in ("cc", "ecc", "mig", "remapped_rows"):
        value = nvml.get(key, "ERR:NVMLError_NotSupported")
        keys[key] = " ".join(str(part) for part in value) if isinstance(value, list) else value
    # Uncorrected (1) volatile (0) and aggregate (1) ECC error counters, as gpu_sim names them.
    keys["ecc_errors.1.0"], keys["ecc_errors.1.1"] = nvml.get("ecc_dbe_volatile", 0), nvml.get("ecc_dbe_aggregate", 0)
    keys |= _fans(nvml) | _nvlinks(nvml.get("nvlink")) | _retired(nvml.get("retired_pages"))
    return {f"gpu.{index}.{key}": _code(value) for key, value in keys.items() if value is not None}


def flat_profile(name: str, faults: dict[str, dict[str, Any]] | None = None) -> str:
    """Return gpu_sim profile `name` as the shim's lines; faults ({uuid: {key: value}}) as gpu_sim's."""
    profile = json.loads((PROFILES / f"{name}.json").read_text())
    by_bdf = {function["bdf"]: function for function in profile.get("pci", [])}
    gpus = sorted((f for f in profile.get("pci", []) if "nvml" in f), key=lambda f: f["bdf"])
    system = profile.get("nvml", {})
    keys = ("driver", "nvml", "cuda_driver", "init_error")
    lines: dict[str, Any] = {key: _code(system[key]) for key in keys if key in system}
    lines["gpus"] = len(gpus)
    for index, function in enumerate(gpus):
        fault = (faults or {}).get(str(function["nvml"].get("uuid")), {})
        function = {**function, "nvml": {**function["nvml"], **fault}}
        lines |= _gpu_lines(index, function, by_bdf.get(function.get("parent") or "", {}))
    return "".join(f"{key} {value}\n" for key, value in lines.items())


def run(binding: Binding, lib: Path | None, profile: Path, state: Path, *args: str) -> dict[str, Any]:
    """Run with_binding.py with this binding; lib None: no libnvidia-ml.so.1 at all (no driver)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "LD_"))}
    env["PYTHONPATH"] = f"{binding.path}{os.pathsep}{COLLECTIONS_ROOT}"
    env["BUDGETGPU_NVML_SHIM_PROFILE"], env["BUDGETGPU_NVML_SHIM_STATE"] = str(profile), str(state)
    if lib is not None:
        env["LD_LIBRARY_PATH"] = str(lib)
    done = subprocess.run(
        [sys.executable, str(SHIM / "with_binding.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        raise AssertionError(f"with_binding.py {' '.join(args)} under {binding.requirement}:\n{done.stderr}")
    answer = json.loads(done.stdout)
    assert answer["pynvml_file"] == str(binding.path / "pynvml.py"), answer["pynvml_file"]
    return answer


def run_module(binding: Binding, lib: Path | None, profile: Path, args: dict[str, Any], folder: Path) -> dict[str, Any]:
    """Run the gpu_facts module file itself (AnsibleModule reads its arguments from a JSON file)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "LD_"))}
    env["PYTHONPATH"] = f"{binding.path}{os.pathsep}{COLLECTIONS_ROOT}"
    env["BUDGETGPU_NVML_SHIM_PROFILE"] = str(profile)
    if lib is not None:
        env["LD_LIBRARY_PATH"] = str(lib)
    arguments = folder / "args.json"
    arguments.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
    module = REPO / "plugins" / "modules" / "gpu_facts.py"
    done = subprocess.run(
        [sys.executable, str(module), str(arguments)], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    return json.loads(done.stdout)
