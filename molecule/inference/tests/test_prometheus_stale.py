"""A node that is down does not stop Prometheus' configuration (issue 40 item 7): playbooks/monitoring.yml run with
inference-node2 left out (no facts of it in the run, as a node switched off once its cached facts expired) keeps
node2's workers' targets of the converge's run in /etc/prometheus/prometheus.yml under a "# Stale:" comment, names
the node, and Prometheus still scrapes them. The scenario's last test: it leaves the config marked stale."""

from __future__ import annotations

import json
import subprocess

import yaml
from test_inference import GATEWAY, OTHER, sh

CONFIG = "/etc/prometheus/prometheus.yml"
TARGETS = """
import json, urllib.request
answer = json.loads(urllib.request.urlopen("http://127.0.0.1:9090/api/v1/targets", timeout=5).read())
print(json.dumps([t["labels"] for t in answer["data"]["activeTargets"]]))
"""


def inference_targets() -> list[dict]:
    """The static_configs of job inference in the Prometheus node's config."""
    config = yaml.safe_load(sh(GATEWAY, f"cat {CONFIG}"))
    return next(job["static_configs"] for job in config["scrape_configs"] if job["job_name"] == "inference")


def scraped_nodes() -> list[str]:
    """The node label of each of Prometheus' active inference targets."""
    proc = subprocess.run(
        ["docker", "exec", GATEWAY, "python3", "-c", TARGETS], capture_output=True, text=True, timeout=30, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return sorted(labels["node"] for labels in json.loads(proc.stdout) if labels.get("job") == "inference")


def test_a_node_without_facts_keeps_its_targets_marked_stale_and_the_run_goes_on(playbook) -> None:
    before, scraped = inference_targets(), scraped_nodes()
    assert OTHER in {config["labels"]["node"] for config in before}, before
    # Prometheus' play and the probe (node1 is probed; node2 is not in the run), not the exporters and Alertmanager
    # this scenario does not run.
    done = playbook("monitoring.yml", "--skip-tags", "node_exporter,alertmanager", "--limit", GATEWAY)
    assert done.returncode == 0, done.stdout[-3000:]
    said = f"{OTHER}: no GPU facts in this run (down or left out): Prometheus keeps the targets of its inference"
    assert said in done.stdout and f"{GATEWAY}: no GPU facts" not in done.stdout, done.stdout[-3000:]
    assert inference_targets() == before
    assert f"# Stale: {OTHER} had no facts in the run that wrote this" in sh(GATEWAY, f"cat {CONFIG}")
    assert scraped_nodes() == scraped
