"""python_env refuses bad input in its first tasks, naming the variable and the host.

Each case runs the role with ansible-playbook on a fake host (local connection, check
mode) and stops at the first failure: no node, no Docker, a second or two each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PLAYBOOK = """\
- name: Run python_env
  hosts: all
  gather_facts: false
  pre_tasks:
    - name: Pretend the probes ran
      ansible.builtin.set_fact:
        budgetgpu_gpus: "{{ test_gpus }}"
        cacheable: true
      when: test_gpus is defined
      tags: [always]
  roles:
    - role: budgetgpu.cluster.python_env
"""


def run_role(tmp_path: Path, extra_vars: dict, tags: str = "all") -> subprocess.CompletedProcess[str]:
    playbook = tmp_path / "play.yml"
    playbook.write_text(PLAYBOOK)
    variables = {"ansible_python_interpreter": sys.executable, **extra_vars}
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_COLLECTIONS_PATH": str(REPO / ".collections"),
        "ANSIBLE_CACHE_PLUGIN": "memory",
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp"),
    }
    return subprocess.run(
        [
            str(Path(sys.executable).with_name("ansible-playbook")),
            "-i",
            "node7,",
            "-c",
            "local",
            "--check",
            "--tags",
            tags,
            "-e",
            json.dumps(variables),
            str(playbook),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )


def assert_refused(result: subprocess.CompletedProcess[str], *expected: str) -> None:
    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode != 0, output
    for text in expected:
        assert text in output, output
    # Nothing past the preflight ran.
    assert "Install the system packages" not in output, output


def test_unknown_torch_variant(tmp_path):
    assert_refused(
        run_role(tmp_path, {"python_env_torch_variant": "cu999"}),
        "fatal: [node7]",
        "python_env_torch_variant must be one of",
        "got: cu999",
    )


def test_missing_wheelhouse(tmp_path):
    assert_refused(
        run_role(tmp_path, {"python_env_wheelhouse": str(tmp_path / "no-such-dir")}),
        "node7: python_env_wheelhouse",
        "is not a directory on the control node",
    )


def test_wheelhouse_without_the_torch_build(tmp_path):
    wheelhouse = tmp_path / "wheels"
    wheelhouse.mkdir()
    (wheelhouse / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    assert_refused(
        run_role(tmp_path, {"python_env_wheelhouse": str(wheelhouse), "python_env_torch_variant": "cu128"}),
        "node7: python_env_wheelhouse",
        "has no wheel for torch==2.13.0+cu128",
    )


def test_variant_newer_than_the_driver(tmp_path):
    gpus = {"count": 1, "driver": {"loaded": True, "cuda_driver_version": "12.2"}}
    assert_refused(
        run_role(tmp_path, {"python_env_torch_variant": "cu130", "test_gpus": gpus}),
        "node7: python_env_torch_variant cu130",
        "needs a driver for CUDA 13.x or newer",
    )


def test_root_owner(tmp_path):
    assert_refused(run_role(tmp_path, {"python_env_owner": "root"}), "node7: python_env_owner is 'root'")


def test_wrong_type(tmp_path):
    assert_refused(
        run_role(tmp_path, {"python_env_requirements": {"numpy": "2"}}),
        "fatal: [node7]",
        "python_env_requirements",
    )


def test_good_input_passes_the_preflight(tmp_path):
    wheelhouse = tmp_path / "wheels"
    wheelhouse.mkdir()
    (wheelhouse / "torch-2.13.0+cu130-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    gpus = {"count": 1, "driver": {"loaded": True, "cuda_driver_version": "13.0"}}
    result = run_role(
        tmp_path,
        {"python_env_wheelhouse": str(wheelhouse), "test_gpus": gpus},
        tags="python_env_preflight",
    )
    output = " ".join(result.stdout.split())
    assert result.returncode == 0, output + result.stderr
    assert "torch==2.13.0+cu130 (driver CUDA 13.0, python_env_torch_variant auto)" in output, output


@pytest.mark.parametrize("variant", ["cpu", "auto"])
def test_no_driver_gets_the_cpu_build(tmp_path, variant):
    result = run_role(tmp_path, {"python_env_torch_variant": variant}, tags="python_env_preflight")
    output = " ".join(result.stdout.split())
    assert result.returncode == 0, output + result.stderr
    assert "torch==2.13.0+cpu (no NVIDIA driver loaded" in output, output
