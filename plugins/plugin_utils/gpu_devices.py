"""Who may open a node's GPUs (issue 40 item 3): the group that owns the NVIDIA device files, the driver's
options that make them mode 0660 of that group, and the device minors each unit that runs users' code may open.

The node side (the DeviceAllow= entries, GPU_GROUP, the mode) is ``module_utils/device_allow.py``, which
``roles/probe/files/gpu-smoke`` loads on a node; this module is the controller's planning over the probe's facts.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.module_utils.device_allow import (
    DEVICE_FILE_MODE,
    GPU_GROUP,
    gpu_device_allow,
    gpu_minor,
)

# useradd's default NAME_REGEX (Debian's adduser is stricter still): a group name systemd and the driver accept.
_GROUP_NAME = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")


def gpu_group(value: Any = None) -> str:
    """Return the group of the NVIDIA device files: budgetgpu_gpu_group, or GPU_GROUP when the inventory sets none.
    ValueError naming the variable for a name that is not a group name."""
    if value is None or value == "":
        return GPU_GROUP
    if not isinstance(value, str) or not _GROUP_NAME.match(value):
        raise ValueError(
            f"budgetgpu_gpu_group: found {value!r}, expected a group name (lower case letters, digits, '_' and '-', "
            f"at most 32, not starting with a digit), e.g. {GPU_GROUP}"
        )
    return value


def gpu_minors(gpus: Iterable[Mapping[str, Any]] | None, indices: Iterable[Any]) -> list[int]:
    """Return the minors of the GPUs with these NVML indices (gpu_facts' gpus); an index the facts do not list
    stands for itself (a node probed before its driver loaded)."""
    by_index = {int(g.get("index", -1)): g for g in gpus or [] if isinstance(g, Mapping)}
    return sorted({gpu_minor(by_index[int(i)]) if int(i) in by_index else int(i) for i in indices})


def unit_device_allow(gpus: Iterable[Mapping[str, Any]] | None, indices: Iterable[Any]) -> list[str]:
    """Return the DeviceAllow= entries that let a unit open the GPUs with these indices, and no other GPU: each
    GPU's node and the control nodes of the driver's major (device_allow.gpu_device_allow)."""
    return gpu_device_allow(gpu_minors(gpus, indices))


def driver_device_options(gid: Any) -> dict[str, str]:
    """Return the nvidia module's options that make its device files root's, mode 0660, group gid: the driver
    and nvidia-modprobe (which CUDA runs to make a missing node) create and fix the files with them."""
    try:
        number = int(gid)
    except (TypeError, ValueError):
        number = -1
    if number < 0:
        raise ValueError(f"found GPU group id {gid!r}, expected the number of the group budgetgpu_gpu_group names")
    return {"NVreg_DeviceFileUID": "0", "NVreg_DeviceFileGID": str(number), "NVreg_DeviceFileMode": DEVICE_FILE_MODE}
