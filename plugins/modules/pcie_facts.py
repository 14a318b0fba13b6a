#!/usr/bin/python
# Copyright: budgetgpu maintainers
# Apache License 2.0 (see galaxy.yml)
# ruff: noqa: E402 (Ansible modules import after DOCUMENTATION, EXAMPLES and RETURN)
"""Ansible module: PCIe path, effective link and downgrades of every NVIDIA GPU, from sysfs."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: pcie_facts
short_description: PCIe path, effective link and downgrades of every NVIDIA GPU, from sysfs
version_added: "0.1.0"
description:
  - Finds every NVIDIA GPU function on the PCI bus (vendor C(0x10de), display class; not the
    HDMI audio or USB-C functions of consumer cards) and the bridges above it up to the root
    port, with each one's link speed and width, current and maximum. Works before any driver
    is installed.
  - Per GPU, the links on its path (a root port or switch downstream port and the function
    below it), the effective link (the slowest generation and narrowest width on the path),
    what the path can give (both ends of every link), the limiting hop, and whether a link
    trained below what both of its ends support (C(downgraded), with reasons).
  - An x1 link under a port that is x1 is what the slot gives (not downgraded); an x1 link
    where both ends can do x4 is a bad riser or seating (downgraded). A generation below
    the maximum is reported apart (RV(ansible_facts.budgetgpu_pcie.gpus[].gen_below_max))
    because GPUs lower their own link's generation at idle; width drops do not recover.
  - With O(min_width) or O(expected), a GPU that misses its expectation fails the module with
    a message naming the node, the bus id, what was found, what was expected and what to check.
  - Returns C(ansible_facts.budgetgpu_pcie); never reports C(changed).
author:
  - budgetgpu maintainers (!UNKNOWN)
options:
  sysfs_root:
    description:
      - Where sysfs is mounted. Simulated nodes point this at the tree that
        C(budgetgpu.cluster.gpu_sim) renders (C(/var/lib/budgetgpu-sim/sys)).
    type: path
    default: /sys
  min_width:
    description:
      - Fail when any GPU's effective link is narrower than this many lanes.
    type: int
    choices: [1, 2, 4, 8, 16, 32]
  expected:
    description:
      - Per GPU bus id (C(0000:01:00.0), NVML's C(00000000:01:00.0) or C(01:00.0)), the
        least C(width) and/or C(gen) it must reach. Fail when a listed GPU is missing or
        falls short. C(gen) is compared with what the path can reach, since GPUs drop
        their link's generation at idle.
    type: dict
  node_name:
    description:
      - Name of the node in failure messages (pass C({{ inventory_hostname }})).
      - Defaults to the node's host name.
    type: str
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - ansible.builtin.action_common_attributes.facts
attributes:
  check_mode:
    support: full
  diff_mode:
    support: none
  facts:
    support: full
  platform:
    platforms: posix
notes:
  - A GPU on a root bus (passed through to a VM) has no visible port above it; its link is
    judged against its own maximum only and not marked downgraded.
seealso:
  - module: budgetgpu.cluster.gpu_facts
"""

EXAMPLES = r"""
- name: Read the GPUs' PCIe links
  budgetgpu.cluster.pcie_facts:

- name: Require x4 or wider for every GPU and gen4 x16 for the first
  budgetgpu.cluster.pcie_facts:
    node_name: "{{ inventory_hostname }}"
    min_width: 4
    expected:
      "0000:01:00.0": {width: 16, gen: 4}

- name: Read a simulated node's tree
  budgetgpu.cluster.pcie_facts:
    sysfs_root: "{{ budgetgpu_sysfs_root | default('/sys') }}"
"""

