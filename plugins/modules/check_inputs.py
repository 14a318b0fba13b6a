#!/usr/bin/python
# Copyright: budgetgpu maintainers
# Apache License 2.0 (see galaxy.yml)
"""Documentation of budgetgpu.cluster.check_inputs: the action plugin of the same name does the work
on the control node (as ansible.builtin.assert has no module either)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: check_inputs
short_description: Check every input of the collection's roles for a host, on the control node
version_added: "0.1.0"
description:
  - Validates each variable that the inventory (or C(--extra-vars)) sets for the host and that bears a
    role's prefix (C(nvidia_driver_), C(cuda_), C(container_runtime_), C(python_env_), C(nccl_network_),
    C(torchrun_), C(probe_), C(preflight_), C(reprovision_), C(gpu_sim_)) or the cluster's (C(budgetgpu_))
    against the argument spec of the role that reads it, whether or not that role runs on the host.
  - A prefixed name that no role knows is refused with the nearest known name ("did you mean
    nvidia_driver_reboot?"); a renamed one with its new name.
  - Also refuses a C(budgetgpu_cluster_subnet) that no interface of the node holds (the probe's
    C(budgetgpu_net) facts) and a C(python_env_wheelhouse) that is not a directory on the control node.
  - Each problem names the host, the variable, what was expected and what was found. Role defaults and
    play vars are not inputs and are not checked; values are templated first.
  - Runs on the control node only (action plugin); no call to the node.
author:
  - budgetgpu maintainers (!UNKNOWN)
options: {}
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
  diff_mode:
    support: none
  platform:
    platforms: posix
seealso:
  - module: ansible.builtin.validate_argument_spec
"""

EXAMPLES = r"""
- name: Refuse inputs no role can work with
  budgetgpu.cluster.check_inputs:
  any_errors_fatal: true
"""

RETURN = r"""
problems:
  description: One line per problem, each naming host, variable, expected and found.
  returned: always
  type: list
  elements: str
  sample: ["node1: nvidia_driver_reboots: no role knows this variable: did you mean nvidia_driver_reboot?"]
checked:
  description: The input variables checked for the host.
  returned: always
  type: list
  elements: str
not_templated:
  description: Inputs whose value cannot be templated before the run gathers facts; their roles check them.
  returned: always
  type: list
  elements: str
"""
