#!/usr/bin/python
# Copyright: budgetgpu maintainers
# Apache License 2.0 (see galaxy.yml)
# ruff: noqa: E402 (Ansible modules import after DOCUMENTATION, EXAMPLES and RETURN)
"""Ansible module: NVIDIA driver state and per-GPU facts from NVML."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_facts
short_description: NVIDIA driver state and per-GPU facts from NVML
version_added: "0.1.0"
description:
  - Reads the NVIDIA driver state and, for every GPU, identity, memory, compute capability,
    PCIe link, temperature, power (draw, enforced limit, the range a limit may be set in, the
    default) and energy counter, clocks, throttle reasons, ECC, persistence and MIG mode,
    NVLink and memory health through NVML (the C(pynvml) module of nvidia-ml-py).
  - A node without a GPU, without a driver, or with a driver that is not loaded still
    succeeds; RV(ansible_facts.budgetgpu_gpus.driver) says which, and why.
  - A field the GPU does not support is the string C(unsupported), never an error. A field
    that failed for another reason is C(null), with NVML's message under the GPU's C(errors).
  - Any nvidia-ml-py binding works, field by field, the distro's included (Ubuntu 22.04's 7.352,
    Debian 12's 11.525, Ubuntu 24.04's 12.535); a call the binding or the driver's library lacks reads
    C(unsupported) like a field the GPU lacks (7.352 cannot read the CUDA driver version, the compute
    capability, energy, MIG, remapped rows, NVLink or the fan count). CONTRIBUTING lists each field.
  - Returns C(ansible_facts.budgetgpu_gpus); never reports C(changed).
author:
  - budgetgpu maintainers (!UNKNOWN)
requirements:
  - nvidia-ml-py (C(pip install nvidia-ml-py), or Debian/Ubuntu C(apt-get install python3-pynvml)) on the managed node
options:
  proc_root:
    description:
      - Where procfs is mounted. Only read to tell why NVML failed (C(driver/nvidia/version)
        shows the loaded kernel module).
    type: path
    default: /proc
  modules_root:
    description:
      - Kernel module tree. Only read to tell a driver that is installed but not loaded
        (C(<modules_root>/<kernel release>/modules.dep) lists C(nvidia.ko)) from no driver.
    type: path
    default: /lib/modules
  on_missing_pynvml:
    description:
      - What to do when nvidia-ml-py is not installed on the node.
      - C(fail) fails with a message saying how to install it.
      - C(report) succeeds with RV(ansible_facts.budgetgpu_gpus.driver.state=no_pynvml), for a preflight
        that runs before anything is installed.
    type: str
    choices: [fail, report]
    default: fail
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
  - GPUs are listed in NVML order (PCI bus id order); RV(ansible_facts.budgetgpu_gpus.gpus[].bus_id) is in
    sysfs form (C(0000:3b:00.0)) so that it matches M(budgetgpu.cluster.pcie_facts).
  - On simulated nodes the role C(budgetgpu.cluster.gpu_sim) installs a C(pynvml) drop-in;
    this module has no simulation branch.
seealso:
  - module: budgetgpu.cluster.pcie_facts
  - module: budgetgpu.cluster.net_facts
"""

EXAMPLES = r"""
- name: Read the GPUs and the driver state
  budgetgpu.cluster.gpu_facts:

- name: Say what stops the GPUs from being used
  ansible.builtin.assert:
    that: ansible_facts['budgetgpu_gpus']['driver']['loaded']
    fail_msg: "{{ inventory_hostname }}: {{ ansible_facts['budgetgpu_gpus']['driver']['reason'] }}"

- name: Probe a fresh node before nvidia-ml-py is installed
  budgetgpu.cluster.gpu_facts:
    on_missing_pynvml: report
"""

