#!/usr/bin/python
# Copyright: budgetgpu maintainers
# Apache License 2.0 (see galaxy.yml)
# ruff: noqa: E402 (Ansible modules import after DOCUMENTATION, EXAMPLES and RETURN)
"""Ansible module: network interfaces, InfiniBand/RoCE devices and the cluster interface."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: net_facts
short_description: Network interfaces, InfiniBand/RoCE devices and the cluster interface
version_added: "0.1.0"
description:
  - >-
    Lists the node's network interfaces with kind, speed, MTU, carrier, driver and addresses,
    the InfiniBand and RoCE devices under C(/sys/class/infiniband) with their port states, and
    the cluster interface, the one interface and address of this node that NCCL, gloo, the
    rendezvous endpoint, C(--local-addr), the firewall and the reachability check all use.
  - The cluster interface is the interface holding an address in O(cluster_subnet) (any address
    without a subnet) whose link is not down, limited to those O(interface_rule) selects; among
    several, a better kind (physical, bond, vlan, infiniband, virtual, veth, bridge) and then the
    faster link win. Docker bridges carry it only when the rule names them, loopback only when
    the subnet is a loopback network.
  - Addresses come from C(ip -j addr) run in the C locale; without iproute2, from the kernel
    directly (each interface's primary IPv4 address and its IPv6 addresses).
  - Reads the kernel's ephemeral port range too (C(net.ipv4.ip_local_port_range)).
  - Returns C(ansible_facts.budgetgpu_net); never reports C(changed).
author:
  - budgetgpu maintainers (!UNKNOWN)
options:
  sysfs_root:
    description: Where sysfs is mounted.
    type: path
    default: /sys
  cluster_subnet:
    description:
      - The cluster network in CIDR form (C(10.10.0.0/24)). When set,
        RV(ansible_facts.budgetgpu_net.cluster_interface) names the interface holding an address in it.
    type: str
  interface_rule:
    description:
      - Which interfaces may carry the cluster address, in C(NCCL_SOCKET_IFNAME) forms
        (the inventory's C(budgetgpu_cluster_interface)).
      - C(eth) selects names starting with it, C(=eth1) exactly that name, C(^docker,lo)
        every name not starting with those, C(^=eth0) every name but exactly that one.
      - An address in O(cluster_subnet) still wins among the selected interfaces.
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
seealso:
  - module: budgetgpu.cluster.gpu_facts
"""

EXAMPLES = r"""
- name: Find the interface that carries the cluster network
  budgetgpu.cluster.net_facts:
    cluster_subnet: "{{ budgetgpu_cluster_subnet }}"

- name: Pin the cluster address to the second port
  budgetgpu.cluster.net_facts:
    cluster_subnet: 10.10.0.0/24
    interface_rule: "=eth1"

- name: Refuse a node without a cluster interface
  ansible.builtin.assert:
    that: ansible_facts['budgetgpu_net']['cluster_interface'] is not none
    fail_msg: "{{ inventory_hostname }}: {{ ansible_facts['budgetgpu_net']['cluster_interface_error'] }}"
"""