RETURN = r"""
ansible_facts:
  description: Facts added to the host.
  returned: always
  type: dict
  contains:
    budgetgpu_pcie:
      description: Every NVIDIA GPU on the PCI bus with its path and link verdicts.
      returned: always
      type: dict
      contains:
        sysfs_root:
          description: The sysfs tree that was read.
          type: str
          returned: always
          sample: /sys
        count:
          description: Number of NVIDIA GPU functions on the bus.
          type: int
          returned: always
          sample: 4
        gpus:
          description: One entry per GPU, in bus id order.
          type: list
          elements: dict
          returned: always
          contains:
            bus_id:
              description: PCI bus id.
              type: str
              returned: always
              sample: "0000:04:00.0"
            vendor_id:
              description: PCI vendor id.
              type: str
              returned: always
              sample: "0x10de"
            device_id:
              description: PCI device id.
              type: str
              returned: always
              sample: "0x2204"
            name:
              description: Model for well-known device ids, else C(NVIDIA device <id>).
              type: str
              returned: always
              sample: GeForce RTX 3090
            class:
              description: PCI class code.
              type: str
              returned: always
              sample: "0x030000"
            link:
              description: The GPU function's own link attributes; null where sysfs has none or says C(Unknown).
              type: dict
              returned: always
              contains:
                current_gen:
                  description: Current generation.
                  type: int
                  returned: always
                  sample: 3
                current_speed_gts:
                  description: Current speed in GT/s.
                  type: float
                  returned: always
                  sample: 8.0
                current_width:
                  description: Current width in lanes.
                  type: int
                  returned: always
                  sample: 1
                max_gen:
                  description: The GPU's maximum generation.
                  type: int
                  returned: always
                  sample: 4
                max_speed_gts:
                  description: The GPU's maximum speed in GT/s.
                  type: float
                  returned: always
                  sample: 16.0
                max_width:
                  description: The GPU's maximum width.
                  type: int
                  returned: always
                  sample: 16
            path:
              description: >-
                PCI functions from the root port down to the GPU, each with its own link
                attributes (as in RV(ansible_facts.budgetgpu_pcie.gpus[].link)).
              type: list
              elements: dict
              returned: always
              sample:
                - bus_id: "0000:00:1d.0"
                  role: root_port
                  vendor_id: "0x8086"
                  device_id: "0xa298"
                  class: "0x060400"
                  link: {current_gen: 3, current_speed_gts: 8.0, current_width: 1,
                         max_gen: 3, max_speed_gts: 8.0, max_width: 4}
                - bus_id: "0000:04:00.0"
                  role: gpu
                  vendor_id: "0x10de"
                  device_id: "0x2204"
                  class: "0x030000"
                  link: {current_gen: 3, current_speed_gts: 8.0, current_width: 1,
                         max_gen: 4, max_speed_gts: 16.0, max_width: 16}
              contains:
                bus_id:
                  description: PCI bus id of the hop.
                  type: str
                  returned: always
                  sample: "0000:00:1d.0"
                role:
                  description: C(root_port), C(switch_upstream), C(switch_downstream), C(bridge) or C(gpu).
                  type: str
                  returned: always
                  sample: root_port
                vendor_id:
                  description: PCI vendor id.
                  type: str
                  returned: always
                  sample: "0x8086"
                device_id:
                  description: PCI device id.
                  type: str
                  returned: always
                  sample: "0xa298"
                class:
                  description: PCI class code.
                  type: str
                  returned: always
                  sample: "0x060400"
                link:
                  description: The hop's link attributes (current/max gen, speed, width).
                  type: dict
                  returned: always
                  sample: {current_gen: 3, current_speed_gts: 8.0, current_width: 1,
                           max_gen: 3, max_speed_gts: 8.0, max_width: 4}
            links:
              description: The physical links on the path, root first.
              type: list
              elements: dict
              returned: always
              contains:
                upstream:
                  description: Bus id of the port above the link; null when none is visible (a VM).
                  type: str
                  returned: always
                  sample: "0000:00:1d.0"
                downstream:
                  description: Bus id of the function below the link.
                  type: str
                  returned: always
                  sample: "0000:04:00.0"
                gen:
                  description: Generation the link trained at.
                  type: int
                  returned: always
                  sample: 3
                width:
                  description: Width the link trained at.
                  type: int
                  returned: always
                  sample: 1
                capable_gen:
                  description: Highest generation both ends support.
                  type: int
                  returned: always
                  sample: 3
                capable_width:
                  description: Widest width both ends support.
                  type: int
                  returned: always
                  sample: 4
                bandwidth_gbps:
                  description: Usable GB/s per direction at the trained generation and width.
                  type: float
                  returned: always
                  sample: 0.985
                downgraded:
                  description: Whether the link trained below what both ends support.
                  type: bool
                  returned: always
                  sample: true
                reasons:
                  description: Why, and what to check.
                  type: list
                  elements: str
                  returned: always
                  sample:
                    - "link 0000:00:1d.0 -> 0000:04:00.0 trained at x1 but both ends support x4: reseat ..."
            effective:
              description: The path as trained now, the slowest generation and narrowest width of its links.
              type: dict
              returned: always
              contains:
                gen:
                  description: Lowest current generation on the path.
                  type: int
                  returned: always
                  sample: 3
                width:
                  description: Narrowest current width on the path.
                  type: int
                  returned: always
                  sample: 1
                bandwidth_gbps:
                  description: Usable GB/s per direction at that generation and width.
                  type: float
                  returned: always
                  sample: 0.985
            capable:
              description: What the path can give (the lower of both ends' maximum, over all links).
              type: dict
              returned: always
              contains:
                gen:
                  description: Generation the path supports.
                  type: int
                  returned: always
                  sample: 3
                width:
                  description: Width the path supports (an x4 slot gives x4).
                  type: int
                  returned: always
                  sample: 4
                bandwidth_gbps:
                  description: Usable GB/s per direction at that generation and width.
                  type: float
                  returned: always
                  sample: 3.94
            limiting_hop:
              description: >-
                Bus id of the port above the link with the least bandwidth (the GPU itself when
                no port is visible).
              type: str
              returned: always
              sample: "0000:00:1d.0"
            downgraded:
              description:
                - Whether a link on the path trained below what both its ends support (any link's width; the
                  generation of links other than the GPU's own, which drops at idle).
              type: bool
              returned: always
              sample: true
            downgrade_reasons:
              description: One message per downgraded link.
              type: list
              elements: str
              returned: always
              sample:
                - "link 0000:00:1d.0 -> 0000:04:00.0 trained at x1 but both ends support x4: reseat ..."
            gen_below_max:
              description: Whether the effective generation is below what the path supports (often idle power saving).
              type: bool
              returned: always
              sample: false
            width_below_max:
              description: Whether the effective width is below what the path supports (does not recover by itself).
              type: bool
              returned: always
              sample: true
            numa_node:
              description: NUMA node of the GPU; null when sysfs says -1.
              type: int
              returned: always
              sample: 0
            local_cpus:
              description: CPUs local to the GPU (sysfs C(local_cpulist)).
              type: str
              returned: always
              sample: 0-15
"""

