"""Role preflight's input check (budgetgpu.cluster.check_inputs) through ansible-playbook on fake
local hosts: every bad input of a table refused naming host and variable, in one run, with nothing
written on any host, the good one included; the shipped inventories pass."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import yaml
from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import AFTER_PREFLIGHT, REPO, output_of, run_playbook

PLAYBOOK = (
    """
- name: Preflight
  hosts: gpu_nodes
  gather_facts: false
  roles:
    - budgetgpu.cluster.preflight

"""
    + AFTER_PREFLIGHT
)
CHECK_ONLY = """
- name: Check the inputs only
  hosts: gpu_nodes
  gather_facts: false
  tasks:
    - name: Set the probe's network facts where the inventory fakes them
      ansible.builtin.set_fact:
        budgetgpu_net: "{{ fake_net }}"
        cacheable: true
      when: fake_net is defined
    - name: Check
      ansible.builtin.import_role:
        name: budgetgpu.cluster.preflight
        tasks_from: inputs.yml
"""
# host -> (its variables, what the refusal names)
BAD = {
    "n1": ({"nvidia_driver_branch": "latest"}, "n1: nvidia_driver_branch: expected int"),
    "n2": ({"nvidia_driver_secure_boot": "maybe"}, "n2: nvidia_driver_secure_boot: expected str"),
    "n3": ({"nccl_network_busbw_floor_gbps": -1}, "n3: nccl_network_busbw_floor_gbps: expected auto or a number"),
    "n4": ({"nccl_network_busbw_floor_gbps": "fast"}, "n4: nccl_network_busbw_floor_gbps: expected auto or a number"),
    "n5": ({"nvidia_driver_reboots": True}, "n5: nvidia_driver_reboots: no role knows this variable: did you mean"),
    "n6": ({"torchrun_jobs": {"name": "a"}}, "n6: torchrun_jobs: expected a YAML list of mappings, found a mapping"),
    "n7": ({"torchrun_jobs": "train"}, "n7: torchrun_jobs: expected a YAML list of mappings, found a string"),
    "n8": (
        {"python_env_wheelhouse": "/nonexistent/wh"},
        "n8: python_env_wheelhouse '/nonexistent/wh' is not a directory on the control node",
    ),
    # A templated value is checked as the role would see it.
    "n9": ({"budgetgpu_user": "7", "cuda_nccl_dev": "{{ budgetgpu_user }}"}, "n9: cuda_nccl_dev: expected bool, found"),
}


def write_inventory(tmp_path: Path, hosts: dict, extra: dict | None = None) -> Path:
    marker_dir = tmp_path / "written"
    marker_dir.mkdir(exist_ok=True)
    inventory = {
        "all": {
            "vars": {
                "ansible_connection": "local",
                "ansible_python_interpreter": sys.executable,
                "marker_dir": str(marker_dir),
                **(extra or {}),
            },
            "children": {"gpu_nodes": {"hosts": hosts}},
        }
    }
    path = tmp_path / "hosts.yml"
    path.write_text(yaml.safe_dump(inventory))
    return path


def test_every_bad_input_is_refused_and_no_host_goes_on(tmp_path):
    hosts = {"n0": {}, **{host: variables for host, (variables, _unused) in BAD.items()}}
    started = time.monotonic()
    result = run_playbook(tmp_path, PLAYBOOK, {}, inventory=write_inventory(tmp_path, hosts))
    elapsed = time.monotonic() - started
    out = output_of(result)
    assert result.returncode != 0, out
    for _unused, expected in BAD.values():
        assert expected in out
    assert "did you mean nvidia_driver_reboot?" in out
    assert "n9: cuda_nccl_dev: expected bool, found '7'" in out
    # any_errors_fatal: the good host stops too, and no later play runs anywhere.
    assert list((tmp_path / "written").iterdir()) == []
    assert "Write a file" not in out
    assert elapsed < 60


def test_a_subnet_no_interface_holds_is_refused(tmp_path):
    net = {
        "cluster_subnet": "10.9.0.0/24",
        "cluster_interface": None,
        "interfaces": [{"name": "eth0", "addresses": [{"address": "172.17.0.2", "prefixlen": 16}]}],
    }
    inventory = write_inventory(tmp_path, {"n1": {"fake_net": net}, "n2": {}})
    result = run_playbook(tmp_path, CHECK_ONLY, {}, inventory=inventory)
    out = output_of(result)
    assert result.returncode != 0, out
    assert "n1: budgetgpu_cluster_subnet: expected an interface of the node with an address in 10.9.0.0/24" in out
    assert "eth0 172.17.0.2/16" in out


def test_the_example_inventory_passes(tmp_path):
    # No connection: the check runs on the control node only (the example's addresses do not exist).
    result = run_playbook(tmp_path, CHECK_ONLY, {}, inventory=REPO / "inventory" / "example")
    out = output_of(result)
    assert result.returncode == 0, out
    assert "ok=1" in out and "failed=0" in out


def test_the_demo_inventory_passes(tmp_path):
    # As scripts/demo-cluster writes it, beside the demo's group_vars; the wheelhouse is where
    # the demo's python_env_wheelhouse points (inventory_dir/../../.cache/wheelhouse).
    demo = tmp_path / "inventory" / "demo"
    shutil.copytree(REPO / "inventory" / "demo" / "group_vars", demo / "group_vars")
    (tmp_path / ".cache" / "wheelhouse").mkdir(parents=True)
    hosts = {name: {"gpu_sim_profile": "rtx3090x4-risers"} for name in ("node1", "node2")}
    inventory = {
        "all": {
            "vars": {"ansible_connection": "local", "budgetgpu_cluster_subnet": "172.30.0.0/24"},
            "children": {"gpu_nodes": {"hosts": hosts}},
        }
    }
    (demo / "hosts.yml").write_text(yaml.safe_dump(inventory))
    result = run_playbook(tmp_path, CHECK_ONLY, {}, inventory=demo)
    out = output_of(result)
    assert result.returncode == 0, out
    assert out.count("failed=0") == 2


def test_an_inventory_that_does_not_parse_names_file_and_line(tmp_path):
    path = tmp_path / "hosts.yml"
    path.write_text("all:\n  children:\n    gpu_nodes:\n      hosts:\n        n1: {a: 1\n")
    result = run_playbook(tmp_path, CHECK_ONLY, {}, inventory=path)
    out = output_of(result)
    assert result.returncode != 0, out
    assert f"{path}:6" in out
    assert "Completely failed to parse inventory source" in out


def test_the_demo_inventory_without_nodes_still_parses(tmp_path):
    # ansible.cfg makes an unparsed inventory fatal; the demo's directory before `make demo`
    # (no hosts.yml) must still parse, so that site.yml says what to do.
    demo = tmp_path / "demo"
    shutil.copytree(REPO / "inventory" / "demo", demo, ignore=shutil.ignore_patterns("hosts.yml", ".ssh"))
    site = (REPO / "playbooks" / "site.yml").read_text().split("- name: Preflight\n")[0]
    result = run_playbook(tmp_path, site, {}, inventory=demo)
    out = output_of(result)
    assert result.returncode != 0
    assert "has no hosts in group gpu_nodes. For the local demo run `make demo`" in out


def test_playbooks_preflight_stops_every_host_before_a_later_play(tmp_path):
    """The real playbooks/preflight.yml (the probe on this machine, read-only), then a play in the
    place of provision.yml: one host's bad input stops both hosts before the later play."""
    play = f"""
- name: Preflight
  ansible.builtin.import_playbook: {REPO}/playbooks/preflight.yml
- name: In the place of provision.yml
  hosts: gpu_nodes
  gather_facts: false
  tasks:
    - name: Write a file
      ansible.builtin.copy:
        content: written
        dest: "{{{{ marker_dir }}}}/{{{{ inventory_hostname }}}}"
        mode: "0644"
"""
    hosts = {"good": {}, "bad": {"nvidia_driver_reboots": True}}
    inventory = write_inventory(tmp_path, hosts, {"ansible_become": False, "probe_on_missing_pynvml": "report"})
    result = run_playbook(tmp_path, play, {}, inventory=inventory)
    out = output_of(result)
    assert result.returncode != 0, out
    assert "bad: nvidia_driver_reboots: no role knows this variable: did you mean nvidia_driver_reboot?" in out
    assert "Probe the network interfaces" in out
    assert list((tmp_path / "written").iterdir()) == []
    assert "In the place of provision.yml" not in out


def test_a_yaml_error_in_group_vars_names_file_and_line(tmp_path):
    # ansible-core's host_group_vars drops the file from the message; plugins/vars/group_vars.py
    # (enabled in ansible.cfg in its place) keeps it.
    inventory = tmp_path / "inventory"
    (inventory / "group_vars").mkdir(parents=True)
    (inventory / "hosts.yml").write_text("all:\n  children:\n    gpu_nodes:\n      hosts:\n        n1: {}\n")
    (inventory / "group_vars" / "all.yml").write_text("---\nnvidia_driver_branch: 550\ntorchrun_jobs: [{name: a}\n")
    result = run_playbook(tmp_path, CHECK_ONLY, {}, inventory=inventory)
    out = output_of(result)
    assert result.returncode != 0, out
    assert "YAML parsing failed" in out
    assert f"Origin: {inventory}/group_vars/all.yml:4:1" in out
