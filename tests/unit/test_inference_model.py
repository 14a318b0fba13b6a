"""The inference service model (plugins/plugin_utils/inference/): services filled with their
defaults and refused by field, workers placed on the GPUs no training job uses, the gateway's
upstreams, the model's memory need against each GPU, port clashes, quantisation, the worker's argv.
Each check is shown refusing a bad inventory and passing the mended one."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference import (
    checks,
    engines,
    gateway,
    gguf_header,
    memory,
    placement,
)
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference import keys as api_keys
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference import services as service_model
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.jobs import torchrun_jobs_normalize

REPO = Path(__file__).resolve().parents[2]
RTX = "NVIDIA GeForce RTX 3090"

# The shapes of real models' config.json (the numbers of the published files).
LLAMA_70B = {
    "model_type": "llama",
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "intermediate_size": 28672,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}
LLAMA_7B = {
    **LLAMA_70B,
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "intermediate_size": 11008,
}
MINILM = {  # sentence-transformers/all-MiniLM-L6-v2
    "model_type": "bert",
    "hidden_size": 384,
    "num_hidden_layers": 6,
    "num_attention_heads": 12,
    "intermediate_size": 1536,
    "vocab_size": 30522,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "hidden_act": "gelu",
}
GPT2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024, "vocab_size": 50257}


def gpu(index: int, name: str = RTX, mib: int = 24576, cc: str = "8.6") -> dict:
    return {
        "index": index,
        "name": name,
        "uuid": f"GPU-3090000{index}-5a1e-4c0d-9b7e-00000000000{index}",
        "memory_total_mib": mib,
        "compute_capability": cc,
    }


def node(address: str, gpus: int = 4, groups: tuple = ("inference_nodes", "gpu_nodes"), **extra) -> dict:
    return {
        "group_names": list(groups),
        "ansible_host": f"host-{address}",
        "ansible_facts": {
            "budgetgpu_gpus": {
                "driver": {"state": "loaded", "version": "550.54.14"},
                "count": gpus,
                "gpus": [gpu(i, **extra.pop("gpu", {})) for i in range(gpus)],
            },
            "budgetgpu_net": {"cluster_interface": {"name": "eth1", "address": address}},
        },
        **extra,
    }


HOSTS = ["node1", "node2"]


def hostvars(**overrides) -> dict:
    hv = {"node1": node("10.0.0.11"), "node2": node("10.0.0.12")}
    hv.update(overrides)
    return hv


def services(*items: dict, **kwargs) -> list[dict]:
    return service_model.inference_services_normalize(list(items), **kwargs)


def embed(**keys) -> dict:
    return {"name": "embed", "model": "/srv/models/minilm", "task": "embeddings", **keys}


def chat(**keys) -> dict:
    return {"name": "chat", "model": "/srv/models/llama", "task": "generation", **keys}


KEY = "0123456789abcdef0123456789abcdef"


def check(items: list[dict], hv: dict | None = None, jobs: list | None = None, configs: dict | None = None) -> list:
    return checks.inference_check(
        items, hv or hostvars(), HOSTS, jobs or [], configs or {}, api_keys={"ci": KEY}, cluster_subnet="10.0.0.0/24"
    )


def refused(*items, **kwargs) -> str:
    with pytest.raises(ValueError) as error:
        service_model.inference_services_normalize(list(items), **kwargs)
    return str(error.value)


# --- the defaults -----------------------------------------------------------------------------------


def test_the_argument_spec_documents_the_service_defaults_of_the_model():
    spec = yaml.safe_load((REPO / "roles/inference/meta/argument_specs.yml").read_text())
    options = spec["argument_specs"]["main"]["options"]["inference_services"]["options"]
    assert set(options) == service_model.SERVICE_KEYS
    documented = {
        key: options[key].get("default")
        for key in service_model.SERVICE_DEFAULTS
        if key not in service_model.NESTED_KEYS
    }
    for nested in service_model.NESTED_KEYS:
        documented[nested] = {key: sub.get("default") for key, sub in options[nested]["options"].items()}
    assert documented == service_model.SERVICE_DEFAULTS


def test_role_defaults_and_argument_spec_name_the_same_variables():
    spec = yaml.safe_load((REPO / "roles/inference/meta/argument_specs.yml").read_text())
    defaults = yaml.safe_load((REPO / "roles/inference/defaults/main.yml").read_text())
    assert set(defaults) == set(spec["argument_specs"]["main"]["options"])


def test_service_keys_win_over_service_defaults_over_the_shared_settings():
    got = services(
        embed(),
        chat(port=8200, gateway={"port": 9090}),
        defaults={"dtype": "bfloat16", "port": 8300, "gateway": {"host": "node2"}},
        user="alice",
        venv="/srv/venv",
    )
    assert [(s["dtype"], s["port"], s["user"], s["venv"]) for s in got] == [
        ("bfloat16", 8300, "alice", "/srv/venv"),
        ("bfloat16", 8200, "alice", "/srv/venv"),
    ]
    # The gateway merges key by key: the service's port, the defaults' host, the built-in allow.
    rest = {
        "allow": [],
        "listen": None,
        "keys": None,
        "rate_per_s": 100,
        "conns_per_client": 128,
        "conns_per_key": None,
    }
    assert got[1]["gateway"] == {"host": "node2", "port": 9090, **rest}
    assert got[0]["gateway"] == {"host": "node2", "port": 8080, **rest}
    assert got[0]["quantization"] == "none" and got[0]["gpus"] == "auto"
    assert got[0]["unit_template"] == "budgetgpu-infer-embed@.service"
    assert got[0]["model_dir"] == "/var/lib/budgetgpu/models/embed"
    assert got[0]["config_file"] == "/etc/budgetgpu/inference/embed.json"


def test_numbers_given_as_strings_are_numbers():
    got = services(embed(port="8200", concurrency="2", gateway={"port": "9000"}))[0]
    assert (got["port"], got["concurrency"], got["gateway"]["port"]) == (8200, 2, 9000)


def test_no_services_is_an_empty_list():
    assert (
        service_model.inference_services_normalize(None) == [] and service_model.inference_services_normalize([]) == []
    )


# --- what a tired person writes ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (embed(), "inference_services: found dict"),
        ("embed", "inference_services: found str 'embed', expected a list of services"),
    ],
)
def test_services_that_are_not_a_list_are_refused_by_name(value, expected):
    with pytest.raises(ValueError, match="expected a list of services") as error:
        service_model.inference_services_normalize(value)
    assert expected in str(error.value)


def test_a_mapping_of_services_is_told_to_become_a_list():
    with pytest.raises(ValueError, match="put a '-' before each service"):
        service_model.inference_services_normalize(embed())


@pytest.mark.parametrize(
    ("service", "expected"),
    [
        ({"model": "/m", "task": "embeddings"}, "inference_services[0]: name: found None, expected lower-case"),
        (embed(name="My Service"), "name: found 'My Service', expected lower-case letters"),
        ({"name": "embed", "task": "embeddings"}, "(embed): model: found None, expected a model directory"),
        (embed(model="models/minilm"), "model: found 'models/minilm', expected an absolute path on the control node"),
        ({"name": "embed", "model": "/m"}, "(embed): task: found None, expected one of embeddings, generation"),
        (embed(task="embedding"), "task: found 'embedding', expected one of embeddings, generation (did you mean"),
        (embed(quantisation="4bit"), "quantisation: unknown key (did you mean quantization?)"),
        (embed(quantization="4-bit"), "quantization: found '4-bit', expected one of none, 8bit, 4bit (did you mean"),
        (embed(dtype="fp16"), "dtype: found 'fp16', expected one of float32, float16, bfloat16"),
        (embed(port="eighty"), "port: found 'eighty', expected a whole number of 1 or more"),
        (embed(port=70000), "port: found 70000, expected a TCP port from 1 to 65535"),
        (embed(concurrency=0), "concurrency: found 0, expected a whole number of 1 or more"),
        (embed(gpus="all"), "gpus: found 'all', expected auto, a list of GPU indices"),
        (embed(gpus={"node1": "first"}), "gpus: found {'node1': 'first'}, expected for each host auto or a list"),
        (embed(gateway={"hots": "node1"}), "gateway.hots: unknown key (did you mean host?)"),
        (embed(gateway={"port": "http"}), "gateway.port: found 'http', expected a TCP port"),
        (embed(gateway={"allow": "10.0.0.0/8"}), "gateway.allow: found '10.0.0.0/8', expected a list of CIDRs"),
        (embed(gateway={"listen": "node1"}), "gateway.listen: found 'node1', expected an IP address"),
        (embed(gateway={"keys": "ci"}), "gateway.keys: found 'ci', expected a list of key names"),
        (embed(gateway={"rate_per_s": 0}), "gateway.rate_per_s: found 0, expected a whole number of 1 or more"),
        (embed(user="root"), "user: found root, an account of the system or of another service, expected a user"),
        (embed(nodes=""), "nodes: found '', expected an inventory group or a list of hosts"),
        (embed(engine="vlm"), "engine: found 'vlm', expected one of builtin, command"),
        (embed(engine="command"), "command: found '', expected an OpenAI-compatible server command with {port}"),
        (embed(engine="command", command="vllm serve {model}"), "expected an OpenAI-compatible server command"),
        (embed(engine="command", command="srv --port {port} --m {modle}"), "placeholder {modle} (did you mean model?)"),
        (embed(command="vllm serve {model} --port {port}"), "command: found 'vllm serve"),
    ],
)
def test_a_bad_field_is_refused_naming_service_field_found_and_expected(service, expected):
    assert expected in refused(service)


def test_every_bad_field_of_every_service_is_named_at_once():
    message = refused(embed(quantization="4-bit"), chat(port="x"), embed())
    assert "inference_services[0] (embed): quantization" in message
    assert "inference_services[1] (chat): port" in message
    assert "inference_services[2] (embed): name: found 'embed', expected a name no other service has" in message


def test_an_unknown_key_in_the_service_defaults_is_refused():
    assert "inference_service_defaults: quantisation: unknown key (did you mean quantization?)" in refused(
        embed(), defaults={"quantisation": "4bit"}
    )


def test_the_mended_services_pass():
    got = services(
        embed(quantization="none", gpus={"node1": [0], "node2": "auto"}, gateway={"allow": ["10.0.0.0/24"]}),
        chat(engine="command", command="vllm serve {model} --port {port}", nodes=["node1"]),
    )
    assert [s["name"] for s in got] == ["embed", "chat"]


# --- workers and upstreams --------------------------------------------------------------------------


def test_one_worker_per_gpu_pinned_by_uuid_on_its_own_port():
    service = services(embed(gpus=[1, 3]))[0]
    workers = placement.inference_workers(service, hostvars(), "node1", [])
    assert workers == [
        {
            "service": "embed",
            "host": "node1",
            "slot": 0,
            "gpu_index": 1,
            "gpu_uuid": "GPU-30900001-5a1e-4c0d-9b7e-000000000001",
            "gpu_indices": [1],
            "gpu_uuids": ["GPU-30900001-5a1e-4c0d-9b7e-000000000001"],
            "port": 8100,
            "address": "10.0.0.11",
            "unit": "budgetgpu-infer-embed@0.service",
        },
        {
            "service": "embed",
            "host": "node1",
            "slot": 1,
            "gpu_index": 3,
            "gpu_uuid": "GPU-30900003-5a1e-4c0d-9b7e-000000000003",
            "gpu_indices": [3],
            "gpu_uuids": ["GPU-30900003-5a1e-4c0d-9b7e-000000000003"],
            "port": 8101,
            "address": "10.0.0.11",
            "unit": "budgetgpu-infer-embed@1.service",
        },
    ]


def test_the_address_falls_back_to_ansible_host_then_the_name():
    service = services(embed(gpus=[0]))[0]
    hv = hostvars()
    del hv["node1"]["ansible_facts"]["budgetgpu_net"]
    assert placement.inference_workers(service, hv, "node1", [])[0]["address"] == "host-10.0.0.11"
    del hv["node1"]["ansible_host"]
    assert placement.inference_workers(service, hv, "node1", [])[0]["address"] == "node1"


def test_a_host_outside_the_service_has_no_workers():
    hv = hostvars(node3=node("10.0.0.13", groups=("gpu_nodes",)))
    assert placement.inference_workers(services(embed())[0], hv, "node3", []) == []
    assert placement.inference_workers(services(embed(nodes=["node2"]))[0], hv, "node1", []) == []


def upstreams(service: dict, hv: dict) -> list[str]:
    """The gateway's upstream addresses of a service, nothing recorded from a last run."""
    return [server["address"] for server in placement.inference_upstream_servers(service, hv, HOSTS, [])["servers"]]


