"""Role preflight through ansible-playbook, without Docker: fake nodes on a local connection whose
probe facts are set from the inventory. A bad inventory fails with every problem named (host,
field, found, expected) and nothing is written on the "nodes" (this machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import AFTER_PREFLIGHT, NO_NODE_VENV_INSTALL

REPO = Path(__file__).resolve().parents[3]
PLAYBOOK = (
    """
- name: Stand in for the probe with the inventory's facts
  hosts: gpu_nodes
  gather_facts: false
  tasks:
    - name: Set the probe facts
      ansible.builtin.set_fact:
        budgetgpu_gpus: "{{ fake_gpus }}"
        budgetgpu_pcie: "{{ fake_pcie }}"
        cacheable: true

    - name: Work out the run's jobs as the probe does
      ansible.builtin.include_role:
        name: budgetgpu.cluster.torchrun
        tasks_from: jobs

- name: Preflight
  hosts: gpu_nodes
  gather_facts: false
  roles:
    - budgetgpu.cluster.preflight

"""
    + AFTER_PREFLIGHT
)
RTX = "NVIDIA GeForce RTX 3090"


def fake_node(gpus: int = 2, model: str = RTX) -> dict:
    return {
        "fake_gpus": {
            "driver": {"state": "loaded", "version": "550.54.14"},
            "count": gpus,
            "gpus": [{"index": i, "name": model} for i in range(gpus)],
        },
        "fake_pcie": {
            "count": gpus,
            "gpus": [
                {
                    "bus_id": f"0000:0{i + 1}:00.0",
                    "name": model,
                    "effective": {"gen": 3, "width": 16},
                    "capable": {"gen": 3, "width": 16},
                }
                for i in range(gpus)
            ],
        },
    }


def playbook(tmp_path: Path, jobs: list[dict], nodes: dict[str, dict], **group_vars) -> subprocess.CompletedProcess:
    marker_dir = tmp_path / "written"
    marker_dir.mkdir()
    inventory = {
        "all": {
            "vars": {
                "ansible_connection": "local",
                "ansible_python_interpreter": sys.executable,
                "torchrun_jobs": jobs,
                "marker_dir": str(marker_dir),
                **NO_NODE_VENV_INSTALL,
                **group_vars,
            },
            "children": {"gpu_nodes": {"hosts": nodes}},
        }
    }
    (tmp_path / "hosts.json").write_text(json.dumps(inventory))
    (tmp_path / "play.yml").write_text(PLAYBOOK)
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
        ANSIBLE_CACHE_PLUGIN_CONNECTION=str(tmp_path / "facts"),
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_FORCE_COLOR="0",
    )
    ansible_playbook = Path(sys.executable).parent / "ansible-playbook"
    return subprocess.run(
        [str(ansible_playbook), "-i", str(tmp_path / "hosts.json"), str(tmp_path / "play.yml")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('train')\n")
    return str(path)


def test_a_good_cluster_passes_and_reports_each_node(tmp_path, script):
    jobs = [{"name": "demo", "script": script, "nproc_per_node": 2, "user": "nobody"}]
    proc = playbook(tmp_path, jobs, {"fake1": fake_node(), "fake2": fake_node()})
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "budgetgpu preflight: 2 nodes, 1 jobs: 0 problems" in proc.stdout
    assert "node fake1: 2 GPUs (2x NVIDIA GeForce RTX 3090), driver 550.54.14" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "written").iterdir()) == ["fake1", "fake2"]


def test_a_bad_inventory_fails_in_preflight_naming_each_problem_and_writes_nothing(tmp_path, script):
    jobs = [
        {"name": "my job", "script": script, "nproc_per_node": 1},
        {"name": "ranks", "script": script, "nproc_per_node": 1, "rendezvous": "static", "port": 29501,
         "node_ranks": {"fake1": 0, "fake2": 0}},
        {"name": "master", "script": script, "nproc_per_node": 1, "master": "elsewhere", "port": 29502},
        {"name": "zero", "script": script, "nproc_per_node": 0, "port": 29503},
        {"name": "many", "script": script, "nproc_per_node": 3, "port": 29504},
        {"name": "etcd", "script": script, "nproc_per_node": 1, "rendezvous": "etcd", "port": 29505},
        {"name": "clash", "script": script, "nproc_per_node": 1, "port": 29505},
        {"name": "missing", "script": "/nonexistent/train.py", "nproc_per_node": 1, "port": 29506},
    ]  # fmt: skip
    proc = playbook(tmp_path, jobs, {"fake1": fake_node(), "fake2": fake_node(gpus=4)})
    out = proc.stdout
    assert proc.returncode != 0
    assert "preflight failed: nothing was changed on any node" in out
    for line in (
        "FAIL fake1,fake2: job my job name: found 'my job', expected letters, digits",
        "FAIL fake1: job ranks node_rank: found 0, expected a rank no other node of the job has: fake2 has rank 0 too",
        "FAIL fake2: job ranks node_rank: found 0, expected a rank no other node of the job has: fake1 has rank 0 too",
        "FAIL fake1,fake2: job master master: found 'elsewhere', expected a host of group gpu_nodes: fake1, fake2",
        'FAIL fake1,fake2: job zero nproc_per_node: found 0, expected "gpu"',
        "FAIL fake1: job many nproc_per_node: found 3, expected 1 to 2 (GPUs on fake1)",
        "FAIL fake1,fake2: job etcd rendezvous: found 'etcd', expected one of c10d, static",
        "FAIL fake1,fake2: job clash port: found 29505, expected a port other than 29505, which job etcd uses",
        "FAIL fake1: job missing script: found '/nonexistent/train.py (missing)', expected an existing file",
        "FAIL fake2: job missing script: found '/nonexistent/train.py (missing)'",
    ):
        assert line in out, line
    assert "job many nproc_per_node: found 3, expected 1 to 4" not in out
    assert list((tmp_path / "written").iterdir()) == []
    assert "fake1                      : ok=" in out and "failed=1" in out


def test_preflight_checks_the_jobs_as_the_units_run_them(tmp_path, script):
    # preflight applied budgetgpu_user while the units ran as torchrun_user: torchrun_user: root
    # passed preflight and the jobs ran as root.
    jobs = [{"name": "demo", "script": script, "nproc_per_node": 2}]
    proc = playbook(tmp_path, jobs, {"fake1": fake_node()}, torchrun_user="root", budgetgpu_user="budgetgpu")
    assert proc.returncode != 0
    assert "FAIL fake1: job demo user: found 'root', expected an unprivileged user" in proc.stdout
    assert list((tmp_path / "written").iterdir()) == []
