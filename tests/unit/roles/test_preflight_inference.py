"""Role preflight checks the inference services through ansible-playbook, without Docker (fake nodes
on a local connection, as test_preflight_role.py): the model's config.json is read on the control
node, a placement that cannot work fails naming host, GPU, field, found and expected, and nothing is
written on any node. The inventory's inference_* inputs are checked like every role's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils import inputs
from ansible_collections.budgetgpu.cluster.tests.unit.roles.test_preflight_role import RTX, fake_node, playbook
from ansible_collections.budgetgpu.cluster.tests.unit.test_inference_model import LLAMA_70B, MINILM

REPO = Path(__file__).resolve().parents[3]


def gpu_node(gpus: int = 2) -> dict:
    node = fake_node(gpus)
    for i, gpu in enumerate(node["fake_gpus"]["gpus"]):
        gpu.update(uuid=f"GPU-3090000{i}", memory_total_mib=24576, compute_capability="8.6")
    return node


def model(tmp_path: Path, name: str, config: dict) -> str:
    path = tmp_path / "models" / name
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def service(name: str, path: str, **keys) -> dict:
    return {"name": name, "model": path, "task": "embeddings", "nodes": "gpu_nodes", **keys}


def test_a_placement_that_cannot_work_fails_naming_each_problem_and_writes_nothing(tmp_path):
    services = [
        service("chat", model(tmp_path, "llama70", LLAMA_70B), task="generation", quantization="4bit", gpus=[0]),
        service("embed", str(tmp_path / "models" / "nowhere"), gpus=[1], port=8200, gateway={"port": 8081}),
    ]
    nodes = {"fake1": gpu_node(), "fake2": gpu_node()}
    proc = playbook(tmp_path, [], nodes, inference_services=services)
    out = proc.stdout
    assert proc.returncode != 0, out[-3000:]
    assert "preflight failed: nothing was changed on any node" in out
    for line in (
        f"FAIL fake1 GPU 0 ({RTX}, 24576 MiB): service chat: memory: needs 33.3 GiB (69.0e9 params x 0.5 B (4bit) "
        "= 32.1 GiB + KV cache 720 MiB + 500 MiB CUDA context); expected at most 24.0 GiB",
        f"FAIL fake2 GPU 0 ({RTX}, 24576 MiB): service chat: memory: needs 33.3 GiB",
        f"FAIL control node: service embed: model: found no {tmp_path}/models/nowhere/config.json on the control node",
    ):
        assert line in out, line
    assert list((tmp_path / "written").iterdir()) == []


def test_a_sound_placement_passes_beside_a_training_job(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('train')\n")
    jobs = [{"name": "demo", "script": str(script), "nproc_per_node": 1, "user": "nobody"}]
    services = [service("embed", model(tmp_path, "minilm", MINILM))]
    proc = playbook(tmp_path, jobs, {"fake1": gpu_node(), "fake2": gpu_node()}, inference_services=services, **GATEWAY)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "inference placement passed: 1 services, embed" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "written").iterdir()) == ["fake1", "fake2"]
    # The job's GPU 0 and the service's GPU 1 on each node: a GPU both claim is refused.
    (tmp_path / "written").rename(tmp_path / "written-before")
    services[0]["gpus"] = [0]
    proc = playbook(tmp_path, jobs, {"fake1": gpu_node()}, inference_services=services, **GATEWAY)
    assert proc.returncode != 0
    assert (
        f"FAIL fake1 GPU 0 ({RTX}, 24576 MiB): service embed: gpus: found GPU 0, which training job demo" in proc.stdout
    )


# What a gateway needs besides its placement: clients it admits, and an API key.
KEY = "k3y-for-the-preflight-test-0123456789"
GATEWAY = {"budgetgpu_cluster_subnet": "10.0.0.0/24", "inference_api_keys": {"ci": KEY}}


def test_a_gateway_open_to_everyone_or_without_a_key_is_refused_and_no_key_is_shown(tmp_path):
    services = [service("embed", model(tmp_path, "minilm", MINILM))]
    keys = {"ci": KEY, "short": "tooshort-secret"}
    proc = playbook(tmp_path, [], {"fake1": gpu_node()}, inference_services=services, inference_api_keys=keys)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert (
        "FAIL all: service embed: gateway.allow: found an empty allow list (no gateway.allow, no "
        "inference_gateway_allow, no budgetgpu_cluster_subnet), expected the CIDRs of the clients" in out
    )
    assert "FAIL inference_api_keys.short: found a key of 15 characters (not shown), expected 24 to 256" in out
    assert "tooshort-secret" not in out and KEY not in out
    assert list((tmp_path / "written").iterdir()) == []
    (tmp_path / "written").rename(tmp_path / "written-before")
    proc = playbook(
        tmp_path, [], {"fake1": gpu_node()}, inference_services=services, budgetgpu_cluster_subnet="10.0.0.0/24"
    )
    assert proc.returncode != 0
    assert (
        "FAIL all: service embed: gateway: found no API key, expected at least one in inference_api_keys" in proc.stdout
    )


def write_gguf_header(path: Path, layers: int, heads: int, head_dim: int) -> None:
    """A GGUF file with a model's header and no tensors, written by llama.cpp's own writer (the gguf package)."""
    gguf = pytest.importorskip("gguf", reason="gguf (tests/unit/requirements.txt) is not installed")
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_embedding_length(heads * head_dim)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_llamacpp_service_needs_its_gguf_file_and_llama_server_on_the_control_node(tmp_path):
    # chat on one node, span over both (llama.cpp's RPC): span needs ggml-rpc-server on the control node too.
    gguf = tmp_path / "models" / "tiny.gguf"
    services = [
        service("chat", str(gguf), task="generation", engine="llamacpp", concurrency=2, gpus=[0]),
        service(
            "span", str(gguf), task="generation", engine="llamacpp", gpus=[1], nodes_per_worker=2, port=8200,
            gateway={"port": 8081},
        ),
    ]  # fmt: skip
    # One node: span's worker of 2 nodes is refused too, beside what these runs look for (a node more costs
    # each playbook run seconds); the run that passes leaves span out.
    node = {"fake1": gpu_node()}
    proc = playbook(tmp_path, [], node, inference_services=services, **GATEWAY)
    out = proc.stdout
    assert proc.returncode != 0, out[-3000:]
    for line in (
        f"FAIL control node: service chat: model: found no GGUF file {gguf} on the control node",
        "FAIL control node: inference_llamacpp_server: found none, expected the absolute path of llama.cpp's "
        "llama-server on the control node for service chat, span of engine llamacpp (scripts/build-llama-server "
        "builds it",
        "FAIL control node: inference_llamacpp_rpc_server: found none, expected the absolute path of llama.cpp's RPC "
        "server ggml-rpc-server on the control node for service span whose workers span nodes (nodes_per_worker)",
    ):
        assert line in out, line
    assert list((tmp_path / "written").iterdir()) == []
    # A binary that is not executable is refused too, and a missing ggml-rpc-server beside llama-server (the
    # role's default), and a file that is no GGUF (its header is read with the gguf package).
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + bytes(4096))
    server = tmp_path / "llama-server"
    server.write_text("#!/bin/sh\n")
    (tmp_path / "written").rename(tmp_path / "written-1")
    variables = {"inference_services": services, "inference_llamacpp_server": str(server), **GATEWAY}
    proc = playbook(tmp_path, [], node, **variables)
    assert proc.returncode != 0
    for line in (
        f"FAIL control node: inference_llamacpp_server: found {server}, which is not an executable",
        f"FAIL control node: inference_llamacpp_rpc_server: found {tmp_path}/ggml-rpc-server, which is not an "
        "executable file there",
        f"FAIL control node: service chat: model: {gguf}: found a file whose GGUF header cannot be read (Sorry, file "
        "appears to be version 0 which we cannot handle), expected a GGUF model file",
    ):
        assert line in proc.stdout, line
    server.chmod(0o755)
    # The tiny model's shape (2 layers, 2 KV heads of 32) in its header; a model_shape that differs is refused.
    write_gguf_header(gguf, layers=2, heads=2, head_dim=32)
    (tmp_path / "written").rename(tmp_path / "written-relative")
    misshaped = [{**services[0], "model_shape": {"layers": 2, "kv_heads": 4, "head_dim": 32}}, services[1]]
    relative = {**variables, "inference_llamacpp_server": "llama-server", "inference_services": misshaped}
    proc = playbook(tmp_path, [], node, **relative)
    for line in (
        "FAIL control node: inference_llamacpp_server: found 'llama-server', a relative path",
        f"FAIL control node: service chat: model_shape.kv_heads: found 4, expected 2, what the GGUF header of {gguf} "
        "says (llama.attention.head_count_kv)",
    ):
        assert line in proc.stdout, line
    (tmp_path / "written").rename(tmp_path / "written-2")
    proc = playbook(tmp_path, [], node, **{**variables, "inference_services": services[:1]})
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "inference placement passed: 1 services, chat" in proc.stdout
    # What the GPU holds is printed with the arithmetic, the KV cache counted by the shape in the GGUF's header
    # (issue 43 item 3).
    said = " ".join(proc.stdout.split())  # the YAML callback folds long lines
    for words in (
        f"fake1 GPU 0 ({RTX}, 24576 MiB): service chat: 502 MiB (layers 0-1 of 2 + the output layer on device 0",
        "KV cache 2 layers x 1 MiB (2 x 2 KV heads x 32 x 2 B x 4608 tokens) = 2 MiB + 500 MiB CUDA context) "
        "of 24.0 GiB",
    ):
        assert words in said, said[-3000:]


def test_a_bad_service_field_fails_naming_service_and_field(tmp_path):
    services = [service("embed", model(tmp_path, "minilm", MINILM), quantization="4-bit")]
    proc = playbook(tmp_path, [], {"fake1": gpu_node()}, inference_services=services)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "inference_services[0] (embed): quantization: found '4-bit', expected one of none, 8bit, 4bit" in out
    assert list((tmp_path / "written").iterdir()) == []


OPTIONS, KNOWN = inputs.load_specs(str(REPO / "roles"))


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ({"inference_servics": []}, "inference_servics: no role knows this variable: did you mean inference_services?"),
        ({"inference_services": {"name": "e"}}, "inference_services: expected a YAML list of mappings, found a map"),
        ({"inference_services": "embed"}, "inference_services: expected a YAML list of mappings, found a string"),
        ({"inference_service_defaults": "bfloat16"}, "node3: inference_service_defaults: expected dict"),
    ],
)  # fmt: skip
def test_inference_inputs_are_checked_like_every_roles(variables, expected):
    found = inputs.check_inputs("node3", variables, OPTIONS, KNOWN)
    assert len(found) == 1 and expected in found[0], found


def test_good_inference_inputs_pass():
    variables = {
        # Fields are checked by preflight's inference check (naming service and field), not here.
        "inference_services": [{"name": "embed", "model": "/srv/minilm", "task": "embeddings", "quantisation": "x"}],
        "inference_service_defaults": {"dtype": "bfloat16"},
        "inference_user": "alice",
        "inference_gateway_allow": ["10.0.0.0/24"],
        "inference_api_keys": {"ci": KEY, "batch": {"key": KEY, "rate_per_s": 5}},
    }
    assert inputs.check_inputs("node3", variables, OPTIONS, KNOWN) == []
