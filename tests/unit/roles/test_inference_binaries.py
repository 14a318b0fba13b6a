"""roles/inference's one build everywhere (issue 43 item 2, tasks/binaries.yml), run as the role runs it: the
control node's llama.cpp binaries against a head's own copies and, delegated, its RPC node's ggml-rpc-server. Two
fake local hosts stand for the head (node1) and its RPC node (node2): both are this machine, so node2's copy is the
file node1 has at that path."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import local_inventory, output_of, run_playbook

PLAY = """\
- name: The llama.cpp binaries' check of role inference on a worker's head
  hosts: node1
  gather_facts: false
  tasks:
    - name: Compare the binaries with the control node's build
      ansible.builtin.include_role:
        name: budgetgpu.cluster.inference
        tasks_from: binaries.yml
    - name: A later step that must not run where a binary differs
      ansible.builtin.copy:
        content: written
        dest: "{{ marker }}"
        mode: "0644"
"""


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


ADVICE = "(llama.cpp's RPC needs one build on every node of a worker: run playbooks/inference.yml on all of them)"


@pytest.mark.parametrize("planted", [None, "ggml-rpc-server", "llama-server"])
def test_a_node_whose_llamacpp_binary_differs_from_the_control_nodes_is_refused_naming_it(tmp_path: Path, planted):
    build, node = tmp_path / "build", tmp_path / "node"
    build.mkdir()
    node.mkdir()
    files = []
    for name in ("llama-server", "ggml-rpc-server"):
        (build / name).write_bytes(f"the build of {name}\n".encode())
        (node / name).write_bytes((build / name).read_bytes() + (b"planted\n" if name == planted else b""))
        files.append({"src": str(build / name), "dest": str(node / name)})
    marker = tmp_path / "after"
    variables = {
        "_inference_llamacpp_files": files,
        "_inference_rpc_server": str(node / "ggml-rpc-server"),
        "_inference_plan": [{"state": "present", "workers": [{"rpc_servers": [{"host": "node2"}]}]}],
        "marker": str(marker),
    }
    inventory = local_inventory(tmp_path, {"node1": {}, "node2": {}})
    result = run_playbook(tmp_path, PLAY, variables, inventory=inventory)
    out = output_of(result)
    if planted is None:
        assert result.returncode == 0 and marker.exists(), out
        return
    assert result.returncode != 0 and not marker.exists(), out
    wrong = f"found sha256 {sha(node / planted)}, expected sha256 {sha(build / planted)}, the control node's"
    # The head's own copy; a planted RPC server is node2's too (the file the head reads there).
    hosts = ["node1", "node2"] if planted == "ggml-rpc-server" else ["node1"]
    for host in hosts:
        assert f"{host}: {node / planted}: {wrong} {build / planted} {ADVICE}" in out, out
    assert (f"node2: {node / 'ggml-rpc-server'}: found" in out) == (planted == "ggml-rpc-server"), out