def test_upstreams_list_every_worker_of_every_node():
    service = services(embed(gpus={"node1": [0, 1], "node2": [2]}))[0]
    assert upstreams(service, hostvars()) == [
        "10.0.0.11:8100",
        "10.0.0.11:8101",
        "10.0.0.12:8100",
    ]


def test_upstreams_of_an_ipv6_cluster_are_bracketed():
    service = services(embed(gpus=[0], nodes=["node1"]))[0]
    assert upstreams(service, hostvars(node1=node("fd00::11"))) == ["[fd00::11]:8100"]


def training(nproc, **keys) -> list[dict]:
    job = {"name": "pretrain", "script": "/srv/train.py", "nodes": "gpu_nodes", "nproc_per_node": nproc, **keys}
    return torchrun_jobs_normalize([job])


def test_auto_gpus_are_those_no_started_training_job_uses():
    service = services(embed())[0]
    workers = placement.inference_workers(service, hostvars(), "node1", training(2))
    assert [(w["gpu_index"], w["port"]) for w in workers] == [(2, 8100), (3, 8101)]
    # A stopped or disabled job uses no GPU; without jobs every GPU serves.
    for jobs in (training(2, state="stopped"), training(2, enabled=False), []):
        assert [w["gpu_index"] for w in placement.inference_workers(service, hostvars(), "node1", jobs)] == [0, 1, 2, 3]


def test_a_job_on_every_gpu_leaves_none_for_auto():
    service = services(embed())[0]
    problems = check([service], jobs=training("gpu"))
    assert "node1: service embed: gpus: found auto and no GPU left (training jobs use GPU 0 (pretrain)" in problems[0]
    with pytest.raises(ValueError, match="no GPU left"):
        placement.inference_workers(service, hostvars(), "node1", training("gpu"))
    assert check([service], jobs=training(3)) == []


def test_a_node_whose_driver_shows_no_gpu_has_none_for_auto():
    hv = hostvars(node2=node("10.0.0.12", gpus=0))
    assert check(services(embed()), hv) == [
        "node2: service embed: gpus: found auto and no GPU in gpu_facts, expected a GPU (is the driver loaded?)"
    ]


def test_a_gpu_a_training_job_uses_is_refused_not_dropped():
    jobs = training(2)
    bad = check(services(embed(gpus=[1, 2])), jobs=jobs)
    assert bad == [
        f"node{n} GPU 1 ({RTX}, 24576 MiB): service embed: gpus: found GPU 1, which training job pretrain uses "
        "(nproc_per_node), expected a GPU no started training job uses (or gpus: auto)"
        for n in (1, 2)
    ]
    assert check(services(embed(gpus=[2, 3])), jobs=jobs) == []


def test_a_gpu_index_the_node_lacks_is_refused():
    bad = check(services(embed(gpus={"node1": [4], "node2": [0]})))
    assert bad == ["node1: service embed: gpus: found GPU 4, expected a GPU index of node1 (0, 1, 2, 3)"]
    assert check(services(embed(gpus={"node1": [3], "node2": [0]}))) == []


def test_a_gpus_mapping_names_every_node_and_only_those():
    bad = check(services(embed(gpus={"node1": [0], "node9": [0]})))
    assert len(bad) == 2
    assert any("node2: service embed: gpus: found no entry for node2, expected auto or a list" in b for b in bad)
    assert "node9: service embed: gpus: found an entry for node9, expected nodes of the service" in bad
    assert check(services(embed(gpus={"node1": [0], "node2": "auto"}))) == []


def test_a_gpu_two_services_claim_is_refused():
    bad = check(services(embed(gpus=[0]), chat(gpus=[0, 1], port=8200, gateway={"port": 8081})))
    assert bad == [
        f"node{n} GPU 0 ({RTX}, 24576 MiB): service chat: gpus: found GPU 0, which service embed uses too, "
        "expected one service per GPU (give each service its own gpus list)"
        for n in (1, 2)
    ]
    assert check(services(embed(gpus=[0]), chat(gpus=[1, 2], port=8200, gateway={"port": 8081}))) == []


def test_a_node_without_probe_facts_is_refused():
    hv = hostvars()
    del hv["node2"]["ansible_facts"]["budgetgpu_gpus"]
    assert check(services(embed())) == []
    assert check(services(embed()), hv) == [
        "node2: service embed: gpus: found no GPU facts, expected budgetgpu_gpus from gpu_facts (run the probe first)"
    ]


def test_in_safe_mode_a_node_without_probe_facts_is_left_out():
    hv = hostvars()
    del hv["node2"]["ansible_facts"]["budgetgpu_gpus"]
    assert (
        checks.inference_check(
            services(embed()), hv, HOSTS, [], {}, unprobed_ok=True, api_keys={"ci": KEY}, cluster_subnet="10.0.0.0/24"
        )
        == []
    )


def test_hosts_and_gateway_outside_the_inventory_are_refused():
    bad = check(services(embed(nodes=["node1", "node7"], gateway={"host": "gw"})))
    assert "node7: service embed: nodes: found node7, expected a host of the inventory" in bad
    assert "gw: service embed: gateway.host: found gw, expected a host of the inventory" in bad
    assert check(services(embed(nodes=["node1", "node2"], gateway={"host": "node2"}))) == []


def test_the_gateway_is_the_first_node_unless_named():
    hv = hostvars()
    assert placement.inference_gateway_host(services(embed())[0], hv, HOSTS) == "node1"
    assert placement.inference_gateway_host(services(embed(gateway={"host": "node2"}))[0], hv, HOSTS) == "node2"


def test_an_empty_group_is_refused():
    assert check(services(embed(nodes="chat_nodes"))) == [
        "all: service embed: nodes: found 'chat_nodes' with no host, expected hosts"
    ]


def test_an_absent_service_is_not_checked():
    assert check(services(embed(gpus=[9], state="absent"))) == []


# --- memory -----------------------------------------------------------------------------------------


def params(config: dict) -> int:
    return memory.model_parameters(memory.model_shape(config))


@pytest.mark.parametrize(
    ("config", "expected"),
    [(LLAMA_70B, 69e9), (LLAMA_7B, 6.74e9), (MINILM, 22.7e6), (GPT2, 124.4e6)],
)
def test_parameters_are_counted_from_config_json(config, expected):
    assert abs(params(config) - expected) / expected < 0.05


def test_the_guides_70b_in_4bit_on_a_24_gb_3090_is_refused_with_the_arithmetic():
    service = services(chat(quantization="4bit", gpus=[0], nodes=["node1"]))
    bad = check(service, configs={"chat": LLAMA_70B})
    assert bad == [
        f"node1 GPU 0 ({RTX}, 24576 MiB): service chat: memory: needs 33.3 GiB (69.0e9 params x 0.5 B (4bit) = "
        "32.1 GiB + KV cache 720 MiB + 500 MiB CUDA context); expected at most 24.0 GiB (or more gpus_per_worker)"
    ]
    # A 7B model in 4 bits fits the same card.
    assert check(service, configs={"chat": LLAMA_7B}) == []


def test_the_guides_70b_in_4bit_for_8_requests_fits_four_3090s_in_one_worker():
    # The guide's inference example: about 35 GB of weights and 6 GB of KV cache for 8 concurrent
    # requests at the default context (2048 + 256 tokens), over 4 x 24 GB.
    four = services(chat(quantization="4bit", concurrency=8, gpus_per_worker=4, nodes=["node1"]))
    assert check(four, configs={"chat": LLAMA_70B}) == []
    need = memory.inference_memory_need(four[0], LLAMA_70B)
    assert 34e9 < need["weights_bytes"] < 36e9 and 5.5e9 < need["kv_cache_bytes"] < 6.5e9
    assert need["per_gpu_bytes"] == (need["weights_bytes"] + need["kv_cache_bytes"]) // 4 + 500 * 2**20
    assert need["total_bytes"] == need["weights_bytes"] + need["kv_cache_bytes"] + 4 * 500 * 2**20
    assert need["text"] == (
        "9.9 GiB on each of 4 GPUs (69.0e9 params x 0.5 B (4bit) = 32.1 GiB + KV cache 5.6 GiB, "
        "over 4 GPUs: 9.4 GiB each + 500 MiB CUDA context)"
    )
    workers = placement.inference_workers(four[0], hostvars(), "node1", [])
    assert [(w["slot"], w["gpu_indices"], w["port"]) for w in workers] == [(0, [0, 1, 2, 3], 8100)]
    # The same service on one card: refused, with the numbers.
    one = services(chat(quantization="4bit", concurrency=8, gpus=[0], nodes=["node1"]))
    assert check(one, configs={"chat": LLAMA_70B}) == [
        f"node1 GPU 0 ({RTX}, 24576 MiB): service chat: memory: needs 38.2 GiB (69.0e9 params x 0.5 B (4bit) = "
        "32.1 GiB + KV cache 5.6 GiB + 500 MiB CUDA context); expected at most 24.0 GiB (or more gpus_per_worker)"
    ]


def test_workers_of_two_gpus_take_whole_pairs_and_a_list_must_fill_them():
    pairs = placement.inference_workers(services(embed(gpus_per_worker=2))[0], hostvars(), "node1", [])
    assert [w["gpu_indices"] for w in pairs] == [[0, 1], [2, 3]]
    assert [w["gpu_uuid"] for w in pairs] == [w["gpu_uuids"][0] for w in pairs]
    assert check(services(embed(gpus=[0, 1, 2], gpus_per_worker=2, nodes=["node1"]))) == [
        "node1: service embed: gpus: found 3 GPU(s) [0, 1, 2], expected a multiple of gpus_per_worker 2 "
        "(each worker holds 2)"
    ]
    assert "gpus_per_worker: found 3, expected one of 1, 2, 4" in refused(embed(gpus_per_worker=3))


def test_a_command_engine_gets_the_workers_gpus_for_tensor_parallelism():
    command = "vllm serve {model} --port {port} --tensor-parallel-size {gpus} --x {gpu_uuids}"
    service = services(embed(engine="command", gpus_per_worker=2, command=command))[0]
    worker = placement.inference_workers(service, hostvars(), "node1", [])[1]
    argv = engines.inference_worker_command(service, worker)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[-1] == ",".join(worker["gpu_uuids"]) and len(worker["gpu_uuids"]) == 2


def test_the_memory_need_adds_weights_kv_cache_and_cuda_context():
    service = services(chat(quantization="4bit"))[0]
    need = memory.inference_memory_need(service, LLAMA_70B)
    assert need["bytes_per_param"] == 0.5
    assert need["weights_bytes"] == int(need["params"] * 0.5)
    # 2 (k and v) x 80 layers x 8 kv heads x 128 dims x (2048 + 256) tokens x 1 request x 2 bytes
    assert need["kv_cache_bytes"] == 2 * 80 * 8 * 128 * 2304 * 1 * 2
    assert need["overhead_bytes"] == 500 * 2**20
    assert need["total_bytes"] == need["weights_bytes"] + need["kv_cache_bytes"] + need["overhead_bytes"]


def test_concurrency_and_context_grow_the_kv_cache_and_embeddings_have_none():
    one = memory.inference_memory_need(services(chat())[0], LLAMA_7B)["kv_cache_bytes"]
    four = memory.inference_memory_need(services(chat(concurrency=4))[0], LLAMA_7B)["kv_cache_bytes"]
    assert four == 4 * one
    assert memory.inference_memory_need(services(embed())[0], MINILM)["kv_cache_bytes"] == 0


