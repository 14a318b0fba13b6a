"""Which NVIDIA character devices a systemd unit's DeviceAllow= list lets through.

Plain standard-library Python with no imports from the rest of the collection: `roles/probe/files/gpu-smoke`
and gpu-probe import it from the node package (budgetgpu_node) on a node without Ansible.

With DevicePolicy=closed a unit may open only /dev/null and co plus what DeviceAllow= names.
systemd resolves each entry when the unit starts (src/core/bpf-devices.c):

- `char-NAME` (or `block-NAME`) is matched with fnmatch(3) against the group names of that
  section of /proc/devices and allows every minor of each matching major; a pattern that
  matches nothing is dropped with a debug message, so naming a group the running driver
  does not register costs nothing. `char-*` allows the whole class, `char-195` a major.
- A path (`/dev/nvidia0`) is stat()ed and allows that one major:minor; a missing path is a
  warning and allows nothing. `/dev/char/MAJ:MIN` is parsed without a stat.
- The access letters default to `rwm`.

The NVIDIA driver registers its groups under names that changed across branches: up to 535
the GPUs and /dev/nvidiactl sit on major 195 as "nvidia-frontend"; from 545/550 on that major
is listed as "nvidia" and "nvidiactl" (and "nvidia-modeset"), and 550 added the dynamic
"nvidia-caps-imex-channels". "nvidia-uvm", "nvidia-caps", "nvidia-nvlink" and
"nvidia-nvswitch" have dynamic majors. An NVIDIA group is any /proc/devices character group
whose name starts with "nvidia" (as the NVIDIA container toolkit reads it).

A GPU belongs to the unit that holds it (issue 40): a group rule on major 195 would open every GPU, so a
unit names its own GPUs by node (`/dev/char/195:N`, N the GPU's minor, parsed without a stat: the node
may not exist yet when the unit starts) and the control nodes of that major (/dev/nvidiactl 195:255,
/dev/nvidia-modeset 195:254) the same way; the other NVIDIA groups (uvm, caps, nvlink) hold no GPU and
stay group rules. The device files themselves are mode 0660, group GPU_GROUP (the driver's
NVreg_DeviceFileMode/NVreg_DeviceFileGID, role nvidia_driver): the units get the group with
SupplementaryGroups=.
"""

from __future__ import annotations

import fnmatch
import os
import re
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

NVIDIA_PREFIX = "nvidia"
# The driver's fixed major (NV_MAJOR_DEVICE_NUMBER): the GPUs (minor N = /dev/nvidiaN) and the control nodes.
GPU_MAJOR = 195
CONTROL_MINORS = {"nvidiactl": 255, "nvidia-modeset": 254}
# The one name of the group that owns the NVIDIA device files (the cluster-wide input budgetgpu_gpu_group
# overrides it, read through the gpu_group filter), and their mode.
GPU_GROUP = "budgetgpu-gpu"
DEVICE_FILE_MODE = "0660"
# CUDA opens the GPU nodes read-write.
NEEDED_ACCESS = "rw"
_DEV_CHAR = re.compile(r"^/dev/(char|block)/(\d+):(\d+)$")


@dataclass(frozen=True)
class Rule:
    """One DeviceAllow= entry: a group pattern (kind "char"/"block") or a node (kind "path")."""

    kind: str
    spec: str
    access: str


def parse_proc_devices(text: str) -> dict[str, list[tuple[int, str]]]:
    """Return {"char": [(major, name), ...], "block": [...]} from /proc/devices, in file order.

    A major may appear under several names (195 nvidia, 195 nvidiactl); a blank line ends a
    section, as systemd reads it.
    """
    sections: dict[str, list[tuple[int, str]]] = {"char": [], "block": []}
    current = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped == "Character devices:":
            current = "char"
            continue
        if stripped == "Block devices:":
            current = "block"
            continue
        if not stripped:
            current = None
            continue
        if current is None:
            continue
        major, _space, name = stripped.partition(" ")
        if major.isdigit() and int(major) > 0 and name.strip():
            sections[current].append((int(major), name.strip()))
    return sections


def parse_device_allow(entries: Iterable[str]) -> list[Rule]:
    """Return the rules of DeviceAllow= values ("char-nvidia rw", "/dev/nvidia0", ...) in order.

    An empty value resets the list, as an empty DeviceAllow= does in a unit or drop-in.
    """
    rules: list[Rule] = []
    for entry in entries:
        words = str(entry).split()
        if not words:
            rules = []
            continue
        spec, access = words[0], (words[1] if len(words) > 1 else "rwm")
        if spec.startswith("char-"):
            rules.append(Rule("char", spec[len("char-") :], access))
        elif spec.startswith("block-"):
            rules.append(Rule("block", spec[len("block-") :], access))
        else:
            rules.append(Rule("path", spec, access))
    return rules


def _grants(rule: Rule, access: str) -> bool:
    return all(letter in rule.access for letter in access)


def allowed_majors(rules: Iterable[Rule], groups: dict[str, list[tuple[int, str]]], kind: str = "char") -> set[int]:
    """Return the majors of `kind` whose every minor the rules allow with NEEDED_ACCESS; {-1} means all."""
    majors: set[int] = set()
    for rule in rules:
        if rule.kind != kind or not _grants(rule, NEEDED_ACCESS):
            continue
        if rule.spec == "*":
            majors.add(-1)
        elif rule.spec.isdigit():
            majors.add(int(rule.spec))
        else:
            majors.update(major for major, name in groups.get(kind, []) if fnmatch.fnmatchcase(name, rule.spec))
    return majors