RETURN = r"""
ansible_facts:
  description: Facts added to the host.
  returned: always
  type: dict
  contains:
    budgetgpu_gpus:
      description: Driver state and one entry per GPU.
      returned: always
      type: dict
      contains:
        driver:
          description: The NVIDIA driver as NVML sees it.
          returned: always
          type: dict
          contains:
            state:
              description:
                - C(loaded); C(no_driver) (no library, no kernel module); C(not_loaded) (installed, not loaded);
                  C(no_library) (kernel module loaded, libnvidia-ml missing); C(version_mismatch) (library and
                  kernel module from different releases); C(no_pynvml); C(error) (another NVML error).
              type: str
              returned: always
              sample: loaded
            loaded:
              description: Whether NVML initialised, that is the driver works.
              type: bool
              returned: always
              sample: true
            reason:
              description: Why the driver is not usable and what to do; null when loaded.
              type: str
              returned: always
              sample: >-
                the NVIDIA driver is installed for kernel 6.1.0-28-amd64 but not loaded:
                run `modprobe nvidia` or reboot
            version:
              description: Driver version; null when not loaded.
              type: str
              returned: always
              sample: "580.159.04"
            nvml_version:
              description: NVML library version; null when not loaded.
              type: str
              returned: always
              sample: "13.580.159.04"
            cuda_driver_version:
              description:
                - Highest CUDA version the driver supports; null when not loaded.
                - C(unsupported) where the binding has no C(nvmlSystemGetCudaDriverVersion) (7.352), and
                  C(python_env_torch_variant=auto) then refuses rather than install the CPU build.
              type: str
              returned: always
              sample: "13.0"
            kernel_module_version:
              description: Version in C(/proc/driver/nvidia/version); null when no nvidia module is loaded.
              type: str
              returned: always
              sample: "580.159.04"
            kernel_module_installed:
              description: Whether an nvidia kernel module exists for the running kernel (always true when loaded).
              type: bool
              returned: always
              sample: true
            errors:
              description: NVML errors of system-level calls, by field.
              type: dict
              returned: always
              sample: {}
            kernels:
              description:
                - The kernels installed on the node (a folder under O(modules_root) with the kernel package's
                  C(modules.builtin)), oldest first; the last is the one GRUB boots by default.
                - Read whatever the NVML state; a container has none of its own (it runs its host's kernel).
              type: list
              elements: dict
              returned: always
              contains:
                release:
                  description: The kernel release, as C(uname -r) prints it.
                  type: str
                  returned: always
                  sample: 6.1.0-27-amd64
                running:
                  description: Whether it is the running kernel.
                  type: bool
                  returned: always
                  sample: true
                nvidia_module:
                  description:
                    - Whether its C(modules.dep) lists an nvidia module (C(nvidia.ko), or Debian's
                      C(nvidia-current.ko)), that is whether C(modprobe nvidia) finds one when it runs.
                  type: bool
                  returned: always
                  sample: true
                headers:
                  description: Whether its headers are installed (its C(build/include)), which DKMS builds against.
                  type: bool
                  returned: always
                  sample: true
            dkms:
              description:
                - What C(dkms status) lists, one entry a line; null where DKMS is not installed (or C(dkms status)
                  failed). C(kernel) and C(arch) are null for a module only registered (C(added)).
              type: list
              elements: dict
              returned: always
              sample: [{module: nvidia-current, version: 535.261.03, kernel: 6.1.0-27-amd64, arch: x86_64,
                        status: installed}]
            binding:
              description:
                - The NVML binding that read these facts (the C(pynvml) module, the distribution that
                  installed it and its version); null without one (C(no_pynvml)).
                - Its version and distribution are null where no package metadata lies beside it.
              type: dict
              returned: always
              sample: {module: pynvml, distribution: nvidia-ml-py3, version: 7.352.0,
                       path: /usr/lib/python3/dist-packages/pynvml.py}
        count:
          description: Number of GPUs NVML reports (0 when the driver is not loaded).
          type: int
          returned: always
          sample: 1
        gpus:
          description: One entry per GPU, in NVML order.
          type: list
          elements: dict
          returned: always
          contains:
            index:
              description: NVML index.
              type: int
              returned: always
              sample: 0
            name:
              description: Product name.
              type: str
              returned: always
              sample: NVIDIA H200
            uuid:
              description: GPU UUID.
              type: str
              returned: always
              sample: GPU-0f7beba8-d2ad-9855-c2eb-a600187383a0
            serial:
              description: Board serial number, or C(unsupported) (GeForce cards).
              type: str
              returned: always
              sample: "1653824016794"
            bus_id:
              description: PCI bus id in sysfs form.
              type: str
              returned: always
              sample: "0000:00:06.0"
            memory_total_mib:
              description: Total memory in MiB.
              type: int
              returned: always
              sample: 143771
            compute_capability:
              description: CUDA compute capability.
              type: str
              returned: always
              sample: "9.0"
            vbios_version:
              description: VBIOS version.
              type: str
              returned: always
              sample: 96.00.A5.00.1A
            pcie:
              description: PCIe link as the GPU reports it.
              type: dict
              returned: always
              contains:
                gen_current:
                  description: Current link generation (drops at idle).
                  type: int
                  returned: always
                  sample: 5
                gen_max:
                  description: Highest generation possible with this GPU and system.
                  type: int
                  returned: always
                  sample: 5
                gen_gpu_max:
                  description: Highest generation the GPU supports.
                  type: int
                  returned: always
                  sample: 5
                width_current:
                  description: Current link width in lanes.
                  type: int
                  returned: always
                  sample: 16
                width_max:
                  description: Maximum link width in lanes.
                  type: int
                  returned: always
                  sample: 16
                replay_counter:
                  description: PCIe replay counter (grows on a bad link or riser).
                  type: int
                  returned: always
                  sample: 0
            temperature_c:
              description: GPU temperature in degrees Celsius.
              type: int
              returned: always
              sample: 35
            power_draw_w:
              description: Power draw in watts.
              type: float
              returned: always
              sample: 77.65
            power_limit_w:
              description: Enforced power limit in watts.
              type: float
              returned: always
              sample: 700.0
            power_limit_default_w:
              description: The card's default power limit in watts (the limit after a reboot), or C(unsupported).
              type: raw
              returned: always
              sample: 700.0
            power_limit_min_w:
              description: The lowest power limit NVML allows on this card, in watts, or C(unsupported).
              type: raw
              returned: always
              sample: 200.0
            power_limit_max_w:
              description: The highest power limit NVML allows on this card, in watts, or C(unsupported).
              type: raw
              returned: always
              sample: 700.0
            energy_total_j:
              description: >-
                Energy the GPU used since the driver loaded, in joules (NVML's total-energy counter), or
                C(unsupported) (cards older than Volta).
              type: raw
              returned: always
              sample: 6709132.8
            fan_speed_pct:
              description: Fan speed in percent, or C(unsupported) (passively cooled cards).
              type: raw
              returned: always
              sample: unsupported
            sm_clock_mhz:
              description: Current SM clock in MHz.
              type: int
              returned: always
              sample: 345
            sm_clock_max_mhz:
              description: Maximum SM clock in MHz.
              type: int
              returned: always
              sample: 1980
            throttle_reasons:
              description: Active clock event (throttle) reasons, decoded; unknown bits as hex.
              type: list
              elements: str
              returned: always
              sample: [gpu_idle]
            ecc_mode:
              description: ECC mode C({current, pending}) (C(enabled)/C(disabled)), or C(unsupported).
              type: raw
              returned: always
              sample: {current: enabled, pending: enabled}
            persistence_mode:
              description: C(enabled) or C(disabled).
              type: str
              returned: always
              sample: enabled
            mig_mode:
              description: MIG mode C({current, pending}), or C(unsupported).
              type: raw
              returned: always
              sample: {current: disabled, pending: disabled}
            nvlinks_active:
              description: Number of active NVLinks, or C(unsupported) when the GPU has none.
              type: raw
              returned: always
              sample: unsupported
            numa_node:
              description: NUMA node NVML reports, or C(unsupported).
              type: raw
              returned: always
              sample: unsupported
            retired_pages:
              description: Retired memory pages C({single_bit_ecc, double_bit_ecc, pending}), or C(unsupported).
              type: raw
              returned: always
              sample: unsupported
            remapped_rows:
              description: Remapped memory rows C({correctable, uncorrectable, pending, failure}), or C(unsupported).
              type: raw
              returned: always
              sample: {correctable: 0, uncorrectable: 0, pending: false, failure: false}
            errors:
              description: NVML errors other than "not supported", by field.
              type: dict
              returned: always
              sample: {power_draw_w: Insufficient Permissions}
"""

