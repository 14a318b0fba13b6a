"""Who Prometheus scrapes: the node exporters' targets (each node's cluster address, the one net_facts
chose) and the inference workers' targets (the inference service model's own placement and ports:
plugin_utils/inference/placement.py inference_workers, never a second copy of them; who may scrape them is role
firewall's, plugin_utils/firewall.py); where the control node finds Prometheus' HTTP API
(playbooks/report.yml) and Alertmanager's (what posts alerts, amtool), and where Prometheus sends its
alerts. Controller side, pure over hostvars."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import yaml
from ansible_collections.budgetgpu.cluster.plugins.module_utils.netinfo import endpoint
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.placement import (
    inference_workers,
    worker_node_groups,
)
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.nodes import fact, host_var, node_address, node_gpus

# The defaults of the cluster-wide inputs budgetgpu_node_exporter_port and
# budgetgpu_node_exporter_textfile_dir, which roles node_exporter, prometheus and gpu_health read (each
# with this default in its vars/main.yml: tests/unit/roles/test_monitoring_inputs.py holds them equal).
NODE_EXPORTER_PORT = 9100
TEXTFILE_DIR = "/var/lib/prometheus/node-exporter"


def scrape_targets(hosts: list[str], hostvars: Mapping[str, Any], port: int) -> list[dict[str, Any]]:
    """Return Prometheus static_configs, one per host: its address (nodes.node_address: its cluster address,
    else ansible_host, else its name) and port, labelled instance=<inventory name> (alerts name the node as
    the inventory does)."""
    configs = []
    for host in hosts:
        address = node_address(hostvars, host)
        target = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
        configs.append({"targets": [target], "labels": {"instance": host}})
    return configs


# A listen address on every interface: the control node must pick one of the host's addresses itself.
_ANY_ADDRESS = ("", "0.0.0.0", "::", "[::]", "*")


# Role alertmanager's default alertmanager_listen_address (its defaults/main.yml: a unit test holds them equal).
ALERTMANAGER_LISTEN_ADDRESS = "0.0.0.0:9093"


def alertmanager_url(host: str, hostvars: Mapping[str, Any]) -> str:
    """Return http://ADDRESS:PORT of the Alertmanager on host (role alertmanager) as the control node
    reaches it, from that host's alertmanager_listen_address (else the role's default), as prometheus_url
    decides: what another program posts alerts to (POST <url>/api/v2/alerts) and amtool's
    --alertmanager.url."""
    listen = host_var(hostvars, host, "alertmanager_listen_address")
    return prometheus_url(host, hostvars, str(listen or ALERTMANAGER_LISTEN_ADDRESS))


def alertmanager_targets(hosts: list[str], hostvars: Mapping[str, Any]) -> list[str]:
    """Return ADDRESS:PORT of each host's Alertmanager, for Prometheus' alerting config
    (prometheus_alertmanagers): alertmanager_url without its scheme."""
    return [alertmanager_url(host, hostvars).split("//", 1)[1] for host in hosts or []]


def prometheus_url(host: str, hostvars: Mapping[str, Any], listen_address: str) -> str:
    """Return http://ADDRESS:PORT of Prometheus' HTTP API on host as the control node reaches it. The port
    and, when Prometheus listens on one address, the address are prometheus_listen_address's; on every
    address: the host's ansible_host (how the control node already reaches it), else its cluster address
    (net_facts), else its inventory name."""
    listen, _sep, port = str(listen_address).rpartition(":")
    address = listen.strip("[]") if listen not in _ANY_ADDRESS else node_address(hostvars, host, control=True)
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"


def recorded_inference_targets(config: str | None) -> list[dict[str, Any]]:
    """Return the static_configs of job inference in the prometheus.yml an earlier run wrote (its text; [] without
    one, or where it does not parse): the workers' targets as they were last known."""
    try:
        parsed = yaml.safe_load(config or "")
    except yaml.YAMLError:
        return []
    jobs = parsed.get("scrape_configs") if isinstance(parsed, Mapping) else None
    for job in jobs if isinstance(jobs, list) else []:
        # The job's name in roles/prometheus/templates/prometheus.yml.j2 (and the rules' up{job="inference"}).
        if isinstance(job, Mapping) and job.get("job_name") == "inference":
            configs = job.get("static_configs")
            return [dict(c) for c in configs or [] if isinstance(c, Mapping) and isinstance(c.get("labels"), Mapping)]
    return []


