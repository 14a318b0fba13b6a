"""python_env's and cuda's preflight through ansible-playbook, without Docker: a fake node on a local
connection whose gpu_facts answer is set as Ubuntu 22.04's 7.352 binding gives it (GPUs, driver
loaded, CUDA version "unsupported"). torch_variant auto refuses there, naming the host and the
binding, where it once picked the CPU build; a node without NVIDIA GPUs keeps the CPU build."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import NO_NODE_VENV_INSTALL

REPO = Path(__file__).resolve().parents[3]
PLAYBOOK = """
- name: Preflight python_env and cuda on fake probe facts
  hosts: gpu_nodes
  gather_facts: false
  tasks:
    - name: Set the probe facts
      ansible.builtin.set_fact:
        budgetgpu_gpus: "{{ fake_gpus }}"
        cacheable: true

    - name: Check cuda's inputs
      ansible.builtin.include_role:
        name: budgetgpu.cluster.cuda
        tasks_from: preflight
      when: with_cuda | default(false)

    - name: Check python_env's inputs
      ansible.builtin.include_role:
        name: budgetgpu.cluster.python_env
        tasks_from: preflight
"""
BINDING_7352 = {
    "module": "pynvml",
    "distribution": "nvidia-ml-py3",
    "version": "7.352.0",
    "path": "/usr/lib/python3/dist-packages/pynvml.py",
}
UBUNTU_2204_GPUS = {
    "driver": {
        "state": "loaded",
        "loaded": True,
        "version": "535.247.01",
        "cuda_driver_version": "unsupported",
        "errors": {},
        "binding": BINDING_7352,
    },
    "count": 4,
    "gpus": [{"index": i, "name": "NVIDIA GeForce RTX 3090"} for i in range(4)],
}
NO_GPUS = {"driver": {"state": "no_driver", "loaded": False, "binding": BINDING_7352}, "count": 0, "gpus": []}


def playbook(
    tmp_path: Path, gpus: dict, wheels: tuple[str, ...] = ("cpu",), **host_vars
) -> subprocess.CompletedProcess:
    wheelhouse = tmp_path / "wheelhouse"
    wheelhouse.mkdir()
    # Had auto fallen back to the CPU build, its wheel is there: the run would pass.
    python = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for variant in wheels:
        (wheelhouse / f"torch-2.13.0+{variant}-{python}-{python}-manylinux_2_28_x86_64.whl").write_text("")
    node = {"fake_gpus": gpus, "python_env_owner": "nobody", "python_env_wheelhouse": str(wheelhouse), **host_vars}
    inventory = {
        "all": {
            "vars": {
                "ansible_connection": "local",
                "ansible_python_interpreter": sys.executable,
                # python_env's entry points run its dependency node_venv, which would install on this machine.
                **NO_NODE_VENV_INSTALL,
            },
            "children": {"gpu_nodes": {"hosts": {"fake1": node}}},
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


def words(proc: subprocess.CompletedProcess) -> str:
    """The output with Ansible's line folding undone."""
    return " ".join(proc.stdout.split())


def test_auto_on_gpus_whose_cuda_the_binding_cannot_read_is_refused_naming_host_and_binding(tmp_path):
    proc = playbook(tmp_path, UBUNTU_2204_GPUS)
    out = words(proc)
    assert proc.returncode != 0, out[-3000:]
    assert (
        "fake1: python_env_torch_variant auto: the node has 4 NVIDIA GPU(s) with driver 535.247.01 loaded, but "
        "pynvml 7.352.0 (nvidia-ml-py3, /usr/lib/python3/dist-packages/pynvml.py) cannot read the driver's CUDA "
        "version"
    ) in out
    assert "+cpu" not in out and "Traceback" not in out


def test_an_explicit_variant_is_taken_on_the_same_node(tmp_path):
    proc = playbook(tmp_path, UBUNTU_2204_GPUS, wheels=("cu128",), python_env_torch_variant="cu128")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "fake1: torch==2.13.0+cu128 (driver CUDA unreadable, python_env_torch_variant cu128)" in words(proc)


def test_a_node_without_nvidia_gpus_keeps_the_cpu_build(tmp_path):
    proc = playbook(tmp_path, NO_GPUS)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "fake1: torch==2.13.0+cpu (no NVIDIA driver loaded, python_env_torch_variant auto)" in words(proc)


def test_the_cuda_role_refuses_the_same_node_before_choosing_nccl(tmp_path):
    proc = playbook(tmp_path, UBUNTU_2204_GPUS, with_cuda=True, cuda_nccl_install=True)
    out = words(proc)
    assert proc.returncode != 0, out[-3000:]
    assert "fake1: cuda_torch_variant auto: the node has 4 NVIDIA GPU(s)" in out
    assert "pynvml 7.352.0 (nvidia-ml-py3" in out and "Traceback" not in out