@pytest.mark.parametrize(
    ("keys", "per_param"),
    [
        ({"dtype": "float32"}, 4),
        ({"dtype": "bfloat16"}, 2),
        ({"quantization": "8bit"}, 1),
        ({"quantization": "4bit"}, 0.5),
    ],
)
def test_bytes_per_parameter_follow_dtype_or_quantisation(keys, per_param):
    assert memory.inference_memory_need(services(chat(**keys))[0], LLAMA_7B)["bytes_per_param"] == per_param


def test_the_kv_cache_of_quantised_weights_is_at_least_two_bytes():
    quantised = memory.inference_memory_need(services(chat(quantization="4bit"))[0], LLAMA_7B)
    plain = memory.inference_memory_need(services(chat())[0], LLAMA_7B)
    assert quantised["kv_cache_bytes"] == plain["kv_cache_bytes"]


def test_minilm_fits_anywhere():
    small = node("10.0.0.11", gpus=1, gpu={"mib": 2048, "name": "NVIDIA T400", "cc": "7.5"})
    assert check(services(embed(dtype="float32")), hostvars(node1=small), configs={"embed": MINILM}) == []


def test_a_float16_7b_on_a_small_card_is_refused():
    small = node("10.0.0.11", gpus=1, gpu={"mib": 12288, "name": "NVIDIA GeForce RTX 3060", "cc": "8.6"})
    bad = check(services(chat(nodes=["node1"])), hostvars(node1=small), configs={"chat": LLAMA_7B})
    assert len(bad) == 1 and "memory: needs 14.2 GiB (6.7e9 params x 2 B (float16) = 12.6 GiB" in bad[0]
    assert "expected at most 12.0 GiB" in bad[0]
    assert (
        check(services(chat(nodes=["node1"], quantization="8bit")), hostvars(node1=small), configs={"chat": LLAMA_7B})
        == []
    )


def test_a_missing_model_or_config_json_is_refused():
    bad = check(services(embed()), configs={"embed": None})
    assert bad == [
        "control node: service embed: model: found no /srv/models/minilm/config.json on the control node, "
        "expected a Hugging Face model directory (config.json, weights, tokenizer)"
    ]
    assert check(services(embed()), configs={"embed": ""}) == bad
    assert "config.json that is not JSON" in check(services(embed()), configs={"embed": "{not json"})[0]
    assert (
        "config.json: found no hidden_size or n_embd or d_model" in check(services(embed()), configs={"embed": {}})[0]
    )
    assert (
        check(
            services(embed()),
            configs={
                "embed": '{"model_type": "bert", "hidden_size": 384, "num_hidden_layers": 6, '
                '"num_attention_heads": 12, "vocab_size": 30522}'
            },
        )
        == []
    )


# --- quantisation -----------------------------------------------------------------------------------


def test_quantisation_on_a_simulated_node_is_refused():
    hv = hostvars(node1=node("10.0.0.11", budgetgpu_simulated=True))
    assert check(services(chat(quantization="4bit", nodes=["node1"], gpus=[0])), hostvars()) == []
    bad = check(services(chat(quantization="8bit", nodes=["node1"], gpus=[0])), hv)
    assert bad == [
        f"node1 GPU 0 ({RTX}, 24576 MiB): service chat: quantization: found 8bit on a simulated node (no CUDA), "
        "expected none: bitsandbytes 8bit/4bit runs only on a real CUDA GPU of compute capability 7.5 or more "
        "(the real-GPU path)"
    ]
    assert check(services(chat(nodes=["node1"], gpus=[0])), hv) == []


def test_quantisation_below_compute_capability_7_5_is_refused():
    old = node("10.0.0.11", gpus=1, gpu={"name": "Tesla P40", "cc": "6.1"})
    bad = check(services(chat(quantization="4bit", nodes=["node1"])), hostvars(node1=old))
    assert bad == [
        "node1 GPU 0 (Tesla P40, 24576 MiB): service chat: quantization: found 4bit on compute capability 6.1, "
        "expected compute capability 7.5 or more (bitsandbytes), or quantization none"
    ]
    turing = node("10.0.0.11", gpus=1, gpu={"name": "Tesla T4", "cc": "7.5"})
    assert check(services(chat(quantization="4bit", nodes=["node1"])), hostvars(node1=turing)) == []


# --- ports ------------------------------------------------------------------------------------------


def test_worker_ranges_of_two_services_that_overlap_are_refused():
    # embed takes 8100-8101 on each node; chat's 8101 lies inside.
    two = services(embed(gpus=[0, 1]), chat(gpus=[2, 3], port=8101, gateway={"port": 8081}))
    bad = check(two)
    assert bad[0] == (
        "node1: service chat workers: port: found 8101-8102, expected ports apart from 8100-8101 "
        "(service embed workers on node1); a service's workers use port .. port + GPUs - 1"
    )
    assert len(bad) == 2 and bad[1].startswith("node2: service chat workers")
    assert check(services(embed(gpus=[0, 1]), chat(gpus=[2, 3], port=8102, gateway={"port": 8081}))) == []


def test_a_worker_range_that_holds_the_gateway_port_is_refused():
    bad = check(services(embed(port=8079, gateway={"host": "node1"})))
    assert bad == [
        "node1: service embed gateway: gateway.port: found 8080, expected ports apart from 8079-8082 "
        "(service embed workers on node1); a service's workers use port .. port + GPUs - 1"
    ]
    assert check(services(embed(port=8081))) == []


def test_a_worker_range_that_holds_a_training_jobs_port_is_refused():
    jobs = training(1, port=8102)
    bad = check(services(embed()), jobs=jobs)
    assert bad[0] == (
        "node1: service embed workers: port: found 8100-8102, expected ports apart from 8102 "
        "(training job pretrain on node1); a service's workers use port .. port + GPUs - 1"
    )
    assert check(services(embed()), jobs=training(1)) == []


def test_the_head_of_a_llamacpp_worker_over_nodes_reserves_a_port_per_worker_for_its_own_rpc_server():
    # span: 2 workers over node1 (head) and node2, 8100-8101 on each; node1 also 8102-8103 for its own RPC servers,
    # used where its llama-server has no GPU device (placement.head_rpc_ports), so reserved whatever the build.
    span = llama(name="span", nodes_per_worker=2, gpus=[0, 1], gateway={"port": 8090})
    ports = [p for p in check(services(span, embed(gpus=[2], port=8103))) if "port: found" in p]
    assert ports == [
        "node1: service embed workers: port: found 8103, expected ports apart from 8102-8103 (service span RPC "
        "servers of its head (port + GPUs + slot) on node1); a service's workers use port .. port + GPUs - 1"
    ]
    # node2 serves no worker of its own: 8102 and above are free there, as they are on node1 past 8103.
    assert not [p for p in check(services(span, embed(gpus=[2], port=8104))) if "port: found" in p]


def test_two_gateways_on_one_port_of_one_host_are_refused():
    bad = check(services(embed(gpus=[0]), chat(gpus=[1], port=8200)))
    assert bad == [
        "node1: service chat gateway: gateway.port: found 8080, expected ports apart from 8080 "
        "(service embed gateway on node1); a service's workers use port .. port + GPUs - 1"
    ]
    assert check(services(embed(gpus=[0]), chat(gpus=[1], port=8200, gateway={"port": 8081}))) == []


# --- the worker's command ---------------------------------------------------------------------------


def worker(service: dict, host: str = "node1") -> dict:
    return placement.inference_workers(service, hostvars(), host, [])[1]


def test_the_builtin_worker_command():
    service = services(embed(), venv="/srv/venv")[0]
    argv = engines.inference_worker_command(service, worker(service), None, "/opt/budgetgpu/bin/inference_worker.py")
    assert argv == [
        "/srv/venv/bin/python3",
        "/opt/budgetgpu/bin/inference_worker.py",
        "--config",
        "/etc/budgetgpu/inference/embed.json",
        "--port",
        "8101",
        "--host",
        "10.0.0.11",
        "--worker-id",
        "node1-1",
    ]
    assert (
        engines.inference_worker_command(service, worker(service), "/usr/bin/python3", "/w.py")[0] == "/usr/bin/python3"
    )
    with pytest.raises(ValueError, match="worker_script: found none"):
        engines.inference_worker_command(service, worker(service))


def test_the_vllm_example_renders_one_server_per_gpu():
    command = (
        "vllm serve {model} --port {port} --host {host} --served-model-name {name} --max-model-len {max_input_tokens}"
    )
    service = services(chat(engine="command", command=command, venv="/srv/venv"))[0]
    assert engines.inference_worker_command(service, worker(service)) == [
        "vllm",
        "serve",
        "/var/lib/budgetgpu/models/chat",
        "--port",
        "8101",
        "--host",
        "10.0.0.11",
        "--served-model-name",
        "chat",
        "--max-model-len",
        "2048",
    ]


def test_command_values_are_quoted_not_split():
    service = services(
        chat(engine="command", command="srv --model {model} --port {port}"), model_root="/srv/my models"
    )[0]
    assert engines.inference_worker_command(service, worker(service)) == [
        "srv",
        "--model",
        "/srv/my models/chat",
        "--port",
        "8101",
    ]


@pytest.mark.parametrize("window", [-1, 1001, "soon", True])
def test_a_batch_window_outside_0_to_1000_ms_is_refused_by_name(window):
    said = r"batch_window_ms: found .*, expected milliseconds from 0 \(no batching\) to 1000"
    with pytest.raises(ValueError, match=said):
        service_model.inference_services_normalize([embed(batch_window_ms=window)])


def test_batching_defaults_and_the_kv_bound_a_batched_generate_gets():
    service = service_model.inference_services_normalize([embed(batch_window_ms="0.5")])[0]
    assert (service["batch_window_ms"], service["batch_max"]) == (0.5, 32)
    with pytest.raises(ValueError, match=r"batch_max: found 0, expected a whole number of 1 or more"):
        service_model.inference_services_normalize([embed(batch_max=0)])
    # One slot's KV cache, which preflight's memory arithmetic counts `concurrency` times.
    assert memory.inference_context_tokens({"max_input_tokens": 2048, "max_new_tokens": 256}) == 2304


# --- the filters ------------------------------------------------------------------------------------


def test_the_filters_wrap_the_model_and_fail_the_task_with_its_message():
    from ansible.errors import AnsibleFilterError
    from ansible_collections.budgetgpu.cluster.plugins.filter.inference import FilterModule

    filters = FilterModule().filters()
    assert set(filters) == {
        "inference_services_normalize",
        "inference_plan",
        "inference_gateway_host",
        "inference_check",
        "inference_memory_split",
        "inference_worker_command",
        "inference_rpc_server_command",
        "inference_rpc_wait_command",
        "inference_head_rpc",
        "inference_binary_problems",
        "inference_gguf_header",
        "inference_gateway_allow",
        "inference_firewall_ports",
        "inference_gateway_keys",
        "inference_vllm_venvs",
        "inference_vllm_wheelhouses",
        "inference_extra_requirements",
        "inference_user_problems",
    }
    assert filters["inference_services_normalize"]([embed()])[0]["port"] == 8100
    with pytest.raises(AnsibleFilterError, match=r"inference_services\[0\] \(embed\): quantization: found '4-bit'"):
        filters["inference_services_normalize"]([embed(quantization="4-bit")])


# --- the gateway (issue 28) --------------------------------------------------------------------------


def test_the_workers_run_as_a_user_of_their_own_by_default():
    assert services(embed())[0]["user"] == "budgetgpu-infer" != "budgetgpu"


def test_the_allow_list_is_the_services_then_the_roles_then_the_cluster_subnet():
    own, plain = services(embed(gateway={"allow": ["10.1.0.0/16"]}), chat(port=8200, gateway={"port": 8081}))
    assert gateway.inference_gateway_allow(own, ["10.2.0.0/16"], "10.0.0.0/24") == ["10.1.0.0/16"]
    assert gateway.inference_gateway_allow(plain, ["10.2.0.0/16"], "10.0.0.0/24") == ["10.2.0.0/16"]
    assert gateway.inference_gateway_allow(plain, [], "10.0.0.0/24") == ["10.0.0.0/24"]
    assert gateway.inference_gateway_allow(plain, [], "") == []


