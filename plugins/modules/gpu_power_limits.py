#!/usr/bin/python
# Copyright: budgetgpu maintainers
# Apache License 2.0 (see galaxy.yml)
# ruff: noqa: E402 (Ansible modules import after DOCUMENTATION, EXAMPLES and RETURN)
"""Ansible module: set the GPUs' power limits through NVML, per node, GPU model or GPU."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_power_limits
short_description: Set the GPUs' power limits through NVML
version_added: "0.1.0"
description:
  - Resolves which GPU gets which cap (per node, per GPU model, per GPU UUID or PCI bus id), checks
    every cap against the card's NVML power management limit constraints and the sum against an
    optional budget, and sets the limits that differ with C(nvmlDeviceSetPowerManagementLimit).
  - Refuses, changing nothing, a cap outside a card's range, a key that matches no GPU of the node,
    a GPU named twice with two caps, or caps whose sum exceeds the budget; the message names the host,
    the GPU (index, UUID, bus id), the value and the range.
  - NVML forgets the limits at a reboot; role C(budgetgpu.cluster.gpu_power) installs a oneshot unit
    that runs the same code (C(roles/gpu_power/files/gpu-power)) at boot.
  - The rules live in C(plugins/module_utils/gpu_power.py), which preflight uses too.
author:
  - budgetgpu maintainers (!UNKNOWN)
requirements:
  - nvidia-ml-py (the C(pynvml) module) on the managed node; setting a limit needs root
options:
  caps:
    description:
      - Watts for every GPU of the node, or a mapping whose keys are C(all), a GPU model as NVML names it
        (C(NVIDIA GeForce RTX 3090)), a GPU UUID (C(GPU-...)) or a PCI bus id in any form
        (C(01:00.0), C(0000:01:00.0), C(00000000:01:00.0)).
      - A GPU's own key wins over its model, which wins over C(all). GPUs without a cap are left alone.
    type: raw
    required: true
  budget_watts:
    description:
      - The most the node's GPUs may draw together, checked against the sum of their caps (a GPU
        without a cap counts at its default limit).
    type: float
  node_name:
    description: How messages name the node.
    type: str
    default: this node
seealso:
  - module: budgetgpu.cluster.gpu_facts
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details: Says which limits it would set (C(changes), C(drift)) and sets none.
  diff_mode:
    support: none
  platform:
    platforms: posix
"""

EXAMPLES = r"""
- name: Cap every RTX 3090 at 280 W and one worn card at 250 W
  budgetgpu.cluster.gpu_power_limits:
    caps:
      NVIDIA GeForce RTX 3090: 280
      "04:00.0": 250
    budget_watts: 1200
    node_name: "{{ inventory_hostname }}"
"""

RETURN = r"""
changes:
  description: The GPUs whose limit was set (or would be, in check mode).
  returned: success
  type: list
  elements: dict
  contains:
    index:
      description: NVML index.
      type: int
      returned: always
      sample: 3
    uuid:
      description: GPU UUID.
      type: str
      returned: always
      sample: GPU-30900003-5a1e-4c0d-9b7e-000000000003
    bus_id:
      description: PCI bus id in sysfs form.
      type: str
      returned: always
      sample: "0000:04:00.0"
    from_w:
      description: The limit before, in watts.
      type: float
      returned: always
      sample: 350.0
    to_w:
      description: The limit after, in watts.
      type: float
      returned: always
      sample: 250.0
    line:
      description: The change in words.
      type: str
      returned: always
      sample: "GPU 3 (GPU-30900003-..., 0000:04:00.0, NVIDIA GeForce RTX 3090): power limit 350 W -> 250 W"
drift:
  description: The C(line) of each change, which the drift_report callback puts in the nightly report.
  returned: success
  type: list
  elements: str
  sample: ["GPU 3 (GPU-30900003-..., 0000:04:00.0, NVIDIA GeForce RTX 3090): power limit 350 W -> 250 W"]
problems:
  description: Why the caps were refused, one line per problem.
  returned: failure
  type: list
  elements: str
  sample: ["node1: gpu_power_limit_watts['all']: GPU 0 (...): 500 W is outside the card's range 100-400 W"]
"""

import traceback

from ansible.module_utils.basic import AnsibleModule, missing_required_lib
from ansible_collections.budgetgpu.cluster.plugins.module_utils.gpu_power import enforce

PYNVML_IMPORT_ERROR = None
try:
    import pynvml
except ImportError:
    pynvml, PYNVML_IMPORT_ERROR = None, traceback.format_exc()


def build_module() -> AnsibleModule:
    return AnsibleModule(
        argument_spec={
            "caps": {"type": "raw", "required": True},
            "budget_watts": {"type": "float"},
            "node_name": {"type": "str", "default": "this node"},
        },
        supports_check_mode=True,
    )


def main() -> None:
    module = build_module()
    if pynvml is None:
        module.fail_json(msg=missing_required_lib("nvidia-ml-py"), exception=PYNVML_IMPORT_ERROR)
    params = module.params
    result = enforce(pynvml, params["node_name"], params["caps"], params["budget_watts"], module.check_mode)
    if result.pop("failed"):
        module.fail_json(**result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