import traceback

from ansible.module_utils.basic import AnsibleModule, missing_required_lib
from ansible_collections.budgetgpu.cluster.plugins.module_utils.nvml_probe import (
    driver_facts,
    installed_kernels,
    parse_dkms_status,
    probe_nvml,
)

try:
    import pynvml
except ImportError:
    pynvml = None
    PYNVML_IMPORT_ERROR = traceback.format_exc()
else:
    PYNVML_IMPORT_ERROR = None

PYNVML_HINT = (
    "nvidia-ml-py (the pynvml module) is not installed for {python}: install it with "
    "`apt-get install python3-pynvml` or `{python} -m pip install nvidia-ml-py`"
)


def build_module() -> AnsibleModule:
    return AnsibleModule(
        argument_spec={
            "proc_root": {"type": "path", "default": "/proc"},
            "modules_root": {"type": "path", "default": "/lib/modules"},
            "on_missing_pynvml": {"type": "str", "choices": ["fail", "report"], "default": "fail"},
        },
        supports_check_mode=True,
    )


C_LOCALE = {"LANG": "C", "LC_ALL": "C", "LC_MESSAGES": "C"}


def kernel_facts(module: AnsibleModule) -> dict:
    """The installed kernels and what DKMS has registered: read whatever NVML says, so that a check can tell
    which kernel the next boot has no driver for."""
    registered = None
    dkms = module.get_bin_path("dkms")
    if dkms:
        rc, out, _err = module.run_command([dkms, "status"], environ_update=C_LOCALE)
        registered = parse_dkms_status(out) if rc == 0 else None
    return {"kernels": installed_kernels(module.params["modules_root"]), "dkms": registered}


def missing_pynvml_facts(reason: str) -> dict:
    return {"driver": driver_facts("no_pynvml", reason, binding=None), "count": 0, "gpus": []}


def main() -> None:
    module = build_module()
    params = module.params
    if pynvml is None:
        import sys

        hint = PYNVML_HINT.format(python=sys.executable)
        if params["on_missing_pynvml"] == "fail":
            module.fail_json(msg=missing_required_lib("nvidia-ml-py") + " " + hint, exception=PYNVML_IMPORT_ERROR)
        facts = missing_pynvml_facts(hint)
        facts["driver"].update(kernel_facts(module))
        module.exit_json(changed=False, ansible_facts={"budgetgpu_gpus": facts})
    facts = probe_nvml(pynvml, proc_root=params["proc_root"], modules_root=params["modules_root"])
    facts["driver"].update(kernel_facts(module))
    module.exit_json(changed=False, ansible_facts={"budgetgpu_gpus": facts})


if __name__ == "__main__":
    main()