import re
import socket

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.budgetgpu.cluster.plugins.module_utils.pcie import (
    check_expectations,
    probe_pcie,
)

BUS_ID = re.compile(r"^([0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")


def build_module() -> AnsibleModule:
    return AnsibleModule(
        argument_spec={
            "sysfs_root": {"type": "path", "default": "/sys"},
            "min_width": {"type": "int", "choices": [1, 2, 4, 8, 16, 32]},
            "expected": {"type": "dict"},
            "node_name": {"type": "str"},
        },
        supports_check_mode=True,
    )


def validate_expected(expected: dict) -> list[str]:
    """Return one message per malformed entry of the expected option."""
    problems = []
    for bus_id, want in expected.items():
        if not BUS_ID.match(str(bus_id)):
            problems.append(f"expected: '{bus_id}' is not a PCI bus id (like 0000:01:00.0)")
            continue
        if not isinstance(want, dict) or not want or set(want) - {"width", "gen"}:
            problems.append(f"expected['{bus_id}'] must be a mapping with width and/or gen, got {want!r}")
            continue
        for key, value in want.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"expected['{bus_id}'].{key} must be a positive integer, got {value!r}")
    return problems


def main() -> None:
    module = build_module()
    params = module.params
    expected = params["expected"] or {}
    bad = validate_expected(expected)
    if bad:
        module.fail_json(msg="; ".join(bad))
    facts = probe_pcie(params["sysfs_root"])
    node = params["node_name"] or socket.gethostname()
    problems = check_expectations(facts, node, params["min_width"], expected)
    if problems:
        module.fail_json(msg="; ".join(problems), problems=problems, budgetgpu_pcie=facts)
    module.exit_json(changed=False, ansible_facts={"budgetgpu_pcie": facts})


if __name__ == "__main__":
    main()
