#!/usr/bin/env python3
"""Make the simulated GPUs' device nodes as the NVIDIA driver would when its module loads.

The driver (and nvidia-modprobe, which CUDA runs for a missing node) makes /dev/nvidiaN (character 195:N) with the
owner, group and mode of the module's options NVreg_DeviceFileUID, NVreg_DeviceFileGID and NVreg_DeviceFileMode
(0, 0 and 0666 unless set), and sets a node that exists with other ones again unless NVreg_ModifyDeviceFiles=0.
Here the options are read from modprobe.d as modprobe reads them for the module "nvidia": so the code under test
(role nvidia_driver's options) decides the nodes' mode on a simulated node as on a real one. Run by gpu_sim's
configure and by its boot unit (a container's /dev is new at each start, as a module loads at each boot).

Usage: sim_nvidia_devices.py PROFILE [DEV_DIR] [MODPROBE_DIR ...]
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

MAJOR = 195
# modprobe.d's directories, the later in this list yielding to a file of the same name in an earlier one.
MODPROBE_DIRS = ("/etc/modprobe.d", "/run/modprobe.d", "/usr/local/lib/modprobe.d", "/lib/modprobe.d")
DRIVER_DEFAULTS = {"NVreg_DeviceFileUID": 0, "NVreg_DeviceFileGID": 0, "NVreg_DeviceFileMode": 0o666,
                   "NVreg_ModifyDeviceFiles": 1}  # fmt: skip


def module_options(dirs: tuple[str, ...] = MODPROBE_DIRS, module: str = "nvidia") -> dict[str, int]:
    """Return the driver's device file options: its defaults, then each `options nvidia ...` line of the
    modprobe.d files (by file name, the first directory's file of a name winning), the last value winning."""
    files: dict[str, Path] = {}
    for directory in dirs:
        for path in sorted(Path(directory).glob("*.conf")) if os.path.isdir(directory) else []:
            files.setdefault(path.name, path)
    options = dict(DRIVER_DEFAULTS)
    for name in sorted(files):
        for line in files[name].read_text(encoding="utf-8", errors="replace").splitlines():
            words = line.split("#", 1)[0].split()
            if len(words) < 3 or words[0] != "options" or words[1] != module:
                continue
            for word in words[2:]:
                key, _eq, value = word.partition("=")
                if key in options:
                    options[key] = c_integer(value)
    return options


def c_integer(text: str) -> int:
    """Return an integer as the kernel reads a module option (strtoul, base 0): 0x1b6 hex, 0660 octal, 438."""
    text = text.strip()
    if text.lower().startswith("0x"):
        return int(text, 16)
    if len(text) > 1 and text.startswith("0"):
        return int(text, 8)
    return int(text, 10)


def driver_gpus(profile: dict) -> int:
    """Return how many GPUs the profile's driver sees (0 where it has no driver)."""
    if "driver" not in (profile.get("nvml") or {}):
        return 0
    return sum(1 for function in profile.get("pci") or [] if "nvml" in function)


def make_nodes(count: int, options: dict[str, int], dev: str = "/dev") -> list[str]:
    """Make /dev/nvidia0..count-1 with the options' owner, group and mode; return what was done."""
    uid, gid = options["NVreg_DeviceFileUID"], options["NVreg_DeviceFileGID"]
    mode = options["NVreg_DeviceFileMode"] & 0o777
    done = []
    for minor in range(count):
        path = os.path.join(dev, f"nvidia{minor}")
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            os.mknod(path, stat.S_IFCHR | mode, os.makedev(MAJOR, minor))
            os.chown(path, uid, gid)
            os.chmod(path, mode)  # mknod's mode passes through the umask
            done.append(f"created {path}")
            continue
        if not stat.S_ISCHR(info.st_mode):
            continue
        if options["NVreg_ModifyDeviceFiles"] and (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) != (
            uid,
            gid,
            mode,
        ):
            os.chown(path, uid, gid)
            os.chmod(path, mode)
            done.append(f"set {path}")
    return done


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    profile = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    dev = argv[1] if len(argv) > 1 else "/dev"
    dirs = tuple(argv[2:]) or MODPROBE_DIRS
    for line in make_nodes(driver_gpus(profile), module_options(dirs), dev):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
