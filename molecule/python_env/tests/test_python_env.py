"""The venv exists, belongs to the training user, and its pinned torch imports."""

from __future__ import annotations

import json
import os

import testinfra.utils.ansible_runner

testinfra_hosts = testinfra.utils.ansible_runner.AnsibleRunner(os.environ["MOLECULE_INVENTORY_FILE"]).get_hosts(
    "gpu_nodes"
)

VENV = "/opt/budgetgpu/venv"
USER = "budgetgpu"
FACTS = "/etc/ansible/facts.d/budgetgpu_python_env.fact"


def test_training_user_is_an_unprivileged_system_user(host):
    user = host.user(USER)
    assert user.exists
    assert 0 < user.uid < 1000
    assert host.file(user.home).is_directory
    assert "sudo" not in user.groups


def test_venv_belongs_to_the_training_user(host):
    venv = host.file(VENV)
    assert venv.is_directory
    assert venv.user == USER
    assert host.file(f"{VENV}/pyvenv.cfg").user == USER
    # Nothing inside was written by root (pip ran as the user).
    assert host.check_output(f"find {VENV} ! -user {USER} -print -quit") == ""


def test_torch_imports_as_the_training_user(host):
    out = host.check_output(
        f"sudo -u {USER} {VENV}/bin/python -c 'import torch; print(torch.__version__, torch.version.cuda)'"
    )
    assert out.splitlines()[-1] == "2.13.0+cpu None"


def test_pinned_packages_and_extra_requirements_are_installed(host):
    frozen = set(host.check_output(f"{VENV}/bin/python -m pip freeze --all").split())
    assert {"torch==2.13.0+cpu", "nvidia-ml-py==13.615.71", "numpy==2.4.6"} <= frozen


def test_wheels_came_from_the_control_nodes_wheelhouse(host):
    wheel = host.file("/var/cache/budgetgpu/wheelhouse/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")
    assert wheel.is_file
    assert wheel.user == "root"
    assert wheel.mode == 0o644


def test_versions_are_recorded_as_a_local_fact(host):
    facts = json.loads(host.file(FACTS).content_string)
    python = host.check_output(f"{VENV}/bin/python -c 'import platform; print(platform.python_version())'")
    assert facts["python"] == python
    assert facts["torch"] == "2.13.0+cpu"
    assert facts["variant"] == "cpu"
    assert facts["cuda"] is None
    assert facts["nccl"] is None
    assert facts["gpus_visible"] == 0
    assert facts["nvidia_ml_py"] == "13.615.71"
    assert facts["path"] == VENV
