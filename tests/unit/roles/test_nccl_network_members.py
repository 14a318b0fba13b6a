"""nccl_network's preflight on a cluster with a member that has no facts in the run, through
ansible-playbook on fake nodes (local connection, no Docker): a member that is down and whose
cached facts expired, or one that ansible-pull's --limit leaves out.

In safe mode (the nightly run) the healthy node goes on and keeps the absent member in its firewall
with the addresses that an earlier run wrote into the firewall file; outside safe mode, and in safe
mode when no address of the member is known anywhere, the run is refused, naming host and fix.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from ansible_collections.budgetgpu.cluster.plugins.module_utils.netinfo import choose_cluster_interface
from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import output_of, run_playbook

SUBNET = "10.9.0.0/24"
PLAYBOOK = """
- name: Stand in for the probe; node2 is down
  hosts: gpu_nodes
  gather_facts: false
  tasks:
    - name: Fail the node that is down
      ansible.builtin.fail:
        msg: down
      when: inventory_hostname == 'node2'

    - name: Set the network facts of the nodes that are up
      ansible.builtin.set_fact:
        budgetgpu_net: "{{ fake_net }}"
        cacheable: true

- name: Network preflight
  hosts: gpu_nodes
  gather_facts: false
  tasks:
    - name: Run the role's preflight
      ansible.builtin.import_role:
        name: budgetgpu.cluster.nccl_network
        tasks_from: preflight.yml

    - name: Write what the firewall would admit
      ansible.builtin.copy:
        content: >-
          {{ {'records': _nccl_network_plan['member_records'], 'addresses': _nccl_network_plan['member_addresses']}
             | to_json }}
        dest: "{{ result_file }}"
        mode: "0644"
"""
FIREWALL = (
    "#!/usr/sbin/nft -f\n# member node1: 10.9.0.2\n# member node2: 10.9.0.3, fd00::3\ntable inet budgetgpu {\n}\n"
)


def fake_net(address: str) -> dict:
    interfaces = [
        {
            "name": "eth0",
            "kind": "physical",
            "speed_mbps": 10000,
            "carrier": True,
            "operstate": "up",
            "addresses": [{"family": "ipv4", "address": address, "prefixlen": 24}],
        }
    ]
    # What net_facts reports: the cluster interface is decided there, once.
    chosen = choose_cluster_interface(interfaces, SUBNET)
    return {
        "interfaces": interfaces,
        "infiniband": [],
        "cluster_subnet": SUBNET,
        "cluster_interface": chosen["interface"],
        "cluster_interface_error": chosen["error"],
    }


def run(tmp_path: Path, *, safe_mode: bool, firewall: str | None, limit: str | None = None):
    inventory = tmp_path / "hosts.yml"
    node = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    inventory.write_text(
        json.dumps(
            {
                "gpu_nodes": {
                    "hosts": {
                        "node1": {**node, "fake_net": fake_net("10.9.0.2")},
                        "node2": {**node, "fake_net": fake_net("10.9.0.3")},
                    }
                }
            }
        )
    )
    firewall_file = tmp_path / "budgetgpu.nft"
    if firewall is not None:
        firewall_file.write_text(firewall)
    result_file = tmp_path / "result.json"
    variables = {
        "budgetgpu_cluster_subnet": SUBNET,
        "nccl_network_firewall_file": str(firewall_file),
        "result_file": str(result_file),
    }
    if safe_mode:
        variables["budgetgpu_safe_mode"] = True
    options = ("--limit", limit) if limit else ()
    done = run_playbook(tmp_path, PLAYBOOK, variables, inventory=inventory, options=options)
    output = output_of(done)
    result = json.loads(result_file.read_text()) if result_file.exists() else None
    return done.returncode, output, result


@pytest.mark.parametrize(
    ("limit", "why"),
    [(None, "down or failed earlier in this run"), ("node1", "not in this run (--limit)")],
    ids=["down-and-cache-expired", "ansible-pull-limit"],
)
def test_safe_mode_keeps_the_absent_member_with_its_recorded_addresses(tmp_path: Path, limit, why) -> None:
    rc, output, result = run(tmp_path, safe_mode=True, firewall=FIREWALL, limit=limit)
    assert rc == (2 if limit is None else 0), output  # node2's own failure, not node1's
    assert "node1 : ok=" in output and "failed=0" in output.split("node1 : ok=")[1][:120], output
    assert result["records"]["node2"] == {"ipv4": ["10.9.0.3"], "ipv6": ["fd00::3"], "source": "record"}
    assert result["records"]["node1"]["source"] == "facts"
    assert result["addresses"] == {"ipv4": ["10.9.0.2", "10.9.0.3"], "ipv6": ["fd00::3"]}
    assert f"node2: {why}, no facts: the firewall keeps admitting it from 10.9.0.3, fd00::3" in output


def test_outside_safe_mode_the_absent_member_is_refused_naming_host_and_fix(tmp_path: Path) -> None:
    rc, output, result = run(tmp_path, safe_mode=False, firewall=FIREWALL)
    assert rc == 2 and result is None, output
    assert (
        "node1: expected budgetgpu_net facts of every member of gpu_nodes (from this run, or the fact cache for"
        " fact_caching_timeout seconds), found none for node2 (down or failed earlier in this run)"
    ) in output
    assert "drop --limit" in output and "budgetgpu_safe_mode: true" in output


def test_safe_mode_refuses_a_member_whose_address_is_known_nowhere(tmp_path: Path) -> None:
    rc, output, result = run(tmp_path, safe_mode=True, firewall="# member node1: 10.9.0.2\n")
    assert rc == 2 and result is None, output
    assert "node1: no address known for node2: no budgetgpu_net facts in this run" in output
    assert f'no "# member" line for them in {tmp_path / "budgetgpu.nft"} (it names node1)' in output
    assert "run playbooks/network.yml on the whole group gpu_nodes while they are up" in output
