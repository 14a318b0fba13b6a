"""monitoring: Prometheus' targets at each node's cluster address (who may reach them: test_firewall.py)."""

from __future__ import annotations

import pytest
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.monitoring import (
    prometheus_url,
    scrape_targets,
)
from net_facts import HOSTVARS, net  # this folder, on the path pytest gives a test


def test_targets_are_the_cluster_addresses_labelled_with_the_inventory_name():
    assert scrape_targets(["node1", "node6", "control", "bare"], HOSTVARS, 9100) == [
        {"targets": ["10.0.0.11:9100"], "labels": {"instance": "node1"}},
        {"targets": ["[fd00::16]:9100"], "labels": {"instance": "node6"}},
        {"targets": ["192.168.1.5:9100"], "labels": {"instance": "control"}},
        {"targets": ["bare:9100"], "labels": {"instance": "bare"}},
    ]


def test_the_control_node_finds_prometheus_at_its_ansible_host_else_its_cluster_address_else_its_name():
    both = {"ansible_host": "192.168.1.7", "ansible_facts": HOSTVARS["node1"]["ansible_facts"]}
    hostvars = {**HOSTVARS, "both": both}
    assert prometheus_url("control", hostvars, "0.0.0.0:9090") == "http://192.168.1.5:9090"
    assert prometheus_url("both", hostvars, "0.0.0.0:9090") == "http://192.168.1.7:9090"
    assert prometheus_url("node1", hostvars, "[::]:9091") == "http://10.0.0.11:9091"
    assert prometheus_url("node6", hostvars, ":9090") == "http://[fd00::16]:9090"
    assert prometheus_url("bare", hostvars, "0.0.0.0:9090") == "http://bare:9090"


def test_a_prometheus_on_one_address_is_asked_there():
    assert prometheus_url("control", HOSTVARS, "10.0.0.5:9095") == "http://10.0.0.5:9095"
    assert prometheus_url("control", HOSTVARS, "[fd00::5]:9090") == "http://[fd00::5]:9090"


def test_inference_targets_are_the_workers_the_service_model_places():
    from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.placement import (
        inference_upstream_servers,
    )
    from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.services import (
        inference_services_normalize,
    )
    from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.monitoring import inference_scrape_targets

    def node(address: str, gpus: int) -> dict:
        facts = {
            "budgetgpu_net": net(address, chosen=address),
            "budgetgpu_gpus": {"gpus": [{"index": i, "uuid": f"GPU-{address}-{i}"} for i in range(gpus)]},
        }
        return {"ansible_facts": facts, "group_names": ["gpu_nodes", "serve"]}

    hostvars = {"node1": node("10.0.0.11", 2), "node2": node("10.0.0.12", 1)}
    hostvars["node1"]["group_names"].append("trainers")
    # node1's GPU 0 runs a training job: the service gets GPU 1 only there, as the inference role places it.
    hostvars["node1"]["budgetgpu_jobs"] = [
        {"name": "llm", "nodes": "trainers", "nproc_per_node": 1, "state": "started", "enabled": True}
    ]
    services = inference_services_normalize(
        [
            {"name": "chat", "model": "/m/chat", "task": "generation", "nodes": "serve", "port": 8100},
            {"name": "old", "model": "/m/old", "task": "generation", "nodes": "serve", "port": 8200, "state": "absent"},
        ]
    )
    found = inference_scrape_targets(services, hostvars, ["node1", "node2"])
    assert (found["stale"], found["unknown"], found["report"]) == ([], [], [])
    targets = found["configs"]
    # The gateway's upstreams, from the same model: the same workers.
    jobs = hostvars["node1"]["budgetgpu_jobs"]
    servers = inference_upstream_servers(services[0], hostvars, ["node1", "node2"], jobs)["servers"]
    assert [t["targets"][0] for t in targets] == [server["address"] for server in servers]
    assert [(t["targets"], t["labels"]["node"], t["labels"]["slot"]) for t in targets] == [
        (["10.0.0.11:8100"], "node1", "0"),
        (["10.0.0.12:8100"], "node2", "0"),
    ]
    assert targets[0]["labels"] == {
        "node": "node1",
        "service": "chat",
        "slot": "0",
        "unit": "budgetgpu-infer-chat@0.service",
        "gpu_uuid": "GPU-10.0.0.11-1",
    }
    assert inference_scrape_targets([], hostvars, ["node1"])["configs"] == []


# The inference job of a prometheus.yml an earlier run wrote: node1's worker of chat and of embed, node2's of chat.
RECORDED = """
scrape_configs:
  - job_name: prometheus
    static_configs:
      - targets: ["localhost:9090"]
  - job_name: inference
    static_configs: [
      {"targets": ["10.0.0.11:8100"], "labels": {"node": "node1", "service": "chat", "slot": "0",
       "unit": "budgetgpu-infer-chat@0.service", "gpu_uuid": "GPU-a"}},
      {"targets": ["10.0.0.11:8200"], "labels": {"node": "node1", "service": "embed", "slot": "0",
       "unit": "budgetgpu-infer-embed@0.service", "gpu_uuid": "GPU-a"}},
      {"targets": ["10.0.0.12:8100"], "labels": {"node": "node2", "service": "chat", "slot": "0",
       "unit": "budgetgpu-infer-chat@0.service", "gpu_uuid": "GPU-b"}}]
"""