def test_preflight_refuses_a_gateway_whose_allow_list_is_empty():
    problems = checks.inference_check(services(embed()), hostvars(), HOSTS, [], {}, api_keys={"ci": KEY})
    assert problems == [
        "all: service embed: gateway.allow: found an empty allow list (no gateway.allow, no inference_gateway_allow, "
        "no budgetgpu_cluster_subnet), expected the CIDRs of the clients"
    ]
    assert checks.inference_check(services(embed(state="absent")), hostvars(), HOSTS, [], {}) == []


def test_preflight_refuses_a_gateway_without_a_key_and_bad_keys_without_showing_them():
    items = services(embed(gpus=[0]), chat(gpus=[1], port=8200, gateway={"port": 8081, "keys": ["nobody"]}))
    problems = checks.inference_check(items, hostvars(), HOSTS, [], {}, cluster_subnet="10.0.0.0/24")
    assert "all: service embed: gateway: found no API key, expected at least one in inference_api_keys" in problems[0]
    assert "all: service chat: gateway.keys: found nobody, expected names of inference_api_keys (none)" in problems[1]
    bad = {
        "ok": KEY,
        "short": "s3cret",
        "quoted": 'has "quotes" and spaces in it!',
        "slow": {"key": KEY, "rate_per_s": 0},
    }
    problems = checks.inference_check(
        services(embed()), hostvars(), HOSTS, [], {}, api_keys=bad, cluster_subnet="10.0.0.0/24"
    )
    assert problems == [
        "inference_api_keys.short: found a key of 6 characters (not shown), expected 24 to 256 of "
        "A-Z a-z 0-9 . _ ~ + / = - (e.g. openssl rand -hex 24)",
        "inference_api_keys.quoted: found a key of 30 characters (not shown), expected 24 to 256 of "
        "A-Z a-z 0-9 . _ ~ + / = - (e.g. openssl rand -hex 24)",
        "inference_api_keys.slow: rate_per_s: found 0, expected a whole number of 1 or more",
    ]
    assert not any("s3cret" in p or "quotes" in p for p in problems)


def test_gateway_keys_are_whole_header_patterns_with_their_rates():
    keys = {"alice": KEY, "batch": {"key": "A.b+c/d=e~f-" * 2, "rate_per_s": 2}, "other": "x" * 24}
    item = services(embed(gateway={"keys": ["batch", "alice"], "rate_per_s": 40}))[0]
    got = api_keys.inference_gateway_keys(item, keys)
    assert got == [
        {"name": "batch", "pattern": "^Bearer " + re.escape("A.b+c/d=e~f-" * 2) + "$", "rate_per_s": 2},
        {"name": "alice", "pattern": f"^Bearer {KEY}$", "rate_per_s": 40},
    ]
    assert re.fullmatch(got[0]["pattern"], "Bearer " + "A.b+c/d=e~f-" * 2)
    assert not re.fullmatch(got[0]["pattern"], "Bearer " + "a.b+c/d=e~f-" * 2)  # case counts
    with pytest.raises(ValueError, match="inference_api_keys.x: found a key of 3 characters") as error:
        api_keys.inference_gateway_keys(item, {"x": "abc"})
    assert "abc" not in str(error.value).replace("inference_api_keys", "")


def test_body_limits_follow_max_input_tokens_and_max_conns_is_concurrency_plus_queue():
    item = services(embed(max_input_tokens=512, concurrency=2, queue=16))[0]
    limits = gateway.inference_body_limits(item)
    assert limits["/v1/completions"] == limits["/v1/chat/completions"] == 512 * 8 + 65536
    assert limits["/v1/embeddings"] == min(2048 * 512, 300_000) * 8 + 65536
    assert limits["other"] == 65536
    assert gateway.inference_max_conns(item) == 18


# --- the gateway passes only what it serves, and a key holds part of the workers (issue 40) ---------


@pytest.mark.parametrize("engine", ["builtin", "vllm", "llamacpp", "command"])
def test_the_gateway_passes_the_openai_paths_of_the_task_and_only_content_type(engine):
    generation = services(chat(engine="builtin"))[0] | {"engine": engine}
    embeddings = services(embed())[0] | {"engine": engine}
    assert gateway.inference_gateway_routes(generation, 2)["paths"] == [
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
    ]
    assert gateway.inference_gateway_routes(embeddings, 2)["paths"] == ["/v1/models", "/v1/embeddings"]
    assert gateway.inference_gateway_routes(embeddings, 2)["methods"] == {
        "/health": ["GET", "HEAD"],
        "/v1/models": ["GET", "HEAD"],
        "/v1/embeddings": ["POST"],
    }
    # An allow-list: the key, X-Conversation-Id (llama-server goes on generating after the client left) and the
    # rest stay at the gateway.
    assert gateway.inference_gateway_routes(generation, 2)["headers"] == ["Content-Type"]


def test_a_key_holds_half_of_what_the_workers_admit_unless_set():
    item = services(chat(concurrency=2, queue=4))[0]  # 6 requests at a time per worker
    assert gateway.inference_gateway_routes(item, 4)["conns_per_key"] == 12  # 4 workers admit 24
    assert gateway.inference_gateway_routes(item, 1)["conns_per_key"] == 3
    assert gateway.inference_gateway_routes(services(chat(concurrency=1, queue=0))[0], 1)["conns_per_key"] == 1
    assert gateway.inference_gateway_routes(item, 0)["conns_per_key"] == 1  # no worker yet
    own = services(chat(gateway={"conns_per_key": "40"}))[0]
    assert own["gateway"]["conns_per_key"] == 40 and gateway.inference_gateway_routes(own, 4)["conns_per_key"] == 40


@pytest.mark.parametrize("value", [0, -1, "many", 1.5, True])
def test_a_bad_conns_per_key_is_refused(value):
    message = refused(chat(gateway={"conns_per_key": value}))
    assert f"inference_services[0] (chat): gateway.conns_per_key: found {value!r}, expected a whole number" in message


TRAINING = ["budgetgpu", "", "alice"]


@pytest.mark.parametrize(
    ("user", "expected"),
    [
        ("budgetgpu", "user: found budgetgpu, the training user (budgetgpu_user, torchrun_user or a job's user)"),
        ("alice", "user: found alice, the training user"),
        ("munge", "user: found munge, an account of the system or of another service"),
        ("slurm", "user: found slurm, an account of the system or of another service"),
        ("www-data", "user: found www-data, an account of the system or of another service"),
        ("prometheus", "user: found prometheus, an account of the system or of another service"),
        ("nobody", "user: found nobody, an account of the system or of another service"),
        ("root", "user: found root, an account of the system or of another service"),
        ("Bad User", "user: found 'Bad User', expected a user of the workers' own (default budgetgpu-infer"),
    ],
)
def test_a_service_user_that_is_a_training_user_or_another_services_account_is_refused(user, expected):
    message = refused(chat(user=user), training_users=TRAINING)
    assert message.startswith("inference_services[0] (chat): ") and expected in message, message
    # inference_user is the same check.
    assert expected in refused(chat(), user=user, training_users=TRAINING)


def test_a_user_of_the_workers_own_passes():
    assert services(chat(user="llm-workers"), training_users=TRAINING)[0]["user"] == "llm-workers"
    assert services(chat(), training_users=TRAINING)[0]["user"] == "budgetgpu-infer"


def test_on_the_node_an_existing_system_account_the_role_did_not_create_is_refused():
    items = services(chat(user="postgres"), embed(user="llm", gpus=[1]), chat(name="old", user="gone", state="absent"))
    accounts = {
        "postgres": {"uid": 112, "gecos": "PostgreSQL administrator"},
        "llm": {"uid": 998, "gecos": service_model.USER_COMMENT},
        "gone": {"uid": 5, "gecos": ""},
    }
    assert service_model.inference_user_problems(items, accounts, 1000, "node1") == [
        "node1: service chat: user: found postgres, an existing account of uid 112 (below UID_MIN 1000: the system's "
        "or another service's) that role inference did not create, expected a user of the workers' own: set the "
        "service's user (or inference_user) to a name that does not exist yet (default budgetgpu-infer), which the "
        "role creates"
    ]
    # Not there yet (the role creates it), an ordinary account the admin made, the role's own, or the default
    # user that releases before the comment created: accepted.
    ok = services(chat(user="fresh"), embed(user="svc", gpus=[1]), chat(name="c2", gpus=[2], port=8300))
    accounts = {"fresh": None, "svc": {"uid": 1001, "gecos": ""}, "budgetgpu-infer": {"uid": 997, "gecos": ""}}
    assert service_model.inference_user_problems(ok, accounts, 1000, "node1") == []
    # uid 0 under another name.
    assert (
        "uid 0" in service_model.inference_user_problems(ok[:1], {"fresh": {"uid": 0, "gecos": ""}}, 1000, "node1")[0]
    )


# --- engine vllm (issue 29) -------------------------------------------------------------------------


def vllm_chat(**vllm) -> dict:
    return chat(engine="vllm", vllm=vllm, nodes=["node1"])


def test_vllm_settings_merge_key_by_key_and_strings_become_numbers():
    got = services(
        vllm_chat(quantization="awq", max_model_len="4096"), defaults={"vllm": {"gpu_memory_utilization": "0.85"}}
    )
    assert got[0]["vllm"] == {
        "quantization": "awq",
        "max_model_len": 4096,
        "gpu_memory_utilization": 0.85,
        "venv": "/opt/budgetgpu/vllm-venv",
        "package": "vllm",
    }
    # Settings for vLLM in the shared defaults leave the other engines' services as they are.
    assert services(embed(), defaults={"vllm": {"gpu_memory_utilization": 2}})[0]["engine"] == "builtin"


@pytest.mark.parametrize(
    ("service", "expected"),
    [
        (
            chat(engine="vllm", quantization="4bit"),
            "quantization: found 4bit with engine vllm, expected none: 8bit/4bit",
        ),
        (vllm_chat(quantization="awk"), "vllm.quantization: found 'awk', expected one of none, awq, awq_marlin, gptq"),
        (vllm_chat(quantisation="awq"), "vllm.quantisation: unknown key (did you mean quantization?)"),
        (chat(engine="vllm", vllm="awq"), "vllm: found 'awq', expected a mapping with quantization, max_model_len"),
        (vllm_chat(gpu_memory_utilization=0), "vllm.gpu_memory_utilization: found 0, expected a share of each GPU"),
        (vllm_chat(gpu_memory_utilization=0.97), "gpu_memory_utilization: found 0.97, expected a share of each GPU's"),
        (vllm_chat(gpu_memory_utilization="most"), "vllm.gpu_memory_utilization: found 'most', expected a share"),
        (vllm_chat(gpu_memory_utilization=True), "vllm.gpu_memory_utilization: found True, expected a share"),
        (vllm_chat(max_model_len=0), "vllm.max_model_len: found 0, expected a whole number of tokens of 1 or more"),
        (
            vllm_chat(venv="/opt/budgetgpu/venv"),
            "vllm.venv: found '/opt/budgetgpu/venv', expected an absolute path apart",
        ),
        (vllm_chat(venv="vllm-venv"), "vllm.venv: found 'vllm-venv', expected an absolute path apart from venv"),
        (vllm_chat(package="vllm>=0.6"), "vllm.package: found 'vllm>=0.6', expected vllm or vllm==VERSION"),
        (chat(engine="vllm", command="vllm serve {model} --port {port}"), "expected none with engine vllm"),
    ],
)
def test_a_bad_vllm_setting_is_refused_naming_service_key_found_and_expected(service, expected):
    message = refused(service)
    assert expected in message and message.startswith("inference_services[0] (chat): ")


