"""The cluster harness: systemd up in every node, nodes reach each other privately."""

from __future__ import annotations

import os

import testinfra.utils.ansible_runner

testinfra_hosts = testinfra.utils.ansible_runner.AnsibleRunner(os.environ["MOLECULE_INVENTORY_FILE"]).get_hosts(
    "gpu_nodes"
)

NODES = ("cluster-node1", "cluster-node2")


def test_systemd_is_pid_1_and_booted(host):
    assert host.check_output("ps -o comm= -p 1") == "systemd"
    state = host.run("systemctl is-system-running").stdout.strip()
    assert state in ("running", "degraded"), state


def test_nodes_reach_each_other_on_the_private_network(host):
    me = host.check_output("hostname")
    assert host.check_output(f"getent hosts {me}").split()[0] == "127.0.1.1"  # a stock /etc/hosts
    assert "10.231.1." in host.check_output("ip -4 -o addr show scope global")  # molecule.yml's subnet
    for node in NODES:
        if node == me:
            continue
        addr = host.check_output(f"getent hosts {node}").split()[0]
        assert addr.startswith("10.231.1."), addr
        # sshd listens on every node: a TCP connect proves the private route both ways.
        assert host.run(f"timeout 5 bash -c 'echo > /dev/tcp/{node}/22'").rc == 0, node
