"""The kernels a node boots and the nvidia module each needs: which headers keep DKMS building for the kernels
that unattended-upgrades installs later, and which installed kernels have no nvidia module (a boot into one has
no driver).

Pure functions of facts (gpu_facts' driver.kernels and driver.dkms, setup's kernel and distribution); no I/O, no
Ansible. plugins/filter/nvidia.py calls kernel_headers in nvidia_driver_plan and exposes kernel_module_problems
as nvidia_kernel_problems.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

# A kernel of the distribution's archive: upstream version, then Debian 12's and Ubuntu's ABI number or Debian's
# +debNN, then the flavour (6.1.0-27-cloud-amd64, 6.12.48+deb13-rt-amd64, 5.15.0-122-generic). A custom kernel
# (6.18.44-fc-v1252) has no metapackage, nor has a backports one here (6.12.12+bpo-amd64: its metapackage lives in
# the backports suite, and the stable one would track another series).
_ARCHIVE_RELEASE = re.compile(r"^(?P<major>\d+)\.(?P<minor>\d+)\.\d+(?:-\d+|\+deb\d+)-(?P<flavor>[a-z][a-z0-9-]*)$")

# Only these Ubuntu flavours have HWE variants; a cloud flavour's metapackage (linux-headers-aws) follows its own
# kernel series already.
UBUNTU_HWE_FLAVORS = ("generic", "lowlatency", "generic-64k")


def _series(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in str(text).split("."))


def headers_metapackage(release: str, distribution: str, version: str, default_series: str) -> str | None:
    """The headers metapackage that follows kernel `release` (each later kernel of its flavour and series
    brings its headers with it, and DKMS builds for it), or None where the archive has none for this kernel.

    default_series is the release's own kernel series (vars/<Distribution>.yml): Debian 12's 6.1, Ubuntu
    22.04's GA 5.15. Another series is Debian's newer one for the release (6.12 on Debian 12:
    linux-headers-6.12-amd64) or Ubuntu's HWE kernel (linux-headers-generic-hwe-22.04)."""
    match = _ARCHIVE_RELEASE.match(release or "")
    if not match or distribution not in ("Debian", "Ubuntu"):
        return None
    flavor = match["flavor"]
    series = (int(match["major"]), int(match["minor"]))
    if series == _series(default_series):
        return f"linux-headers-{flavor}"
    if distribution == "Debian":
        return f"linux-headers-{series[0]}.{series[1]}-{flavor}"
    if flavor in UBUNTU_HWE_FLAVORS and series > _series(default_series):
        return f"linux-headers-{flavor}-hwe-{version}"
    return f"linux-headers-{flavor}"


def kernel_headers(
    running: str,
    in_container: bool,
    kernels: Sequence[Mapping[str, Any]] | None,
    distribution: str,
    version: str,
    default_series: str,
) -> dict[str, Any]:
    """What the driver role installs so that DKMS builds for this kernel and the next ones:
    {kernel, packages, note}. The kernel is the running one; in a container, which runs its host's kernel, the
    newest kernel installed in it (DKMS's own rule in a chroot), or none. The note says why a metapackage is
    missing (None when there is one)."""
    kernel = (kernels[-1]["release"] if kernels else None) if in_container else running
    if not kernel:
        note = "a container runs its host's kernel and has no kernel installed of its own: no headers"
        return {"kernel": None, "packages": [], "note": note}
    metapackage = headers_metapackage(kernel, distribution, version, default_series)
    if metapackage is None:
        note = (
            f"kernel {kernel} is not a kernel of {distribution} {version}'s archive: no headers metapackage, so "
            "DKMS builds for a later kernel only where its headers are installed another way"
        )
        return {"kernel": kernel, "packages": [f"linux-headers-{kernel}"], "note": note}
    return {"kernel": kernel, "packages": [f"linux-headers-{kernel}", metapackage], "note": None}


def kernel_module_problems(driver: Mapping[str, Any] | None, host: str) -> list[str]:
    """Each installed kernel that has no nvidia module, on a node where the driver is installed (DKMS has an
    nvidia module registered, or some kernel has the module): a boot into it has no driver. The last kernel is
    the one GRUB boots next by default. A node without the driver gets nothing: there is nothing to build yet."""
    driver = driver or {}
    kernels = list(driver.get("kernels") or [])
    registered = [entry for entry in driver.get("dkms") or [] if str(entry.get("module", "")).startswith("nvidia")]
    if not registered and not any(kernel.get("nvidia_module") for kernel in kernels):
        return []
    problems = []
    for position, kernel in enumerate(kernels, start=1):
        if kernel.get("nvidia_module"):
            continue
        release = kernel["release"]
        boot = "the next boot has no driver" if position == len(kernels) else "booting it has no driver"
        if not registered:
            fix = f"install the driver's kernel module package for {release}"
        elif kernel.get("headers"):
            fix = f"its headers are there but DKMS built nothing: `dkms autoinstall -k {release}` says why"
        else:
            fix = f"install linux-headers-{release} and run `dkms autoinstall -k {release}`"
        problems.append(f"{host}: kernel {release} installed, no nvidia module built for it: {boot} ({fix})")
    return problems