def test_a_misspelt_engine_is_pointed_at_vllm():
    assert "engine: found 'vlm', expected one of builtin, command, vllm" in refused(chat(engine="vlm"))
    assert "(did you mean vllm?)" in refused(chat(engine="vlm"))


def test_the_worker_gets_accelerate_to_span_gpus_and_bitsandbytes_to_load_in_8_or_4_bits():
    extra = checks.inference_extra_requirements
    assert extra(services(embed())) == []
    assert extra(services(chat(gpus_per_worker=2))) == ["requirements-split.txt"]
    assert extra(services(chat(quantization="4bit"))) == ["requirements-split.txt", "requirements-quant.txt"]
    assert extra(services(embed(), {**chat(quantization="8bit"), "port": 8200})) == [
        "requirements-split.txt",
        "requirements-quant.txt",
    ]
    assert extra(services(chat(quantization="4bit", state="absent"))) == []
    assert extra(services(vllm_chat(quantization="awq"))) == []  # vLLM's venv brings its own


def test_each_vllm_venv_is_listed_once_with_its_package_and_its_services():
    got = services(
        vllm_chat(),
        {**vllm_chat(package="vllm==0.11.0", venv="/opt/vllm-b/"), "name": "chat-b", "port": 8200},
        {**vllm_chat(), "name": "chat-c", "port": 8300},
        embed(port=8400),
        {**vllm_chat(package="vllm==0.10.0"), "name": "gone", "port": 8500, "state": "absent"},
    )
    assert checks.inference_vllm_venvs(got) == [
        {"venv": "/opt/budgetgpu/vllm-venv", "package": "vllm", "services": ["chat", "chat-c"]},
        {"venv": "/opt/vllm-b", "package": "vllm==0.11.0", "services": ["chat-b"]},
    ]
    assert checks.inference_vllm_venvs(services(embed())) == []


def test_one_vllm_venv_asked_for_two_packages_is_refused_naming_both_services():
    got = services(vllm_chat(), {**vllm_chat(package="vllm==0.11.0"), "name": "chat-b", "port": 8200})
    expected = (
        "service chat-b: vllm.package: found vllm==0.11.0, expected vllm as service chat asks for vllm.venv "
        "/opt/budgetgpu/vllm-venv (one venv holds one vLLM: give the service a vllm.venv of its own)"
    )
    assert expected in check(got)
    with pytest.raises(ValueError, match=re.escape(expected)):
        checks.inference_vllm_venvs(got)
    mended = services(vllm_chat(), {**vllm_chat(package="vllm==0.11.0", venv="/opt/vllm-b"), "name": "chat-b"})
    assert not [problem for problem in check(mended) if "vllm.package" in problem]


def test_the_mended_vllm_service_passes():
    got = services(vllm_chat(quantization="awq", gpu_memory_utilization=0.95, max_model_len=8192))
    assert got[0]["vllm"]["quantization"] == "awq" and got[0]["quantization"] == "none"


def test_vllm_serves_the_service_name_on_the_workers_port_over_its_gpus():
    service = services(
        chat(engine="vllm", gpus_per_worker=2, concurrency=16, dtype="bfloat16", vllm={"quantization": "awq"})
    )[0]
    argv = engines.inference_worker_command(service, worker(service), None, "/unused/inference_worker.py")
    assert argv == [
        "/opt/budgetgpu/vllm-venv/bin/vllm",
        "serve",
        "/var/lib/budgetgpu/models/chat",
        "--host",
        "10.0.0.11",
        "--port",
        "8101",
        "--served-model-name",
        "chat",
        "--tensor-parallel-size",
        "2",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "2304",
        "--max-num-seqs",
        "16",
        "--gpu-memory-utilization",
        "0.9",
        "--quantization",
        "awq",
    ]
    # No key on the command line (ps, the journal, systemctl show): the gateway checks the clients' keys.
    assert not any("key" in arg.lower() for arg in argv)


def test_vllm_without_quantisation_leaves_it_to_the_checkpoint_and_takes_max_model_len():
    service = services(vllm_chat(max_model_len=8192, venv="/srv/vllm/"))[0]
    argv = engines.inference_worker_command(service, worker(service))
    assert "--quantization" not in argv and argv[0] == "/srv/vllm/bin/vllm"
    assert argv[argv.index("--max-model-len") + 1] == "8192" and argv[argv.index("--tensor-parallel-size") + 1] == "1"


def test_vllm_on_a_simulated_node_or_an_old_gpu_is_refused_naming_host_and_gpu():
    simulated = hostvars(node1=node("10.0.0.11", budgetgpu_simulated=True))
    assert check(services(vllm_chat()), simulated) == [
        f"node1 GPU {i} ({RTX}, 24576 MiB): service chat: engine: found vllm on a simulated node (no CUDA), "
        "expected builtin: vLLM runs only on a real CUDA GPU (the built-in worker is the one that runs on "
        "simulated and CPU nodes)"
        for i in range(4)
    ]
    pascal = hostvars(node1=node("10.0.0.11", gpus=1, gpu={"name": "Tesla P100", "cc": "6.0"}))
    assert check(services(vllm_chat()), pascal) == [
        "node1 GPU 0 (Tesla P100, 24576 MiB): service chat: engine: found vllm on compute capability 6.0, expected "
        "compute capability 7.0 or more (vLLM's CUDA kernels), or engine builtin"
    ]
    volta = hostvars(node1=node("10.0.0.11", gpus=1, gpu={"name": "Tesla V100", "cc": "7.0"}))
    assert check(services(vllm_chat()), volta) == [] == check(services(vllm_chat()))


def test_vllm_on_a_node_without_a_gpu_is_refused():
    cpu = hostvars(node1=node("10.0.0.11", gpus=0))
    assert check(services(vllm_chat()), cpu) == [
        "node1: service chat: gpus: found auto and no GPU in gpu_facts, expected a GPU (is the driver loaded?)"
    ]


def test_vllm_must_fit_its_share_of_each_gpu():
    # 7B in float16 with its KV cache needs 14.2 GiB of a 16 GiB card: the built-in worker fits, vLLM
    # holding 0.85 of it (13.6 GiB) does not, at 0.95 (15.2 GiB) it does.
    card = hostvars(node1=node("10.0.0.11", gpus=1, gpu={"mib": 16384, "name": "NVIDIA RTX A4000", "cc": "8.6"}))
    configs = {"chat": LLAMA_7B}
    assert check(services(chat(nodes=["node1"])), card, configs=configs) == []
    assert check(services(vllm_chat(gpu_memory_utilization=0.85)), card, configs=configs) == [
        "node1 GPU 0 (NVIDIA RTX A4000, 16384 MiB): service chat: memory: needs 14.2 GiB (6.7e9 params x 2 B "
        "(float16) = 12.6 GiB + KV cache 1.1 GiB + 500 MiB CUDA context); expected at most 13.6 GiB "
        "(vllm.gpu_memory_utilization 0.85 of 16.0 GiB) (or more gpus_per_worker)"
    ]
    assert check(services(vllm_chat(gpu_memory_utilization=0.95)), card, configs=configs) == []


def test_the_guides_70b_in_awq_is_summed_over_the_workers_gpus():
    one = services(vllm_chat(quantization="awq"))
    bad = check(one, configs={"chat": LLAMA_70B})
    assert len(bad) == 4 and bad[0] == (
        f"node1 GPU 0 ({RTX}, 24576 MiB): service chat: memory: needs 33.3 GiB (69.0e9 params x 0.5 B (awq) = "
        "32.1 GiB + KV cache 720 MiB + 500 MiB CUDA context); expected at most 21.6 GiB "
        "(vllm.gpu_memory_utilization 0.9 of 24.0 GiB) (or more gpus_per_worker)"
    )
    # Over two 3090s each holds half the weights and the KV cache: 16.9 GiB of its 21.6.
    two = services(chat(engine="vllm", vllm={"quantization": "awq"}, nodes=["node1"], gpus_per_worker=2))
    assert check(two, configs={"chat": LLAMA_70B}) == []
    assert memory.inference_memory_need(two[0], LLAMA_70B)["text"].startswith("16.9 GiB on each of 2 GPUs")


def test_vllm_counts_the_checkpoints_own_quantisation():
    awq = {**LLAMA_70B, "quantization_config": {"quant_method": "awq", "bits": 4}}
    gptq8 = {**LLAMA_70B, "quantization_config": {"quant_method": "gptq", "bits": 8}}
    plain = services(vllm_chat())[0]
    assert memory.inference_memory_need(plain, awq)["bytes_per_param"] == 0.5
    assert "x 0.5 B (awq)" in memory.inference_memory_need(plain, awq)["text"]
    assert memory.inference_memory_need(plain, gptq8)["bytes_per_param"] == 1.0
    assert memory.inference_memory_need(plain, LLAMA_70B)["bytes_per_param"] == 2.0
    # The built-in engine loads such a checkpoint through transformers, not counted here: its own keys decide.
    assert memory.inference_memory_need(services(chat())[0], awq)["bytes_per_param"] == 2.0
    fp8 = services(vllm_chat(quantization="fp8"))[0]
    assert memory.inference_memory_need(fp8, LLAMA_70B)["bytes_per_param"] == 1.0


def test_vllm_max_model_len_sizes_the_kv_cache():
    default = memory.inference_memory_need(services(vllm_chat())[0], LLAMA_7B)["kv_cache_bytes"]
    long = memory.inference_memory_need(services(vllm_chat(max_model_len=9216))[0], LLAMA_7B)["kv_cache_bytes"]
    assert default == 2 * 32 * 32 * 128 * 2304 * 2 and long == 4 * default
    assert memory.inference_context_tokens(services(vllm_chat(max_model_len=9216))[0]) == 9216
    assert memory.inference_context_tokens(services(chat(vllm={"max_model_len": 9216}))[0]) == 2304


def llama(**keys) -> dict:
    return chat(**{"engine": "llamacpp", "model": "/srv/models/tiny-q4_k_m.gguf", **keys})


@pytest.mark.parametrize(
    ("service", "expected"),
    [
        (llama(model="/srv/models/llama"), "model: found '/srv/models/llama', expected a GGUF file (*.gguf)"),
        (llama(command="llama-server -m x --port {port}"), "expected none with engine llamacpp"),
        (llama(quantization="4bit"), "quantization: found 4bit with engine llamacpp, expected none"),
        (llama(concurrency=300), "concurrency: found 300, expected at most 256 llama-server slots (-np)"),
        (llama(max_input_tokens=600000, max_new_tokens=1000, concurrency=2), "found 1202000 tokens over 2 slots"),
    ],
)
def test_a_bad_llamacpp_service_is_refused_naming_key_found_and_expected(service, expected):
    message = refused(service)
    assert expected in message and message.startswith("inference_services[0] (chat): ")


def test_llamacpp_serves_the_gguf_with_one_slot_per_request_and_no_key():
    service = services(llama(concurrency=4, max_input_tokens=200, max_new_tokens=56))[0]
    assert service_model.llamacpp_context(service) == 1024  # (200 + 56) x 4 slots: llama-server splits -c over -np
    argv = engines.inference_worker_command(
        service, worker(service), None, None, "/usr/local/lib/budgetgpu/llama-server"
    )
    assert argv[:3] == [
        "/usr/local/lib/budgetgpu/llama-server",
        "--model",
        "/var/lib/budgetgpu/models/chat/tiny-q4_k_m.gguf",
    ]
    pairs = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert pairs["--alias"] == "chat" and pairs["--port"] == str(worker(service)["port"])
    assert pairs["--parallel"] == "4" and pairs["--ctx-size"] == "1024" and pairs["--n-predict"] == "56"
    assert "--metrics" in argv and "--tensor-split" not in argv and "--embeddings" not in argv
    # No /slots (read, save, erase another client's KV cache): issue 40.
    assert "--no-slots" in argv
    assert not any("key" in arg.lower() for arg in argv)


