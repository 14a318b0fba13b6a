"""Role prometheus's scrape config: rendered with a node down, its inference workers' targets of the last run
stay in the file, marked stale, and the next run reads them back from it."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import yaml
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils import monitoring

ROLE = Path(__file__).resolve().parents[3] / "roles" / "prometheus"


def render(inference: dict) -> str:
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters["comment"] = lambda text: "#\n# " + text + "\n#"
    env.filters["to_json"] = json.dumps
    env.filters["budgetgpu.cluster.monitoring_scrape_targets"] = monitoring.scrape_targets
    variables = {
        "prometheus_scrape_interval": "30s",
        "prometheus_evaluation_interval": "30s",
        "prometheus_alertmanagers": [],
        "prometheus_scrape_hosts": [],
        "hostvars": {},
        "_prometheus_rules": "/etc/prometheus/budgetgpu.rules.yml",
        "_prometheus_port": 9090,
        "_prometheus_node_exporter_port": 9100,
        "_prometheus_inference": inference,
    }
    template = (ROLE / "templates" / "prometheus.yml.j2").read_text()
    return env.from_string(template).render(ansible_managed="Ansible managed", **variables)


def test_a_stale_nodes_targets_are_marked_and_read_back_by_the_next_run():
    kept = {"targets": ["10.0.0.11:8100"], "labels": {"node": "node1", "service": "chat", "slot": "0"}}
    fresh = {"targets": ["10.0.0.12:8100"], "labels": {"node": "node2", "service": "chat", "slot": "0"}}
    text = render({"configs": [kept, fresh], "stale": ["node1"], "unknown": [], "report": []})
    assert "# Stale: node1 had no facts in the run that wrote this (down or left" in text
    assert [job["job_name"] for job in yaml.safe_load(text)["scrape_configs"]] == ["prometheus", "node", "inference"]
    assert monitoring.recorded_inference_targets(text) == [kept, fresh]
    # Every node answered: no mark; no worker anywhere: no job.
    assert "Stale" not in render({"configs": [fresh], "stale": [], "unknown": [], "report": []})
    nothing = yaml.safe_load(render({"configs": [], "stale": [], "unknown": ["node1"], "report": []}))
    assert [job["job_name"] for job in nothing["scrape_configs"]] == ["prometheus", "node"]
