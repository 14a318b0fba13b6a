#!/usr/bin/env python3
"""Render a GPU simulation profile's PCI functions as a sysfs tree.

Usage: render_sim.py PROFILE.json ROOT   (writes ROOT/devices/... and ROOT/bus/pci/devices/*)

Prints "rendered" after writing the tree, or "unchanged" when ROOT already holds this profile
(ROOT/.budgetgpu-profile records the profile's SHA-256); a tree of another profile is replaced.

A profile's "pci" list holds one entry per PCI function: "bdf", "parent" (the bus id of the
bridge above, or null on a root bus), optional "nvml" (the answers of the gpu_sim pynvml
drop-in for a GPU) and "comment"; every other key is written verbatim as a sysfs attribute
file (vendor, device, class, current_link_speed, max_link_width, numa_node, ...), so odd
strings such as "Unknown" or "8 GT/s" can be rendered as they are. Unit tests import this
file by path to build trees in a temporary directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from typing import Any

NOT_ATTRIBUTES = {"bdf", "parent", "nvml", "comment"}


def load_profile(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def function_dirs(functions: list[dict[str, Any]]) -> dict[str, str]:
    """Return {bdf: path relative to the sysfs root} for every function, parents first."""
    by_bdf = {function["bdf"]: function for function in functions}
    paths: dict[str, str] = {}

    def path_of(bdf: str) -> str:
        if bdf not in paths:
            parent = by_bdf[bdf].get("parent")
            if parent:
                paths[bdf] = f"{path_of(parent)}/{bdf}"
            else:
                domain, bus, _unused = bdf.split(":")
                paths[bdf] = f"devices/pci{domain}:{bus}/{bdf}"
        return paths[bdf]

    for function in functions:
        path_of(function["bdf"])
    return paths


# The kernel's aer_dev_* files (drivers/pci/pcie/aer.c): one "NAME COUNT" line per error it knows,
# then TOTAL_ERR_*. A GPU of a profile without its own gets zero counters, which tests then grow.
AER_ERRORS = {
    "aer_dev_correctable": (["RxErr", "BadTLP", "BadDLLP", "Rollover", "Timeout", "NonFatalErr"], "TOTAL_ERR_COR"),
    "aer_dev_nonfatal": (
        ["Undefined", "DLP", "SDES", "TLP", "FCP", "CmpltTO", "UnxCmplt", "ECRC"],
        "TOTAL_ERR_NONFATAL",
    ),
    "aer_dev_fatal": (["Undefined", "DLP", "SDES", "TLP", "FCP", "CmpltTO", "UnxCmplt", "ECRC"], "TOTAL_ERR_FATAL"),
}


def aer_attributes(function: dict[str, Any]) -> dict[str, str]:
    """Return zeroed aer_dev_* file contents for a GPU function (one with "nvml"), else nothing."""
    if "nvml" not in function:
        return {}
    return {
        name: "\n".join([f"{error} 0" for error in errors] + [f"{total} 0"])
        for name, (errors, total) in AER_ERRORS.items()
    }


def render_sysfs(profile: dict[str, Any], root: str) -> None:
    """Write the profile's functions under root as sysfs has them (files and bus symlinks)."""
    functions = profile.get("pci", [])
    bus_dir = os.path.join(root, "bus", "pci", "devices")
    os.makedirs(bus_dir, exist_ok=True)
    dirs = function_dirs(functions)
    for function in functions:
        relative = dirs[function["bdf"]]
        device_dir = os.path.join(root, relative)
        os.makedirs(device_dir, exist_ok=True)
        for key, value in {**aer_attributes(function), **function}.items():
            if key not in NOT_ATTRIBUTES:
                with open(os.path.join(device_dir, key), "w", encoding="ascii") as handle:
                    handle.write(f"{value}\n")
        link = os.path.join(bus_dir, function["bdf"])
        if os.path.lexists(link):
            os.remove(link)
        # Relative, as the kernel writes them: the tree can be moved or copied.
        os.symlink(f"../../../{relative}", link)


def render_if_changed(profile_path: str, root: str) -> bool:
    """Render the profile under root unless root already holds it; return whether it rendered."""
    with open(profile_path, "rb") as handle:
        digest = hashlib.sha256(handle.read()).hexdigest()
    stamp = os.path.join(root, ".budgetgpu-profile")
    try:
        with open(stamp, encoding="ascii") as handle:
            if handle.read().strip() == digest:
                return False
    except OSError:
        pass
    shutil.rmtree(root, ignore_errors=True)
    render_sysfs(load_profile(profile_path), root)
    with open(stamp, "w", encoding="ascii") as handle:
        handle.write(f"{digest}\n")
    return True


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    print("rendered" if render_if_changed(argv[1], argv[2]) else "unchanged")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