def test_llamacpp_splits_a_worker_over_its_gpus_and_needs_the_binary():
    service = services(llama(gpus_per_worker=2))[0]
    argv = engines.inference_worker_command(service, worker(service), None, None, "/opt/llama-server")
    assert argv[argv.index("--tensor-split") + 1] == "1,1"
    with pytest.raises(ValueError, match="llama_server: found none, expected llama-server's path"):
        engines.inference_worker_command(service, worker(service))


# --- role inference's plan of a service on a node (filter inference_plan) ----------------------------


def test_the_plan_gives_the_gateway_its_upstreams_address_rates_and_limits_and_a_node_its_workers():
    from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.plan import inference_plan

    keys = {"alice": KEY, "batch": {"key": "A.b+c/d=e~f-" * 2, "rate_per_s": 2}}
    item = services(embed(gpus=[0, 1], gateway={"host": "node1", "rate_per_s": 40}, concurrency=2, queue=4))[0]
    hv = hostvars()
    gateway_plan = inference_plan(item, hv, "node1", HOSTS, [], keys, [], "10.0.0.0/24")
    assert gateway_plan["workers"] == placement.inference_workers(item, hv, "node1", [])
    assert gateway_plan["is_gateway"] is True
    addresses = ["10.0.0.11:8100", "10.0.0.11:8101", "10.0.0.12:8100", "10.0.0.12:8101"]
    assert [server["address"] for server in gateway_plan["upstreams"]] == addresses
    assert upstreams(item, hv) == addresses
    # Each server names its node, which the gateway config records for the next run.
    assert [server["node"] for server in gateway_plan["upstreams"]] == ["node1", "node1", "node2", "node2"]
    assert (gateway_plan["stale"], gateway_plan["unknown"], gateway_plan["report"]) == ([], [], [])
    assert (gateway_plan["gateway_address"], gateway_plan["listen"]) == ("10.0.0.11", "10.0.0.11")
    assert gateway_plan["allow"] == ["10.0.0.0/24"]
    assert gateway_plan["rates"] == {2: ["batch"], 40: ["alice"]}
    assert gateway_plan["body_limits"] == gateway.inference_body_limits(item)
    assert gateway_plan["max_conns"] == 6
    assert gateway_plan["routes"] == gateway.inference_gateway_routes(item, 4)
    assert gateway_plan["context_tokens"] == memory.inference_context_tokens(item)
    assert (gateway_plan["model_dir"], gateway_plan["template"]) == (item["model_dir"], item["unit_template"])
    # Another node serves its own workers: no upstreams, no keys; the gateway's address is the same.
    node_plan = inference_plan(item, hv, "node2", HOSTS, [], keys)
    assert [w["address"] for w in node_plan["workers"]] == ["10.0.0.12", "10.0.0.12"]
    assert (node_plan["is_gateway"], node_plan["upstreams"], node_plan["rates"]) == (False, [], {})
    assert node_plan["gateway_address"] == "10.0.0.11"
    # Without a cluster address the gateway is reached at its ansible_host (nodes.node_address).
    del hv["node1"]["ansible_facts"]["budgetgpu_net"]
    assert inference_plan(item, hv, "node2", HOSTS, [], keys)["gateway_address"] == "host-10.0.0.11"


# --- llama.cpp: a worker over several nodes (RPC), layers and their KV cache on each GPU -------------

# The guide's 70B (Llama-2/3 70B's GGUF metadata: block_count 80, head_count_kv 8, 8192 / 64 heads) in
# Q4_K_M, 39.6 GiB, for 8 concurrent requests of 4096 tokens each (3584 in, 512 out): llama-server's
# -c 32768. Its KV cache: 2 x 8 x 128 x 2 B x 32768 tokens = 128 MiB a layer, 10 GiB in all.
SHAPE_70B = {"layers": 80, "kv_heads": 8, "head_dim": 128}
GGUF_70B = {"exists": True, "isreg": True, "size": int(39.6 * 2**30)}
KV_70B = "KV cache {} layers x 128 MiB (2 x 8 KV heads x 128 x 2 B x 32768 tokens)"


def guide_70b(**keys) -> dict:
    guide = {"model_shape": SHAPE_70B, "concurrency": 8, "max_input_tokens": 3584, "max_new_tokens": 512}
    return llama(model="/srv/models/llama-3-70b-instruct-q4_k_m.gguf", **{**guide, **keys})


def rig(nodes: int, gpus: int) -> dict:
    """nodes x gpus RTX 3090s (24 GiB), node1 first."""
    return {f"node{i + 1}": node(f"10.0.0.{11 + i}", gpus) for i in range(nodes)}


def guide_check(hv: dict, gguf: dict | None = None, **keys) -> tuple[list[str], list[str]]:
    """(preflight's problems, what each GPU holds) of the guide's 70B on hv; gguf: what preflight found of
    the GGUF file (its stat, and what its header says), else the file's size alone."""
    items, configs = services(guide_70b(**keys)), {"chat": gguf or GGUF_70B}
    problems = checks.inference_check(
        items, hv, list(hv), [], configs, api_keys={"ci": KEY}, cluster_subnet="10.0.0.0/24"
    )
    split = checks.inference_memory_split(items, hv, list(hv), [], configs)
    print("\n".join(split))  # pytest -s shows the split
    return problems, split


def held(host: str, gpu_index: int, text: str, gib: str) -> str:
    return f"{host} GPU {gpu_index} ({RTX}, 24576 MiB): service chat: {gib} ({text}) of 24.0 GiB"


def test_the_guides_70b_for_8_slots_fits_on_4_nodes_with_one_3090_each():
    problems, split = guide_check(rig(4, 1), nodes_per_worker=4)
    assert problems == []
    # llama.cpp puts the RPC servers' GPUs first (node2, node3, node4), then the head's: 81 layers (80 and
    # the output) by the split 1:1:1:1, each layer with its KV cache.
    weights = "on device {} of 4 of worker node1@0 (tensor split 1:1:1:1): GGUF 39.6 GiB x {}/81 layers = {} + "
    assert split == [
        held(
            "node1", 0, "layers 61-79 of 80 + the output layer " + weights.format(3, 20, "9.8 GiB")
            + KV_70B.format(19) + " = 2.4 GiB + 500 MiB CUDA context", "12.6 GiB",
        ),
        held(
            "node2", 0, "layers 0-20 of 80 " + weights.format(0, 21, "10.3 GiB") + KV_70B.format(21)
            + " = 2.6 GiB + 500 MiB CUDA context", "13.4 GiB",
        ),
        held(
            "node3", 0, "layers 21-40 of 80 " + weights.format(1, 20, "9.8 GiB") + KV_70B.format(20)
            + " = 2.5 GiB + 500 MiB CUDA context", "12.8 GiB",
        ),
        held(
            "node4", 0, "layers 41-60 of 80 " + weights.format(2, 20, "9.8 GiB") + KV_70B.format(20)
            + " = 2.5 GiB + 500 MiB CUDA context", "12.8 GiB",
        ),
    ]  # fmt: skip


def summary(line: str) -> str:
    """A line of inference_memory_split up to its figure and where the GPU's layers are."""
    return line[: line.index(": GGUF")]


def test_the_guides_70b_for_8_slots_fits_on_2_nodes_with_two_3090s_each():
    problems, split = guide_check(rig(2, 2), nodes_per_worker=2, gpus_per_worker=2)
    assert problems == []
    worker = "of 4 of worker node1@0 (tensor split 1:1:1:1)"
    assert [summary(line) for line in split] == [
        f"node1 GPU 0 ({RTX}, 24576 MiB): service chat: 12.8 GiB (layers 41-60 of 80 on device 2 {worker}",
        f"node1 GPU 1 ({RTX}, 24576 MiB): service chat: 12.6 GiB (layers 61-79 of 80 + the output layer on device 3 "
        f"{worker}",
        f"node2 GPU 0 ({RTX}, 24576 MiB): service chat: 13.4 GiB (layers 0-20 of 80 on device 0 {worker}",
        f"node2 GPU 1 ({RTX}, 24576 MiB): service chat: 12.8 GiB (layers 21-40 of 80 on device 1 {worker}",
    ]


def test_the_guides_70b_for_8_slots_is_refused_on_2_nodes_with_one_3090_each():
    problems, _split = guide_check(rig(2, 1), nodes_per_worker=2)
    hint = (
        "(or more nodes_per_worker or gpus_per_worker, a tensor_split that gives this GPU less, fewer slots "
        "(concurrency) or a shorter max_input_tokens + max_new_tokens)"
    )
    # The weights alone would fit (20.0 GiB + 500 MiB on node2): the KV cache of its 41 layers does not.
    assert problems == [
        f"node1 GPU 0 ({RTX}, 24576 MiB): service chat: memory: needs 24.9 GiB (layers 41-79 of 80 + the output "
        "layer on device 1 of 2 of worker node1@0 (tensor split 1:1): GGUF 39.6 GiB x 40/81 layers = 19.6 GiB + "
        f"{KV_70B.format(39)} = 4.9 GiB + 500 MiB CUDA context); expected at most 24.0 GiB {hint}",
        f"node2 GPU 0 ({RTX}, 24576 MiB): service chat: memory: needs 25.7 GiB (layers 0-40 of 80 on device 0 of 2 "
        "of worker node1@0 (tensor split 1:1): GGUF 39.6 GiB x 41/81 layers = 20.0 GiB + "
        f"{KV_70B.format(41)} = 5.1 GiB + 500 MiB CUDA context); expected at most 24.0 GiB {hint}",
    ]
    # Fewer slots fit: 4 of 4096 tokens hold half the KV cache.
    assert guide_check(rig(2, 1), nodes_per_worker=2, concurrency=4)[0] == []


# --- the model's shape from its GGUF header (the gguf package, llama.cpp's own reader) ---------------