def _stat_char(path: str) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (os.major(info.st_rdev), os.minor(info.st_rdev)) if stat.S_ISCHR(info.st_mode) else None


def allowed_nodes(
    rules: Iterable[Rule], stat_char: Callable[[str], tuple[int, int] | None] = _stat_char
) -> set[tuple[int, int]]:
    """Return the (major, minor) of the character nodes that path rules allow with NEEDED_ACCESS.

    stat_char(path) gives a path's (major, minor), None where it is missing or not a char device.
    """
    nodes = set()
    for rule in rules:
        if rule.kind != "path" or not _grants(rule, NEEDED_ACCESS):
            continue
        parsed = _DEV_CHAR.match(rule.spec)
        if parsed:
            if parsed.group(1) == "char":
                nodes.add((int(parsed.group(2)), int(parsed.group(3))))
            continue
        found = stat_char(rule.spec)
        if found is not None:
            nodes.add(found)
    return nodes


def node_allowed(
    rules: list[Rule],
    groups: dict[str, list[tuple[int, str]]],
    major: int,
    minor: int,
    stat_char: Callable[[str], tuple[int, int] | None] = _stat_char,
) -> bool:
    """Return whether the char device major:minor may be opened read-write under the rules."""
    majors = allowed_majors(rules, groups)
    return -1 in majors or major in majors or (major, minor) in allowed_nodes(rules, stat_char)


def nvidia_groups(groups: dict[str, list[tuple[int, str]]]) -> list[tuple[int, str]]:
    """Return the (major, name) of the NVIDIA character groups the running driver registered."""
    return [(major, name) for major, name in groups.get("char", []) if name.startswith(NVIDIA_PREFIX)]


def gpu_minor(gpu: Mapping[str, Any]) -> int:
    """Return the driver's minor number of a GPU (/dev/nvidia<minor>): the probe's minor_number where it has one,
    else its NVML index (the driver numbers GPUs in bus order, as NVML's index does)."""
    minor = gpu.get("minor_number")
    return int(minor if isinstance(minor, int) else gpu.get("index", 0))


def unit_gpu_minors(show: Iterable[str], proc_devices: str, minors: Iterable[int]) -> set[int]:
    """Return which of these GPU minors a unit may open, from the lines of `systemctl show
    --property=DevicePolicy,DeviceAllow` (one DeviceAllow= line per entry): those its DeviceAllow= lets through,
    or every one under DevicePolicy=auto with no DeviceAllow=, where systemd lets every device through."""
    policy, allow = "auto", []
    for line in show:
        key, _sep, value = line.partition("=")
        if key == "DevicePolicy":
            policy = value.strip()
        elif key == "DeviceAllow":
            allow.append(value)
    if policy == "auto" and not allow:
        return set(minors)
    rules, groups = parse_device_allow(allow), parse_proc_devices(proc_devices)
    return {minor for minor in minors if node_allowed(rules, groups, GPU_MAJOR, minor)}


def gpu_device_allow(minors: Iterable[int]) -> list[str]:
    """Return the DeviceAllow= entries of the GPUs with these minors and of the control nodes on their major."""
    wanted = sorted(set(CONTROL_MINORS.values()) | {int(minor) for minor in minors})
    return [f"/dev/char/{GPU_MAJOR}:{minor} rw" for minor in wanted]


def uncovered_groups(device_allow: Iterable[str], proc_devices: str) -> list[tuple[int, str]]:
    """Return the NVIDIA groups of /proc/devices (its text) that DeviceAllow= leaves closed: those whose
    major it does not open rw, except the GPU major, which counts as open when /dev/nvidiactl (195:255) is:
    a unit opens its own GPUs there node by node (gpu_device_allow).

    Other node paths do not count: they open single minors, and a group's nodes come and go with its GPUs.
    """
    groups = parse_proc_devices(proc_devices)
    rules = parse_device_allow(device_allow)
    majors = allowed_majors(rules, groups)
    if -1 in majors:
        return []
    control = (GPU_MAJOR, CONTROL_MINORS["nvidiactl"]) in allowed_nodes(rules, stat_char=lambda _path: None)
    return [
        (major, name)
        for major, name in nvidia_groups(groups)
        if major not in majors and not (major == GPU_MAJOR and control)
    ]


def uncovered_message(uncovered: list[tuple[int, str]], where: str = "DeviceAllow=") -> str:
    """Return one line naming the uncovered groups and the entries that would open them."""
    if not uncovered:
        return f"{where} opens every NVIDIA device group in /proc/devices"
    names = ", ".join(f"{name} (major {major})" for major, name in uncovered)
    # One group per major is enough: systemd opens every minor of a matching group's major. The GPU major by
    # its control node alone: a group rule there would open every GPU.
    first_by_major = dict(reversed(uncovered))
    entries = ", ".join(
        f"/dev/char/{GPU_MAJOR}:{CONTROL_MINORS['nvidiactl']} rw"
        if major == GPU_MAJOR
        else f"char-{first_by_major[major]} rw"
        for major in dict.fromkeys(m for m, _n in uncovered)
    )
    return (
        f"{where} does not open the NVIDIA device groups {names}: a unit with DevicePolicy=closed cannot "
        f"open their /dev nodes; add {entries} to torchrun_device_allow"
    )
