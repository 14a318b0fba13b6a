"""The firewall guards the ports each job really listens on, its rendezvous port and its workers' store port: the
units and the firewall read one job list, budgetgpu_jobs, with torchrun_job_defaults applied (a job default of 29600
once left the c10d store open while the table guarded 29500)."""

from __future__ import annotations

import json
from pathlib import Path

from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import REPO, run_playbook

PLAYBOOK = """\
- name: Read the ports the firewall protects
  hosts: all
  gather_facts: false
  tasks:
    - name: Work out the run's jobs as role probe does
      ansible.builtin.include_role:
        name: budgetgpu.cluster.torchrun
        tasks_from: jobs
    - name: Load nccl_network's defaults and vars
      ansible.builtin.include_vars:
        file: "{{ test_repo }}/roles/nccl_network/{{ item }}/main.yml"
      loop: [defaults, vars]
    - name: Show them
      ansible.builtin.debug:
        msg: "PORTS={{ _nccl_network_plan['firewall_ports'] | map(attribute='port') | list | to_json }}"
"""


def ports(tmp_path: Path, **variables) -> list[list[int]]:
    """The ports of each entry of the training table on the host: its jobs' each, then the others."""
    result = run_playbook(tmp_path, PLAYBOOK, {"test_repo": str(REPO), **variables})
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(line for line in result.stdout.splitlines() if "PORTS=" in line)
    found = json.loads(line.split("PORTS=", 1)[1].rstrip('"').replace('\\"', '"'))
    return [[int(port) for port in entry] for entry in found]


def test_a_job_default_port_is_the_port_the_firewall_guards(tmp_path: Path) -> None:
    jobs = [{"name": "a", "script": "/x.py"}, {"name": "b", "script": "/y.py", "port": "29700", "store_port": "31000"}]
    found = ports(tmp_path, torchrun_jobs=jobs, torchrun_job_defaults={"port": 29600, "nodes": "all"})
    # The workers' stores too: a's at its port + 1000, b's where it says; then the test ports and torch's default.
    assert found == [[29600, 30600], [29700, 31000], [5201, 29499, 29500, 29510]]


def test_without_jobs_torchs_default_port_is_guarded(tmp_path: Path) -> None:
    assert ports(tmp_path) == [[5201, 29499, 29500, 29510]]