def gguf_70b_header(path: Path, **metadata) -> dict:
    """Write a GGUF header without tensors with the guide's 70B metadata as llama.cpp's converter writes
    Llama 3 70B's (80 blocks, 64 heads of 8192 / 64 = 128, 8 KV heads; a key set to None is left out), and
    read it back as preflight does (filter inference_gguf_header)."""
    gguf = pytest.importorskip("gguf", reason="gguf (requirements.txt) is not installed")
    writer = gguf.GGUFWriter(str(path), "llama")
    numbers = {"block_count": 80, "embedding_length": 8192, "head_count": 64, "head_count_kv": 8, **metadata}
    for name, value in numbers.items():
        if value is not None:
            getattr(writer, f"add_{name}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf_header.gguf_header(str(path))


def test_the_model_shape_is_read_from_the_gguf_header(tmp_path):
    assert gguf_70b_header(tmp_path / "70b.gguf") == {
        "architecture": "llama",
        **SHAPE_70B,
        "keys": {
            "layers": "llama.block_count",
            "kv_heads": "llama.attention.head_count_kv",
            "head_dim": "llama.embedding_length / llama.attention.head_count",
        },
    }
    # key_length where the header gives it; without head_count_kv, as many KV heads as heads.
    header = gguf_70b_header(tmp_path / "other.gguf", head_count_kv=None, key_length=96)
    assert (header["kv_heads"], header["head_dim"]) == (64, 96)
    assert header["keys"]["kv_heads"] == "llama.attention.head_count"
    assert header["keys"]["head_dim"] == "llama.attention.key_length"
    # A header without them gives none, which model_shape may give.
    assert "kv_heads" not in gguf_70b_header(tmp_path / "bare.gguf", head_count_kv=None, head_count=None)


@pytest.mark.parametrize(
    ("hv", "keys"),
    [
        (rig(4, 1), {"nodes_per_worker": 4}),
        (rig(2, 2), {"nodes_per_worker": 2, "gpus_per_worker": 2}),
        (rig(2, 1), {"nodes_per_worker": 2}),
    ],
)
def test_the_guides_70b_placement_holds_with_the_shape_read_from_its_gguf_header(tmp_path, hv, keys):
    # The figures of docs/inference.md (the tests above, with model_shape) from the header alone, and a
    # model_shape equal to the header's changes nothing.
    found = {**GGUF_70B, **gguf_70b_header(tmp_path / "70b.gguf")}
    shaped = guide_check(hv, **keys)
    assert guide_check(hv, found, model_shape=None, **keys) == shaped
    assert guide_check(hv, found, **keys) == shaped


def test_a_model_shape_that_differs_from_the_gguf_header_is_refused(tmp_path):
    path = "/srv/models/llama-3-70b-instruct-q4_k_m.gguf"
    found = {**GGUF_70B, **gguf_70b_header(tmp_path / "70b.gguf")}
    problems, _split = guide_check(rig(4, 1), found, nodes_per_worker=4, model_shape={**SHAPE_70B, "kv_heads": 64})
    assert problems[0] == (
        f"control node: service chat: model_shape.kv_heads: found 64, expected 8, what the GGUF header of {path} "
        "says (llama.attention.head_count_kv): leave model_shape out, or make it the header's"
    )
    # What the header lacks, model_shape gives; a worker over nodes without either is refused.
    bare = {**GGUF_70B, **gguf_70b_header(tmp_path / "bare.gguf", head_count_kv=None, head_count=None)}
    assert guide_check(rig(4, 1), bare, nodes_per_worker=4) == guide_check(rig(4, 1), nodes_per_worker=4)
    problems, _split = guide_check(rig(4, 1), bare, nodes_per_worker=4, model_shape=None)
    assert problems == [
        "control node: service chat: model_shape: found none with nodes_per_worker 4, and no kv_heads, head_dim in "
        f"the GGUF header of {path}, expected {{layers, kv_heads, head_dim}} of the GGUF's model: llama.cpp splits a "
        "worker over its nodes by layer, with each layer's KV cache"
    ]


def test_a_gguf_file_that_cannot_be_read_or_no_gguf_package_is_refused_without_a_traceback(tmp_path, monkeypatch):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(64))
    pytest.importorskip("gguf", reason="gguf (requirements.txt) is not installed")
    assert gguf_header.gguf_header(str(bad)) == {
        "error": "found a file whose GGUF header cannot be read (Sorry, file appears to be version 0 which we cannot "
        "handle), expected a GGUF model file"
    }
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    missing = gguf_header.gguf_header(str(bad))
    problems, _split = guide_check(rig(1, 2), {**GGUF_70B, **missing}, gpus_per_worker=2)
    assert problems == [
        "control node: service chat: model: /srv/models/llama-3-70b-instruct-q4_k_m.gguf: found no Python package "
        f"gguf in the control node's Python {sys.executable}, expected it to read the GGUF header (llama.cpp's "
        f"reader): run {sys.executable} -m pip install -r requirements.txt (the collection's, which pins gguf)"
    ]


def test_a_worker_over_nodes_needs_ggml_rpc_server_on_the_control_node():
    spanning, single = services(guide_70b(nodes_per_worker=2)), services(guide_70b())
    tool = {"path": "/opt/llama/ggml-rpc-server", "exists": True, "isreg": True, "executable": True}
    server = {**tool, "path": "/opt/llama/llama-server"}
    assert checks.llama_server_problems(spanning, server, tool) == []
    assert checks.llama_server_problems(single, server, {"path": ""}) == []  # one node: no RPC server
    assert checks.llama_server_problems(spanning, server, {"path": tool["path"], "exists": False}) == [
        "control node: inference_llamacpp_rpc_server: found /opt/llama/ggml-rpc-server, which is not an executable "
        "file there, expected the absolute path of llama.cpp's RPC server ggml-rpc-server on the control node for "
        "service chat whose workers span nodes (nodes_per_worker) (scripts/build-llama-server builds it and prints "
        "its path)"
    ]


def test_the_single_node_llamacpp_check_counts_the_kv_cache():
    # A 20 GiB GGUF fits a 3090 by its weights; with 8 slots of 4096 tokens of the 70B's KV cache it does not.
    configs = {"chat": {**GGUF_70B, "size": 20 * 2**30}}
    hv = rig(1, 1)
    items = services(guide_70b())
    problems = checks.inference_check(
        items, hv, ["node1"], [], configs, api_keys={"ci": KEY}, cluster_subnet="10.0.0.0/24"
    )
    assert problems == [
        f"node1 GPU 0 ({RTX}, 24576 MiB): service chat: memory: needs 30.5 GiB (layers 0-79 of 80 + the output layer "
        "on device 0 of 1 of worker node1@0 (tensor split 1): GGUF 20.0 GiB x 81/81 layers = 20.0 GiB + "
        f"{KV_70B.format(80)} = 10.0 GiB + 500 MiB CUDA context); expected at most 24.0 GiB (or more "
        "nodes_per_worker or gpus_per_worker, a tensor_split that gives this GPU less, fewer slots (concurrency) or "
        "a shorter max_input_tokens + max_new_tokens)"
    ]
    # One slot of 4096 tokens (1.25 GiB) fits; without model_shape the check says what it could not count.
    assert (
        checks.inference_check(
            services(guide_70b(concurrency=1)),
            hv,
            ["node1"],
            [],
            configs,
            api_keys={"ci": KEY},
            cluster_subnet="10.0.0.0/24",
        )
        == []
    )
    unshaped = services(llama(concurrency=8, max_input_tokens=3584, max_new_tokens=512))
    assert checks.inference_memory_split(unshaped, hv, ["node1"], [], configs) == [
        f"node1 GPU 0 ({RTX}, 24576 MiB): service chat: 20.5 GiB (device 0 of 1 of worker node1@0 (tensor split 1): "
        "GGUF 20.0 GiB x 1/1 = 20.0 GiB + 500 MiB CUDA context; KV cache not counted: neither the GGUF header nor "
        "model_shape gives the model's shape) of 24.0 GiB"
    ]


def test_llamacpp_assigns_layers_as_llama_cpp_does():
    # Layer il of 81 (the 80 and the output) goes to the first device whose cumulative share exceeds il / 81.
    assert [len(layers) for layers in memory.llamacpp_layers([1, 1, 1, 1], 80)] == [21, 20, 20, 20]
    assert memory.llamacpp_layers([1, 1], 80)[1][-1] == 80  # the output layer on the last device, the head's
    assert [len(layers) for layers in memory.llamacpp_layers([3, 1], 80)] == [61, 20]
    assert memory.llamacpp_layers([0, 1], 2) == [[], [0, 1, 2]]


def test_a_worker_is_split_by_the_gpus_memory_or_the_services_tensor_split():
    # A 3090 and a 3060 (12 GiB) in one node: llama.cpp's default split follows memory, 2:1; the rendered
    # --tensor-split and the check say the same.
    hv = rig(1, 2)
    hv["node1"]["ansible_facts"]["budgetgpu_gpus"]["gpus"][1].update(
        name="NVIDIA GeForce RTX 3060", memory_total_mib=12288
    )
    item = services(guide_70b(gpus_per_worker=2))[0]
    worker_ = placement.inference_workers(item, hv, "node1", [], ["node1"])[0]
    assert (worker_["tensor_split"], worker_["rpc_servers"]) == ([2, 1], [])
    argv = engines.inference_worker_command(item, worker_, None, None, "/opt/llama-server")
    assert argv[argv.index("--tensor-split") + 1] == "2,1"
    assert [summary(line).split("(")[2] for line in guide_check(hv, gpus_per_worker=2)[1]] == [
        "layers 0-53 of 80 on device 0 of 2 of worker node1@0 ",
        "layers 54-79 of 80 + the output layer on device 1 of 2 of worker node1@0 ",
    ]
    # The service's own split wins, in the check and in the argv.
    item = services(guide_70b(gpus_per_worker=2, tensor_split=[3, 1]))[0]
    worker_ = placement.inference_workers(item, hv, "node1", [], ["node1"])[0]
    argv = engines.inference_worker_command(item, worker_, None, None, "/opt/llama-server")
    assert argv[argv.index("--tensor-split") + 1] == "3,1"
    assert "tensor split 3:1" in guide_check(hv, gpus_per_worker=2, tensor_split=[3, 1])[1][0]


def test_the_plan_names_each_workers_head_and_its_rpc_nodes_with_their_gpus():
    from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.plan import inference_plan

    hv = rig(2, 4)
    item = services(guide_70b(nodes_per_worker=2, gpus_per_worker=2))[0]
    head = inference_plan(item, hv, "node1", list(hv), [], {"ci": KEY}, [], "10.0.0.0/24")
    uuid = "GPU-3090000{0}-5a1e-4c0d-9b7e-00000000000{0}".format
    # Worker k takes the k-th pair of GPUs of each node; its RPC server on node2 listens on port + k.
    assert [(w["host"], w["slot"], w["port"], w["gpu_indices"], w["tensor_split"]) for w in head["workers"]] == [
        ("node1", 0, 8100, [0, 1], [1, 1, 1, 1]),
        ("node1", 1, 8101, [2, 3], [1, 1, 1, 1]),
    ]
    assert [w["rpc_servers"] for w in head["workers"]] == [
        [{"host": "node2", "slot": slot, "address": "10.0.0.12", "port": 8100 + slot,
          "gpu_indices": [2 * slot, 2 * slot + 1], "gpu_uuids": [uuid(2 * slot), uuid(2 * slot + 1)],
          "unit": f"budgetgpu-infer-chat.rpc@{slot}.service"}]
        for slot in (0, 1)
    ]  # fmt: skip
    assert head["rpc_template"] == "budgetgpu-infer-chat.rpc@.service"
    # Only the heads serve: the gateway's upstreams are theirs.
    assert head["upstreams"] == [
        {"address": "10.0.0.11:8100", "node": "node1"},
        {"address": "10.0.0.11:8101", "node": "node1"},
    ]
    rpc = inference_plan(item, hv, "node2", list(hv), [], {"ci": KEY}, [], "10.0.0.0/24")
    assert rpc["workers"] == []
    assert rpc["rpc_servers"] == [
        {**server, "service": "chat", "head": "node1", "head_address": "10.0.0.11"}
        for worker_ in head["workers"]
        for server in worker_["rpc_servers"]
    ]
    # A worker of one node has no RPC servers, and node1 runs none.
    assert head["rpc_servers"] == []
    single = inference_plan(services(guide_70b(gpus_per_worker=4))[0], hv, "node2", list(hv), [], {"ci": KEY})
    assert [(w["host"], w["rpc_servers"], w["tensor_split"]) for w in single["workers"]] == [
        ("node2", [], [1, 1, 1, 1])
    ]


def last_run_conf(*servers: tuple[str, str]) -> str:
    """The upstream block of a gateway config an earlier run wrote (nginx.conf.j2): (address, node) each."""
    line = "    server {} max_conns=6 max_fails=3 fail_timeout=5s;  # node {}".format
    lines = [line(address, node_) for address, node_ in servers]
    return "upstream budgetgpu_embed {\n    least_conn;\n" + "\n".join(lines) + "\n    keepalive 16;\n}\n"


