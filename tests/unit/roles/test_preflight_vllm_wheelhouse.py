"""Role preflight refuses a vLLM service on a node whose wheelhouse has no wheel of its vllm.package
(issue 39): role inference installs vLLM there with pip --no-index, so the run would fail on the node,
after other nodes were changed. Through ansible-playbook with fake nodes on a local connection, as
test_preflight_inference.py; the wheelhouse is a folder of empty files named as wheels."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.checks import vllm_wheelhouse_problems
from ansible_collections.budgetgpu.cluster.tests.unit.roles.test_preflight_inference import (
    GATEWAY,
    gpu_node,
    model,
    service,
)
from ansible_collections.budgetgpu.cluster.tests.unit.roles.test_preflight_role import playbook
from ansible_collections.budgetgpu.cluster.tests.unit.test_inference_model import LLAMA_7B

PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"  # the fake nodes' Python: this one
TORCH = "torch-2.8.0-cp311-cp311-manylinux_2_28_x86_64.whl"


def vllm_chat(tmp_path: Path, package: str) -> dict:
    path = model(tmp_path, "llama7", LLAMA_7B)
    return service("chat", path, task="generation", engine="vllm", vllm={"package": package}, gpus=[0])


def wheelhouse(tmp_path: Path, *names: str) -> Path:
    folder = tmp_path / "wheels"
    folder.mkdir(exist_ok=True)
    for name in names:
        (folder / name).write_bytes(b"")
    return folder


def run(tmp_path: Path, services: list[dict], nodes: dict, **variables):
    written = tmp_path / "written"
    if written.exists():
        written.rename(tmp_path / f"written-{len(list(tmp_path.glob('written*')))}")
    return playbook(tmp_path, [], nodes, inference_services=services, **GATEWAY, **variables)


def problems(out: str) -> list[str]:
    """The failed check's lines, as Ansible's error line prints the list (its quotes escaped, unwrapped)."""
    prefix = "[ERROR]: Task failed: Action failed: "
    line = next((line for line in out.splitlines() if line.startswith(prefix + "[")), None)
    assert line is not None, out[-3000:]
    return ast.literal_eval(line[len(prefix) :])


def test_a_wheelhouse_without_the_vllm_wheel_is_refused_naming_service_nodes_folder_and_command(tmp_path):
    folder = wheelhouse(tmp_path, TORCH, "vllm-0.10.2-cp38-abi3-manylinux1_x86_64.whl")
    services = [vllm_chat(tmp_path, "vllm==0.11.0")]
    nodes = {"fake1": gpu_node(), "fake2": gpu_node()}
    proc = run(tmp_path, services, nodes, python_env_wheelhouse=str(folder))
    assert proc.returncode != 0, proc.stdout[-3000:]
    # One line for the service's nodes that share the folder and the Python, with the command that fills it.
    assert problems(proc.stdout) == [
        "preflight failed: nothing was changed on any node",
        f"FAIL fake1, fake2: service chat: vllm.package: found no wheel for vllm==0.11.0 in python_env_wheelhouse "
        f"{folder} on the control node, expected one (role inference installs vLLM from the node's wheelhouse "
        f"alone): run scripts/fill-wheelhouse --vllm 'vllm==0.11.0' --python-version {PYTHON} {folder}, or set "
        'python_env_wheelhouse to "" for these nodes',
    ]
    assert list((tmp_path / "written").iterdir()) == []

    # With the wheel of that release there, the same inventory passes.
    wheelhouse(tmp_path, "vllm-0.11.0-cp38-abi3-manylinux1_x86_64.whl")
    proc = run(tmp_path, services, nodes, python_env_wheelhouse=str(folder))
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "inference placement passed: 1 services, chat" in proc.stdout


def test_only_the_vllm_nodes_with_a_wheelhouse_are_checked_and_a_relative_one_lies_under_the_playbook(tmp_path):
    wheelhouse(tmp_path, TORCH)
    services = [vllm_chat(tmp_path, "vllm")]
    # fake1 names the wheelhouse relative to the playbook (tmp_path/play.yml); fake2 installs from the index
    # (no wheelhouse); fake3 serves no vLLM service.
    nodes = {"fake1": {**gpu_node(), "python_env_wheelhouse": "wheels"}, "fake2": gpu_node(), "fake3": gpu_node()}
    services[0]["nodes"] = ["fake1", "fake2"]
    proc = run(tmp_path, services, nodes)
    assert proc.returncode != 0, proc.stdout[-3000:]
    found = problems(proc.stdout)
    assert len(found) == 2, found
    assert found[1].startswith(
        f"FAIL fake1: service chat: vllm.package: found no wheel for vllm in python_env_wheelhouse {tmp_path}/wheels "
        "on the control node"
    ), found
    assert f"run scripts/fill-wheelhouse --vllm 'vllm' --python-version {PYTHON} {tmp_path}/wheels," in found[1]


def test_the_check_itself_leaves_out_absent_services_and_quotes_the_folder_for_the_shell():
    def chat(state: str = "started", engine: str = "vllm") -> dict:
        return {
            "name": "chat",
            "engine": engine,
            "state": state,
            "nodes": ["n1"],
            "vllm": {"package": "vllm==0.11.0", "venv": "/opt/v"},
        }

    folders = {"n1": "/srv/my wheels"}
    wheels = ["/srv/my wheels/vllm-0.10.2-cp38-abi3-manylinux1_x86_64.whl", "/srv/other/vllm-0.11.0-py3-none-any.whl"]
    # The node's Python unknown (no facts): the command leaves --python-version to its default.
    assert vllm_wheelhouse_problems([chat()], {}, ["n1"], folders, wheels) == [
        "n1: service chat: vllm.package: found no wheel for vllm==0.11.0 in python_env_wheelhouse /srv/my wheels on "
        "the control node, expected one (role inference installs vLLM from the node's wheelhouse alone): run "
        "scripts/fill-wheelhouse --vllm 'vllm==0.11.0' '/srv/my wheels', or set python_env_wheelhouse to \"\" for "
        "these nodes"
    ]
    assert vllm_wheelhouse_problems([chat("absent"), chat(engine="builtin")], {}, ["n1"], folders, wheels) == []
    assert vllm_wheelhouse_problems([chat()], {}, ["n1"], None, None) == []
