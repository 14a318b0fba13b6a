"""python_env refuses bad input in its first tasks, naming the variable and the host.

Each case runs the role with ansible-playbook on a fake host (local connection, check
mode) and stops at the first failure: no node, no Docker, a second or two each.
Check mode writes nothing on this machine; what the role reads of it (a node venv at
node_venv_path) is pointed at a path that never exists: a fresh node, whatever earlier runs
left here.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import output_of, run_playbook

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
    # As site.yml's preflight does before python_env (the wheelhouse on the control node is
    # checked there); errors ignored so that the role's own checks run too.
    - name: Check the inputs as preflight does
      budgetgpu.cluster.check_inputs:
      ignore_errors: true
      tags: [always]
  roles:
    - role: budgetgpu.cluster.python_env
"""


# Not under tmp_path: node_venv refuses a venv below a folder every user may write (/tmp).
NO_NODE_VENV = "/nonexistent/budgetgpu-unit-test/node"
# node_venv's pins (nvidia-ml-py==13.615.71) as the wheels fill-wheelhouse brings for them.
NODE_VENV_WHEELS = [
    f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    for name, version in (
        line.split("==")
        for line in (REPO / "roles/node_venv/files/requirements.txt").read_text().splitlines()
        if line and not line.startswith("#")
    )
]


def run_role(tmp_path: Path, extra_vars: dict, tags: str = "all") -> subprocess.CompletedProcess[str]:
    # node_venv runs too (in check mode): its refusals come first on a node without the node venv.
    variables = {"node_venv_ready": False, "node_venv_path": NO_NODE_VENV, **extra_vars}
    return run_playbook(tmp_path, PLAYBOOK, variables, options=("--check", "--tags", tags))


def wheelhouse_of(tmp_path: Path, *wheels: str) -> Path:
    """A control node's wheelhouse with node_venv's pinned wheels (python_env's dependency checks it for
    them first) and `wheels`, all empty files."""
    wheelhouse = tmp_path / "wheels"
    wheelhouse.mkdir()
    for name in NODE_VENV_WHEELS + list(wheels):
        (wheelhouse / name).write_bytes(b"")
    return wheelhouse


def assert_refused(result: subprocess.CompletedProcess[str], *expected: str) -> None:
    output = output_of(result)
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
    wheelhouse = wheelhouse_of(tmp_path, "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")
    assert_refused(
        run_role(tmp_path, {"python_env_wheelhouse": str(wheelhouse), "python_env_torch_variant": "cu128"}),
        "node7: python_env_wheelhouse",
        "has no wheel for torch==2.13.0+cu128",
    )


def test_wheelhouse_without_the_node_venvs_pins_is_refused_by_node_venv_first(tmp_path):
    # On a node without the node venv: node_venv needs its own pins from the same wheelhouse.
    wheelhouse = tmp_path / "wheels"
    wheelhouse.mkdir()
    (wheelhouse / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    assert_refused(
        run_role(tmp_path, {"python_env_wheelhouse": str(wheelhouse), "python_env_torch_variant": "cpu"}),
        f"node7: node_venv_wheelhouse {wheelhouse} holds no wheel of the pins nvidia-ml-py==",
        "run scripts/fill-wheelhouse",
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


def test_every_problem_is_named_in_one_run(tmp_path):
    # One check lists them all: a tired person fixes the inventory once, not once per run.
    # node_venv, which runs first, would refuse the missing wheelhouse alone: it is told to use the index.
    variables = {"python_env_owner": "root", "python_env_wheelhouse": str(tmp_path / "no-such-dir")}
    assert_refused(
        run_role(tmp_path, {**variables, "node_venv_wheelhouse": ""}),
        "node7: python_env_owner is 'root'",
        "node7: python_env_wheelhouse",
        "is not a directory on the control node",
    )


def test_wrong_type(tmp_path):
    assert_refused(
        run_role(tmp_path, {"python_env_requirements": {"numpy": "2"}}),
        "fatal: [node7]",
        "python_env_requirements",
    )


def test_good_input_passes_the_preflight(tmp_path):
    wheelhouse = wheelhouse_of(tmp_path, "torch-2.13.0+cu130-cp311-cp311-manylinux_2_28_x86_64.whl")
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


def test_numpy_in_the_extra_requirements(tmp_path):
    assert_refused(
        run_role(tmp_path, {"python_env_requirements": ["transformers", "NumPy==2.3.0"]}),
        "node7: python_env_requirements names numpy (NumPy==2.3.0)",
        "set python_env_numpy_version instead",
    )


def test_numpy_is_a_default_and_the_wheelhouse_gets_the_same_release():
    # torch warns at import and all_gather_object fails without numpy; the offline install needs its wheel.
    defaults = yaml.safe_load((REPO / "roles/python_env/defaults/main.yml").read_text())
    spec = yaml.safe_load((REPO / "roles/python_env/meta/argument_specs.yml").read_text())
    option = spec["argument_specs"]["main"]["options"]["python_env_numpy_version"]
    assert defaults["python_env_numpy_version"] == option["default"] == "2.4.6"
    fill = (REPO / "scripts/fill-wheelhouse").read_text()
    assert re.search(r"^numpy_spec=\$\{BUDGETGPU_NUMPY_SPEC:-numpy==(\S+)\}$", fill, re.M)[1] == "2.4.6"
    assert '"$numpy_spec"' in fill
