"""python_env refuses bad input in its first tasks, naming the variable and the host.

Each case is a fake host (local connection, check mode) with its own input as host vars; one
ansible-playbook run takes every refusal and one every pass, and each host stops at its first
failure: no node, no Docker.
Check mode writes nothing on this machine; what the role reads of it (a node venv at
node_venv_path) is pointed at a path that never exists: a fresh node, whatever earlier runs
left here.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import host_results, run_batch, texts_of

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


def run_cases(tmp_path: Path, cases: dict[str, dict], tags: str) -> dict:
    """One ansible-playbook run of the role (check mode, `tags`) on one fake host per case ({host: its variables}):
    a run per case cost about 3 s of start-up each. Returns run_batch's report."""
    # node_venv runs too (in check mode): its refusals come first on a node without the node venv.
    fresh_node = {"node_venv_ready": False, "node_venv_path": NO_NODE_VENV}
    return run_batch(tmp_path, PLAYBOOK, cases, options=("--check", "--tags", tags), extra_vars=fresh_node)


def wheelhouse_of(folder: Path, *wheels: str) -> Path:
    """A control node's wheelhouse in `folder` with node_venv's pinned wheels (python_env's dependency checks it
    for them first) and `wheels`, all empty files."""
    wheelhouse = folder / "wheels"
    wheelhouse.mkdir(parents=True)
    for name in NODE_VENV_WHEELS + list(wheels):
        (wheelhouse / name).write_bytes(b"")
    return wheelhouse


def refusal_cases(tmp_path: Path) -> dict[str, tuple[dict, tuple[str, ...]]]:
    """host: (the case's variables, what its refusal says; {host} is the host's name)."""
    torch_cpu = "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    # On a node without the node venv: node_venv needs its own pins from the same wheelhouse.
    pinless = tmp_path / "pinless" / "wheels"
    pinless.mkdir(parents=True)
    (pinless / torch_cpu).write_bytes(b"")
    return {
        "unknown_torch_variant": (
            {"python_env_torch_variant": "cu999"},
            ("python_env_torch_variant must be one of", "got: cu999"),
        ),
        "missing_wheelhouse": (
            {"python_env_wheelhouse": str(tmp_path / "no-such-dir")},
            ("{host}: python_env_wheelhouse", "is not a directory on the control node"),
        ),
        "wheelhouse_without_the_torch_build": (
            {
                "python_env_wheelhouse": str(wheelhouse_of(tmp_path / "torch_cpu", torch_cpu)),
                "python_env_torch_variant": "cu128",
            },
            ("{host}: python_env_wheelhouse", "has no wheel for torch==2.13.0+cu128"),
        ),
        "wheelhouse_without_the_node_venvs_pins_is_refused_by_node_venv_first": (
            {"python_env_wheelhouse": str(pinless), "python_env_torch_variant": "cpu"},
            (f"{{host}}: node_venv_wheelhouse {pinless} holds no wheel of the pins nvidia-ml-py==",
             "run scripts/fill-wheelhouse"),
        ),
        "variant_newer_than_the_driver": (
            {
                "python_env_torch_variant": "cu130",
                "test_gpus": {"count": 1, "driver": {"loaded": True, "cuda_driver_version": "12.2"}},
            },
            ("{host}: python_env_torch_variant cu130", "needs a driver for CUDA 13.x or newer"),
        ),
        "root_owner": ({"python_env_owner": "root"}, ("{host}: python_env_owner is 'root'",)),
        # One check lists them all: a tired person fixes the inventory once, not once per run.
        # node_venv, which runs first, would refuse the missing wheelhouse alone: it is told to use the index.
        "every_problem_is_named_in_one_run": (
            {
                "python_env_owner": "root",
                "python_env_wheelhouse": str(tmp_path / "no-such-dir"),
                "node_venv_wheelhouse": "",
            },
            ("{host}: python_env_owner is 'root'", "{host}: python_env_wheelhouse",
             "is not a directory on the control node"),
        ),
        "wrong_type": ({"python_env_requirements": {"numpy": "2"}}, ("python_env_requirements",)),
        "numpy_in_the_extra_requirements": (
            {"python_env_requirements": ["transformers", "NumPy==2.3.0"]},
            ("{host}: python_env_requirements names numpy (NumPy==2.3.0)", "set python_env_numpy_version instead"),
        ),
    }  # fmt: skip


def test_each_bad_input_is_refused_before_anything_past_the_preflight(tmp_path):
    cases = refusal_cases(tmp_path)
    report = run_cases(tmp_path, {host: variables for host, (variables, _texts) in cases.items()}, "all")
    wrong = []
    for host, (_variables, texts) in cases.items():
        results = host_results(report, host)
        if report["stats"][host]["failures"] == 0:
            wrong.append(f"{host}: not refused ({[name for name, _result in results]})")
            continue
        # The role's refusal, or the inputs check's before it (ignored, so that the role's checks run too).
        said = texts_of([result for _name, result in results if result.get("failed")])
        wrong += [f"{host}: {text!r} not in {said!r}" for text in texts if text.format(host=host) not in said]
        # Nothing past the preflight ran.
        ran = [name for name, _result in results if "Install the system packages" in name]
        if ran:
            wrong.append(f"{host}: ran {ran} after the refusal")
    assert wrong == []


def test_good_input_passes_the_preflight_and_no_driver_gets_the_cpu_build(tmp_path):
    gpus = {"count": 1, "driver": {"loaded": True, "cuda_driver_version": "13.0"}}
    wheelhouse = wheelhouse_of(tmp_path, "torch-2.13.0+cu130-cp311-cp311-manylinux_2_28_x86_64.whl")
    cases = {
        "good_input": (
            {"python_env_wheelhouse": str(wheelhouse), "test_gpus": gpus},
            "torch==2.13.0+cu130 (driver CUDA 13.0, python_env_torch_variant auto)",
        ),
        "no_driver_cpu": ({"python_env_torch_variant": "cpu"}, "torch==2.13.0+cpu (no NVIDIA driver loaded"),
        "no_driver_auto": ({"python_env_torch_variant": "auto"}, "torch==2.13.0+cpu (no NVIDIA driver loaded"),
    }
    report = run_cases(
        tmp_path, {host: variables for host, (variables, _text) in cases.items()}, "python_env_preflight"
    )
    for host, (_variables, text) in cases.items():
        results = host_results(report, host)
        output = texts_of([result for _name, result in results])
        assert not any(result.get("failed") for _name, result in results), (host, output)
        assert text in output, (host, output)


def test_numpy_is_a_default_and_the_wheelhouse_gets_the_same_release():
    # torch warns at import and all_gather_object fails without numpy; the offline install needs its wheel.
    defaults = yaml.safe_load((REPO / "roles/python_env/defaults/main.yml").read_text())
    spec = yaml.safe_load((REPO / "roles/python_env/meta/argument_specs.yml").read_text())
    option = spec["argument_specs"]["main"]["options"]["python_env_numpy_version"]
    assert defaults["python_env_numpy_version"] == option["default"] == "2.4.6"
    fill = (REPO / "scripts/fill-wheelhouse").read_text()
    assert re.search(r"^numpy_spec=\$\{BUDGETGPU_NUMPY_SPEC:-numpy==(\S+)\}$", fill, re.M)[1] == "2.4.6"
    assert '"$numpy_spec"' in fill