def inference_scrape_targets(
    services: list[Mapping[str, Any]] | None,
    hostvars: Mapping[str, Any],
    hosts: list[str],
    recorded: str | None = None,
) -> dict[str, Any]:
    """Return {configs, stale, unknown, report} of every inference worker of every service that is not absent
    (services normalised by inference_services_normalize). configs: Prometheus static_configs, each worker's
    address and port as the inference role places it (inference_workers, with the node's own budgetgpu_jobs, as
    the role reads them), labelled node (inventory name), service, slot, unit and gpu_uuid. A node without GPU
    facts in this run (down, its cached facts expired, or left out by --limit) keeps its workers' targets of the
    last configuration (recorded: the text of the prometheus.yml an earlier run wrote; a worker that spans nodes
    keeps its head's while any of them has none) and is named in stale: Prometheus shows them down, and one node
    down does not stop the configuration of the others. One that no earlier configuration holds is named in
    unknown (its workers' ports are not known: not scraped until a run reaches it). report: one line for each of
    those nodes."""
    configs, stale, unknown = [], [], []
    last_known = recorded_inference_targets(recorded)
    for service in services or []:
        if service.get("state") == "absent":
            continue
        name = str(service.get("name"))
        # A worker's target is on its head, the first node of the nodes it spans (one node: itself).
        for group in worker_node_groups(service, hostvars, hosts):
            head, down = group[0], [node for node in group if node_gpus(hostvars, node) is None]
            if down:
                kept = [c for c in last_known if (c["labels"].get("node"), c["labels"].get("service")) == (head, name)]
                configs += kept
                (stale if kept else unknown).extend(down)
                continue
            jobs = fact(hostvars, head, "budgetgpu_jobs") or []
            for worker in inference_workers(service, hostvars, head, jobs, hosts):
                labels = {
                    "node": head,
                    "service": str(worker["service"]),
                    "slot": str(worker["slot"]),
                    "unit": str(worker["unit"]),
                    "gpu_uuid": str(worker.get("gpu_uuid") or ""),
                }
                configs.append({"targets": [endpoint(worker["address"], worker["port"])], "labels": labels})
    stale, unknown = list(dict.fromkeys(stale)), list(dict.fromkeys(unknown))
    report = [
        f"{host}: no GPU facts in this run (down or left out): Prometheus keeps the targets of its inference workers "
        "from the last run (stale: run again once it is up)"
        for host in stale
    ] + [
        f"{host}: no GPU facts in this run (down or left out) and no earlier run placed its inference workers: they "
        "are not scraped until a run reaches it"
        for host in unknown
    ]
    return {"configs": configs, "stale": stale, "unknown": unknown, "report": report}


_DURATION = re.compile(r"([0-9]+(ms|s|m|h|d|w|y))+")
ALERTMANAGER_DURATIONS = (
    "alertmanager_group_wait",
    "alertmanager_group_interval",
    "alertmanager_repeat_interval",
    "alertmanager_warning_repeat_interval",
    "alertmanager_retention",
)


def alertmanager_problems(inputs: Mapping[str, Any]) -> list[str]:
    """Return every problem of role alertmanager's inputs ({variable without the alertmanager_ prefix:
    value}): a webhook that is not an http(s) URL (never shown: it may hold a token), e-mail without a
    relay HOST:PORT and a sender, a receiver that is neither webhook nor email, a duration Alertmanager
    cannot read."""
    problems = []
    webhook = str(inputs.get("webhook_url") or "")
    if webhook and not re.match(r"https?://[^/\s]+", webhook):
        problems.append("alertmanager_webhook_url is not an http(s) URL, expected http(s)://HOST[:PORT]/PATH")
    relay, sender = str(inputs.get("smtp_smarthost") or ""), str(inputs.get("smtp_from") or "")
    if inputs.get("email_to") and not (re.fullmatch(r"[^\s:]+:[0-9]+", relay) and "@" in sender):
        problems.append(
            f'alertmanager_email_to is set, expected alertmanager_smtp_smarthost as HOST:PORT (found "{relay}") and an '
            f'address in alertmanager_smtp_from (found "{sender}")'
        )
    receivers = list(inputs.get("critical_receivers") or []) + list(inputs.get("warning_receivers") or [])
    problems += [
        f"alertmanager_*_receivers name {name}, expected webhook or email"
        for name in dict.fromkeys(receivers)
        if name not in ("webhook", "email")
    ]
    return problems + [
        f"{name} is not a duration (30s, 5m, 4h)"
        for name in ALERTMANAGER_DURATIONS
        if not _DURATION.fullmatch(str(inputs.get(name.removeprefix("alertmanager_"))))
    ]
