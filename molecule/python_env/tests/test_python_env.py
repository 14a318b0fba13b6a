"""The venv is root's, holds the pinned torch and numpy, and root never ran the training user's code."""

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
MARKERS = "/var/tmp/budgetgpu-markers"  # written by what the training user planted (earlier_release.yml, converge.yml)


def test_training_user_is_an_unprivileged_system_user(host):
    user = host.user(USER)
    assert user.exists
    assert 0 < user.uid < 1000
    assert host.file(user.home).is_directory
    assert "sudo" not in user.groups


def test_venv_is_roots_and_the_training_user_cannot_write_it(host):
    venv = host.file(VENV)
    assert venv.is_directory
    assert (venv.user, venv.group, venv.mode) == ("root", "root", 0o755)
    assert host.file(f"{VENV}/pyvenv.cfg").user == "root"
    # Every file root owns and nobody else may write (links have no mode of their own) ...
    assert host.check_output(f"find {VENV} \\( ! -user root -o ! -type l -perm /022 \\) -print -quit") == ""
    # ... and the kernel agrees: nothing in it is writable by the training user.
    assert host.check_output(f"sudo -u {USER} find {VENV} -writable -print -quit") == ""


def test_the_earlier_release_venv_was_rebuilt_not_taken_over(host):
    # side_effect planted this as the venv's owner; the role removed that venv and made a new one.
    assert not host.file(f"{VENV}/lib/python3.11/site-packages/zz-planted.pth").exists


def test_code_the_training_user_planted_never_ran_as_root(host):
    # The plants happened: the user's own site-packages holds them (converge's post_tasks) ...
    site = host.check_output(f"sudo -u {USER} python3 -m site --user-site")
    assert host.file(f"{site}/zz-planted.pth").exists
    assert host.file(f"{site}/usercustomize.py").exists
    # ... and across the upgrade converge and the nightly run after it (idempotence), no uid 0 ran them.
    markers = host.check_output(f"ls -1 {MARKERS}").split()
    assert [name for name in markers if name.endswith("-uid-0")] == [], markers


def test_torch_and_numpy_import_as_the_training_user_without_a_warning(host):
    script = (
        "import numpy, torch; "
        "print(torch.__version__, torch.version.cuda, numpy.__version__, "
        "torch.from_numpy(numpy.arange(4)).sum().item())"
    )
    result = host.run(f"sudo -u {USER} {VENV}/bin/python -c '{script}'")
    assert result.rc == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "2.13.0+cpu None 2.4.6 6"
    # torch says "Failed to initialize NumPy" at import when numpy is missing.
    assert "numpy" not in result.stderr.lower(), result.stderr


def test_pinned_packages_are_installed(host):
    frozen = set(host.check_output(f"sudo -u {USER} {VENV}/bin/python -I -m pip freeze --all").split())
    assert {"torch==2.13.0+cpu", "nvidia-ml-py==13.615.71", "numpy==2.4.6"} <= frozen


def test_wheels_came_from_the_control_nodes_wheelhouse(host):
    for wheel in (
        "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",
        "numpy-2.4.6-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl",
    ):
        node_wheel = host.file(f"/var/cache/budgetgpu/wheelhouse/{wheel}")
        assert node_wheel.is_file
        assert node_wheel.user == "root"
        assert node_wheel.mode == 0o644


def test_versions_are_recorded_as_a_local_fact(host):
    facts = json.loads(host.file(FACTS).content_string)
    python = host.check_output(
        f"sudo -u {USER} {VENV}/bin/python -I -c 'import platform; print(platform.python_version())'"
    )
    assert facts["python"] == python
    assert facts["torch"] == "2.13.0+cpu"
    assert facts["variant"] == "cpu"
    assert facts["cuda"] is None
    assert facts["nccl"] is None
    assert facts["gpus_visible"] == 0
    assert facts["nvidia_ml_py"] == "13.615.71"
    assert facts["numpy"] == "2.4.6"
    assert facts["path"] == VENV