def test_the_gateway_keeps_the_servers_of_a_node_without_facts_from_the_last_run_and_names_it():
    # Issue 40 item 7: node2 is down at the nightly run (no GPU facts) and node3 was never placed; node1's
    # workers are placed as usual, node2's servers of the last run are kept (stale), node3 is left out.
    from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.plan import inference_plan

    hosts = ["node1", "node2", "node3"]
    hv = hostvars(node3=node("10.0.0.13"))
    for down in ("node2", "node3"):
        del hv[down]["ansible_facts"]["budgetgpu_gpus"]
    item = services(embed(gpus=[0, 1], gateway={"host": "node1"}, concurrency=2, queue=4))[0]
    # node1's servers of the last run are its old placement: with facts, this run's placement wins.
    recorded = last_run_conf(("10.0.0.11:8100", "node1"), ("10.0.0.12:8100", "node2"), ("10.0.0.12:8101", "node2"))
    plan = inference_plan(item, hv, "node1", hosts, [], {"ci": KEY}, [], "10.0.0.0/24", recorded)
    assert plan["upstreams"] == [
        {"address": "10.0.0.11:8100", "node": "node1"},
        {"address": "10.0.0.11:8101", "node": "node1"},
        {"address": "10.0.0.12:8100", "node": "node2"},
        {"address": "10.0.0.12:8101", "node": "node2"},
    ]
    assert (plan["stale"], plan["unknown"]) == (["node2"], ["node3"])
    assert plan["report"] == [
        "node2: no GPU facts in this run (down or left out): the gateway of service embed keeps the servers of its "
        "workers from the last run (stale: NGINX passes their requests to the other workers; run again once it is up)",
        "node3: no GPU facts in this run (down or left out) and no earlier run placed its workers of service embed: "
        "the gateway leaves them out until a run reaches it",
    ]
    # The kept servers count in what the gateway admits, as they did (4 x 6 / 2 per key).
    assert plan["routes"]["conns_per_key"] == 12
    # Without a config of an earlier run (the first run, or one written before servers named their node).
    plan = inference_plan(item, hv, "node1", hosts, [], {"ci": KEY}, [], "10.0.0.0/24")
    assert (len(plan["upstreams"]), plan["stale"], plan["unknown"]) == (2, [], ["node2", "node3"])
    # A node with facts whose placement fails still fails the gateway.
    item = services(embed(gpus={"node1": [0, 1], "node2": [0], "node3": [7]}, gateway={"host": "node1"}))[0]
    hv["node3"] = node("10.0.0.13")
    with pytest.raises(ValueError, match="node3: service embed: gpus: found GPU 7"):
        inference_plan(item, hv, "node1", hosts, [], {"ci": KEY}, [], "10.0.0.0/24", recorded)


def test_a_spanning_worker_with_a_node_without_facts_keeps_its_heads_servers_of_the_last_run():
    from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.plan import inference_plan

    hv = rig(4, 4)
    del hv["node4"]["ansible_facts"]["budgetgpu_gpus"]  # the RPC node of node3's workers is down
    item = services(guide_70b(nodes_per_worker=2, gpus_per_worker=2))[0]
    recorded = last_run_conf(("10.0.0.13:8100", "node3"), ("10.0.0.13:8101", "node3"))
    gateway_plan = inference_plan(item, hv, "node1", list(hv), [], {"ci": KEY}, [], "10.0.0.0/24", recorded)
    assert [(s["address"], s["node"]) for s in gateway_plan["upstreams"]] == [
        ("10.0.0.11:8100", "node1"),
        ("10.0.0.11:8101", "node1"),
        ("10.0.0.13:8100", "node3"),
        ("10.0.0.13:8101", "node3"),
    ]
    assert (gateway_plan["stale"], gateway_plan["unknown"]) == (["node4"], [])
    # node1's own workers and node2's RPC servers are planned: node4 is not of their worker.
    assert [w["slot"] for w in gateway_plan["workers"]] == [0, 1]
    assert len(inference_plan(item, hv, "node2", list(hv), [], {"ci": KEY})["rpc_servers"]) == 2
    # node3, whose worker needs node4's GPUs, cannot place it.
    with pytest.raises(ValueError, match="node4: service chat: gpus: found no GPU facts"):
        inference_plan(item, hv, "node3", list(hv), [], {"ci": KEY})


def test_a_head_runs_llama_server_with_its_rpc_servers_in_device_order():
    # Before issue 43's units, a head with RPC servers was refused here; now it names them, node order, as
    # llama.cpp's --rpc takes them (their GPUs first in --tensor-split, then the head's own).
    hv = rig(3, 1)
    item = services(guide_70b(nodes_per_worker=3))[0]
    worker_ = placement.inference_workers(item, hv, "node1", [], list(hv))[0]
    argv = engines.inference_worker_command(item, worker_, None, None, "/opt/llama-server")
    assert argv[argv.index("--rpc") + 1] == "10.0.0.12:8100,10.0.0.13:8100"
    assert argv[argv.index("--tensor-split") + 1] == "1,1,1"
    # A worker of one node has none.
    single = placement.inference_workers(services(guide_70b())[0], hv, "node1", [], list(hv))[0]
    assert "--rpc" not in engines.inference_worker_command(item, single, None, None, "/opt/llama-server")


def test_an_rpc_server_listens_on_its_nodes_cluster_address_and_port_with_its_cache():
    hv = rig(2, 2)
    item = services(guide_70b(nodes_per_worker=2))[0]
    servers = placement.inference_rpc_servers(item, hv, "node2", list(hv), [])
    binary = "/usr/local/lib/budgetgpu/ggml-rpc-server"
    assert [engines.inference_rpc_server_command(server, binary) for server in servers] == [
        [binary, "--host", "10.0.0.12", "--port", str(8100 + slot), "--cache"] for slot in (0, 1)
    ]
    with pytest.raises(ValueError, match="service chat: rpc_server: found none, expected ggml-rpc-server's path"):
        engines.inference_rpc_server_command(servers[0], "")


def test_the_rpc_ports_admit_their_workers_head_alone_and_root_from_the_node():
    from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.plan import inference_plan

    hv = rig(4, 2)
    # Two workers of two nodes each: node1 heads node2's RPC servers, node3 heads node4's.
    item = services(guide_70b(nodes_per_worker=2, nodes=["node1", "node2", "node3", "node4"]))[0]
    rpc = inference_plan(item, hv, "node2", list(hv), [], {"ci": KEY}, [], "10.0.0.0/24")
    assert gateway.inference_firewall_ports([], [], ["monitor"], [], [rpc]) == [
        {
            "port": [8100, 8101],
            "what": "chat RPC servers of node1",
            "only": "the head node1 only",
            "hosts": ["node1"],
            "extra": ["10.0.0.11"],
            "inputs": "service chat: nodes and nodes_per_worker (a worker's head is its first node)",
            "local": [],
        }
    ]
    other = inference_plan(item, hv, "node4", list(hv), [], {"ci": KEY}, [], "10.0.0.0/24")
    assert [e["hosts"] for e in gateway.inference_firewall_ports([], [], ["monitor"], [], [other])] == [["node3"]]
    # A head opens no RPC port; an absent service none.
    head = inference_plan(item, hv, "node1", list(hv), [], {"ci": KEY}, [], "10.0.0.0/24")
    entries = gateway.inference_firewall_ports([head], [], ["monitor"], [], [])
    assert [e["what"] for e in entries if not e.get("client_only")] == ["chat workers"]
    # It checks its own node's users on their way to its RPC servers on node2 (client_only: no input rule).
    assert [(e["what"], e["port"], e["extra"], e["local"]) for e in entries if e.get("client_only")] == [
        ("chat RPC servers on node2", [8100, 8101], ["10.0.0.12"], [item["user"]])
    ]
    assert gateway.inference_firewall_ports([], [], ["monitor"], [], [{**rpc, "state": "absent"}]) == []


def test_a_llama_cpp_binary_of_another_build_is_named_with_node_path_and_both_digests():
    wanted = [
        {"item": {"src": f"/build/{name}", "dest": f"/usr/local/lib/budgetgpu/{name}"}, "stat": {"checksum": digest}}
        for name, digest in (("llama-server", "aa"), ("ggml-rpc-server", "bb"))
    ]
    found = [
        {"item": ["node1", "/usr/local/lib/budgetgpu/llama-server"], "stat": {"exists": True, "checksum": "aa"}},
        {"item": ["node1", "/usr/local/lib/budgetgpu/ggml-rpc-server"], "stat": {"exists": True, "checksum": "bb"}},
        {"item": ["node2", "/usr/local/lib/budgetgpu/ggml-rpc-server"], "stat": {"exists": True, "checksum": "cc"}},
        {"item": ["node3", "/usr/local/lib/budgetgpu/ggml-rpc-server"], "stat": {"exists": False}},
    ]
    advice = "(llama.cpp's RPC needs one build on every node of a worker: run playbooks/inference.yml on all of them)"
    assert checks.inference_binary_problems(found, wanted) == [
        "node2: /usr/local/lib/budgetgpu/ggml-rpc-server: found sha256 cc, expected sha256 bb, the control node's "
        f"/build/ggml-rpc-server {advice}",
        "node3: /usr/local/lib/budgetgpu/ggml-rpc-server: found no such file, expected sha256 bb, the control node's "
        f"/build/ggml-rpc-server {advice}",
    ]
    assert checks.inference_binary_problems(found[:2], wanted) == []


@pytest.mark.parametrize(
    ("service", "expected"),
    [
        (chat(nodes_per_worker=2), "nodes_per_worker: found 2 with engine builtin, expected 1: only engine llamacpp"),
        (llama(nodes_per_worker=0), "nodes_per_worker: found 0, expected a whole number of 1 or more"),
        (guide_70b(model_shape={"layers": 80, "kv_heads": 8}), "model_shape: found {'layers': 80, 'kv_heads': 8}, "),
        (guide_70b(model_shape={**SHAPE_70B, "head_dim": 0}), "expected {layers, kv_heads, head_dim} of the GGUF"),
        (chat(model_shape=SHAPE_70B), "model_shape: found {'layers': 80, 'kv_heads': 8, 'head_dim': 128} with engine"),
        (chat(tensor_split=[1, 1]), "tensor_split: found [1, 1] with engine builtin, expected none"),
        (
            guide_70b(nodes_per_worker=2, gpus_per_worker=2, tensor_split=[1, 1, 1]),
            "tensor_split: found [1, 1, 1], expected 4 shares of 0 or more, not all 0, one per GPU of a worker "
            "(nodes_per_worker 2 x gpus_per_worker 2) in llama-server's device order",
        ),
        (guide_70b(tensor_split=[0]), "tensor_split: found [0], expected 1 shares of 0 or more, not all 0"),
    ],
)
def test_a_bad_spanning_service_is_refused_naming_service_key_found_and_expected(service, expected):
    message = refused(service)
    assert expected in message and message.startswith("inference_services[0] (chat): ")


def test_the_nodes_of_a_spanning_service_must_form_whole_workers_of_nodes_with_gpus():
    def problems(hv: dict, **keys) -> list[str]:
        items = services(guide_70b(**keys))
        return checks.inference_check(items, hv, list(hv), [], {}, api_keys={"ci": KEY}, cluster_subnet="10.0.0.0/24")

    # More nodes than the group has.
    assert problems(rig(2, 1), nodes_per_worker=3) == [
        "all: service chat: nodes_per_worker: found 3, and the service has 2 node(s) (node1, node2 of nodes "
        "'inference_nodes'), expected at most 2"
    ]
    # A node past the last whole worker.
    assert problems(rig(3, 1), nodes_per_worker=2) == [
        "all: service chat: nodes_per_worker: found 2, and 3 nodes (node1, node2, node3), expected a multiple of 2: "
        "node3 would serve no worker"
    ]
    # A node without GPUs (the driver not loaded): named by the worker's check and by the placement's.
    hv = rig(2, 1)
    hv["node2"] = node("10.0.0.12", 0)
    assert problems(hv, nodes_per_worker=2) == [
        "node2: service chat: nodes_per_worker: found node2 with GPUs for 0 worker(s) in a worker of nodes node1, "
        "node2 (gpus_per_worker 1 each: node1 1, node2 0), expected the same number on every node of a worker: each "
        "worker takes gpus_per_worker GPUs of each of its nodes",
        "node2: service chat: gpus: found auto and no GPU in gpu_facts, expected a GPU (is the driver loaded?)",
    ]
    with pytest.raises(ValueError, match="node2: service chat: nodes_per_worker: found node2 with GPUs for 0"):
        placement.inference_workers(services(guide_70b(nodes_per_worker=2))[0], hv, "node1", [], list(hv))
    # Safe mode leaves a node without GPU facts out, as it does a node of a worker of one node.
    del hv["node2"]["ansible_facts"]["budgetgpu_gpus"]
    items = services(guide_70b(nodes_per_worker=2))
    assert checks.inference_check(items, hv, list(hv), [], {}, True, {"ci": KEY}, cluster_subnet="10.0.0.0/24") == []
    assert "node2: service chat: gpus: found no GPU facts" in "\n".join(problems(hv, nodes_per_worker=2))
    # Whole workers of nodes with GPUs pass.
    assert problems(rig(4, 1), nodes_per_worker=2) == []