RETURN = r"""
ansible_facts:
  description: Facts added to the host.
  returned: always
  type: dict
  contains:
    budgetgpu_net:
      description: Interfaces, InfiniBand devices and the cluster interface.
      returned: always
      type: dict
      contains:
        interfaces:
          description: One entry per interface, by name.
          type: list
          elements: dict
          returned: always
          contains:
            name:
              description: Interface name.
              type: str
              returned: always
              sample: eth0
            kind:
              description: >-
                C(physical), C(loopback), C(bridge), C(docker), C(veth), C(vlan), C(bond), C(infiniband)
                or C(virtual).
              type: str
              returned: always
              sample: physical
            speed_mbps:
              description: Link speed in Mb/s; null when unknown (virtio and veth report -1, a down link nothing).
              type: int
              returned: always
              sample: 25000
            mtu:
              description: MTU in bytes.
              type: int
              returned: always
              sample: 1500
            operstate:
              description: Kernel operational state.
              type: str
              returned: always
              sample: up
            carrier:
              description: Whether the link has carrier; null when the interface is down.
              type: bool
              returned: always
              sample: true
            mac:
              description: Hardware address.
              type: str
              returned: always
              sample: "52:54:00:12:34:56"
            driver:
              description: Kernel driver of the device; null for virtual interfaces.
              type: str
              returned: always
              sample: virtio_net
            pci_bus_id:
              description: PCI bus id of the NIC; null when not on PCI.
              type: str
              returned: always
              sample: "0000:00:03.0"
            numa_node:
              description: NUMA node of the NIC; null when unknown.
              type: int
              returned: always
              sample: 0
            addresses:
              description: IP addresses.
              type: list
              elements: dict
              returned: always
              sample: [{family: ipv4, address: 10.10.0.12, prefixlen: 24}]
              contains:
                family:
                  description: C(ipv4) or C(ipv6).
                  type: str
                  returned: always
                  sample: ipv4
                address:
                  description: The address.
                  type: str
                  returned: always
                  sample: 10.10.0.12
                prefixlen:
                  description: Prefix length.
                  type: int
                  returned: always
                  sample: 24
        infiniband:
          description: InfiniBand and RoCE devices.
          type: list
          elements: dict
          returned: always
          contains:
            name:
              description: Device name.
              type: str
              returned: always
              sample: mlx5_0
            netdevs:
              description: Network interfaces of the device.
              type: list
              elements: str
              returned: always
              sample: [ib0]
            ports:
              description: Ports of the device.
              type: list
              elements: dict
              returned: always
              contains:
                port:
                  description: Port number.
                  type: int
                  returned: always
                  sample: 1
                state:
                  description: Logical state.
                  type: str
                  returned: always
                  sample: ACTIVE
                phys_state:
                  description: Physical state.
                  type: str
                  returned: always
                  sample: LinkUp
                rate:
                  description: Rate as the kernel writes it.
                  type: str
                  returned: always
                  sample: 200 Gb/sec (4X HDR)
                link_layer:
                  description: C(InfiniBand) or C(Ethernet).
                  type: str
                  returned: always
                  sample: InfiniBand
                kind:
                  description: C(infiniband) or C(roce).
                  type: str
                  returned: always
                  sample: infiniband
        ephemeral_ports:
          description: >-
            The kernel's ephemeral port range [low, high] (net.ipv4.ip_local_port_range), where it hands out ports;
            preflight refuses a job's store port inside it. Null when it cannot be read.
          type: list
          elements: int
          returned: always
          sample: [32768, 60999]
        cluster_subnet:
          description: The subnet that was asked for; null when none.
          type: str
          returned: always
          sample: 10.10.0.0/24
        interface_rule:
          description: The interface rule that was asked for; null when none.
          type: str
          returned: always
          sample: "=eth1"
        cluster_interface_error:
          description: Why no interface may carry the cluster address, and what to fix; null when one does.
          type: str
          returned: always
          sample: >-
            no usable interface has an address in the cluster subnet 10.10.0.0/24 (found: eth0 192.168.1.5):
            fix budgetgpu_cluster_subnet or set budgetgpu_cluster_interface
        cluster_interface:
          description: >-
            The interface and address that carry this node's cluster traffic (NCCL, gloo, rendezvous,
            firewall, reachability check); null when none may
            (see RV(ansible_facts.budgetgpu_net.cluster_interface_error)).
          type: dict
          returned: always
          contains:
            name:
              description: Interface name.
              type: str
              returned: always
              sample: eth0
            address:
              description: This node's cluster address.
              type: str
              returned: always
              sample: 10.10.0.12
            prefixlen:
              description: Prefix length of that address.
              type: int
              returned: always
              sample: 24
            kind:
              description: Kind of the interface (see RV(ansible_facts.budgetgpu_net.interfaces[].kind)).
              type: str
              returned: always
              sample: physical
            speed_mbps:
              description: Link speed in Mb/s; null when unknown.
              type: int
              returned: always
              sample: 10000
            reason:
              description: Why this interface, and which others it was preferred over.
              type: str
              returned: always
              sample: >-
                holds the cluster address 10.10.0.12 in 10.10.0.0/24, carrier up, 10000 Mb/s;
                passed over eth1 (physical, 1000 Mb/s)
            warnings:
              description: What may still be wrong (an address outside the subnet, a faster NIC left idle).
              type: list
              elements: str
              returned: always
              sample: []
"""

import ipaddress
import os

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.budgetgpu.cluster.plugins.module_utils.netinfo import (
    ephemeral_ports,
    parse_ip_addr_json,
    probe_net,
    read_addresses_fallback,
)

C_LOCALE = {"LANG": "C", "LC_ALL": "C", "LC_MESSAGES": "C"}


def build_module() -> AnsibleModule:
    return AnsibleModule(
        argument_spec={
            "sysfs_root": {"type": "path", "default": "/sys"},
            "cluster_subnet": {"type": "str"},
            "interface_rule": {"type": "str"},
        },
        supports_check_mode=True,
    )


def read_addresses(module: AnsibleModule) -> dict:
    ip = module.get_bin_path("ip")
    if ip:
        rc, out, _err = module.run_command([ip, "-j", "addr", "show"], environ_update=C_LOCALE)
        if rc == 0 and out.strip():
            return parse_ip_addr_json(out)
    names = sorted(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else []
    return read_addresses_fallback(names)


def main() -> None:
    module = build_module()
    subnet = module.params["cluster_subnet"]
    if subnet:
        try:
            ipaddress.ip_network(subnet, strict=False)
        except ValueError as exc:
            module.fail_json(msg=f"cluster_subnet '{subnet}' is not a network in CIDR form like 10.10.0.0/24: {exc}")
    facts = probe_net(module.params["sysfs_root"], read_addresses(module), subnet, module.params["interface_rule"])
    facts["ephemeral_ports"] = ephemeral_ports()
    module.exit_json(changed=False, ansible_facts={"budgetgpu_net": facts})


if __name__ == "__main__":
    main()