def test_a_node_without_facts_keeps_its_last_targets_and_is_reported_stale_instead_of_stopping_the_config():
    from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.services import (
        inference_services_normalize,
    )
    from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.monitoring import inference_scrape_targets

    services = inference_services_normalize(
        [{"name": "chat", "model": "/m/chat", "task": "generation", "nodes": ["node1", "node2", "node9"], "port": 8100}]
    )
    # node1 is down (its cached facts expired), node9 is new and down; node2 answered this run.
    facts = {"budgetgpu_net": net("10.0.0.12", chosen="10.0.0.12"), "budgetgpu_gpus": {"gpus": [{"index": 0}]}}
    hostvars = {"node2": {"ansible_facts": facts}}
    found = inference_scrape_targets(services, hostvars, ["node1", "node2", "node9"], RECORDED)
    assert [(c["targets"], c["labels"]["node"], c["labels"]["service"]) for c in found["configs"]] == [
        (["10.0.0.11:8100"], "node1", "chat"),  # as the last run wrote it, gpu_uuid and all: Prometheus shows it down
        (["10.0.0.12:8100"], "node2", "chat"),
    ]
    assert found["configs"][0]["labels"]["gpu_uuid"] == "GPU-a"
    assert (found["stale"], found["unknown"]) == (["node1"], ["node9"])
    assert found["report"] == [
        "node1: no GPU facts in this run (down or left out): Prometheus keeps the targets of its inference workers "
        "from the last run (stale: run again once it is up)",
        "node9: no GPU facts in this run (down or left out) and no earlier run placed its inference workers: they "
        "are not scraped until a run reaches it",
    ]
    # No earlier config (the first run), or one that does not parse: the node is unknown, the others go on.
    for recorded in ("", "scrape_configs: [", None):
        found = inference_scrape_targets(services, hostvars, ["node1", "node2"], recorded)
        assert [c["labels"]["node"] for c in found["configs"]] == ["node2"]
        assert found["unknown"] == ["node1", "node9"]


def test_a_worker_over_two_nodes_keeps_its_heads_last_targets_while_either_node_is_down():
    from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.services import (
        inference_services_normalize,
    )
    from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.monitoring import inference_scrape_targets

    services = inference_services_normalize(
        [
            {"name": "chat", "engine": "llamacpp", "model": "/m/chat.gguf", "task": "generation",
             "nodes": ["node1", "node2"], "nodes_per_worker": 2, "port": 8100,
             "model_shape": {"layers": 2, "kv_heads": 2, "head_dim": 32}}
        ]
    )  # fmt: skip
    # node1, the head, answered; node2, its RPC node, is down: the worker's placement is not known.
    facts = {"budgetgpu_net": net("10.0.0.11", chosen="10.0.0.11"), "budgetgpu_gpus": {"gpus": [{"index": 0}]}}
    found = inference_scrape_targets(services, {"node1": {"ansible_facts": facts}}, ["node1", "node2"], RECORDED)
    assert [(c["targets"], c["labels"]["node"]) for c in found["configs"]] == [(["10.0.0.11:8100"], "node1")]
    assert (found["stale"], found["unknown"]) == (["node2"], [])


def test_a_node_with_facts_whose_placement_fails_still_fails():
    from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.services import (
        inference_services_normalize,
    )
    from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.monitoring import inference_scrape_targets

    services = inference_services_normalize(
        [{"name": "chat", "model": "/m/chat", "task": "generation", "nodes": ["node1"], "gpus": [3]}]
    )
    hostvars = {"node1": {"ansible_facts": {"budgetgpu_gpus": {"gpus": [{"index": 0}]}}}}
    with pytest.raises(ValueError, match="node1: service chat: gpus: found GPU 3, expected a GPU index of node1"):
        inference_scrape_targets(services, hostvars, ["node1"], RECORDED)


ALERTMANAGER = {
    "webhook_url": "",
    "email_to": "",
    "smtp_smarthost": "",
    "smtp_from": "",
    "critical_receivers": ["webhook", "email"],
    "warning_receivers": ["email"],
    "group_wait": "30s",
    "group_interval": "5m",
    "repeat_interval": "4h",
    "warning_repeat_interval": "1d",
    "retention": "120h",
}


def test_alertmanager_inputs_that_fit_have_no_problem():
    from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.monitoring import alertmanager_problems

    assert alertmanager_problems(ALERTMANAGER) == []
    mail = {"email_to": "oncall@example.org", "smtp_smarthost": "smtp.example.org:587", "smtp_from": "b@example.org"}
    assert alertmanager_problems({**ALERTMANAGER, "webhook_url": "https://hooks.example.org/T0K3N", **mail}) == []


def test_every_alertmanager_problem_names_its_variable_and_never_the_webhook():
    from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.monitoring import alertmanager_problems

    bad = {
        **ALERTMANAGER,
        "webhook_url": "hooks.example.org/s3cr3t",
        "email_to": "oncall@example.org",
        "smtp_smarthost": "smtp.example.org",
        "smtp_from": "budgetgpu",
        "warning_receivers": ["slack", "email", "slack"],
        "retention": "5 days",
    }
    problems = alertmanager_problems(bad)
    assert problems == [
        "alertmanager_webhook_url is not an http(s) URL, expected http(s)://HOST[:PORT]/PATH",
        'alertmanager_email_to is set, expected alertmanager_smtp_smarthost as HOST:PORT (found "smtp.example.org")'
        ' and an address in alertmanager_smtp_from (found "budgetgpu")',
        "alertmanager_*_receivers name slack, expected webhook or email",
        "alertmanager_retention is not a duration (30s, 5m, 4h)",
    ]
    assert "s3cr3t" not in " ".join(problems)
