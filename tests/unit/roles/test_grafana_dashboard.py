"""The Grafana dashboard role prometheus ships (roles/prometheus/files/grafana-dashboard.json): Grafana's
structure (panels with unique ids, a place on the grid, targets with an expr, the datasource a variable so
it imports into any Grafana), and every metric its queries name is one the project exports: a typo in a
name fails here, not on a user's empty panel."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from ansible_collections.budgetgpu.cluster.plugins.module_utils import energy, gpu_metrics, job_metrics

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "roles" / "prometheus" / "files" / "grafana-dashboard.json"
WORKER = ROOT / "roles" / "inference" / "files" / "inference_worker.py"
RULES = ROOT / "roles" / "prometheus" / "templates" / "budgetgpu.rules.yml.j2"

# The training jobs' metrics the panels must show (per-rank step time, its breakdown, straggler ratio, steps
# per second); the health watch writes these and more from rank 0's status (module_utils/job_metrics.py).
JOB_METRICS = {
    "budgetgpu_job_steps_per_second",
    "budgetgpu_job_straggler_ratio",
    "budgetgpu_job_step_seconds",
    "budgetgpu_job_step_breakdown_seconds",
}
# Prometheus' own series for each scrape (up) and node exporter's systemd collector, which role
# node_exporter turns on (the alert rules read the same names).
PROMETHEUS_AND_NODE_EXPORTER = {"up", "node_systemd_unit_state"}

PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or", "unless"}
PROMQL_WORDS |= {"inf", "nan"}


def _inference_worker_metrics() -> set[str]:
    """The names the inference worker's /metrics writes, from its own Metrics and StateCollector."""
    pytest.importorskip("fastapi", reason="the worker's packages (requirements-dev.txt) are not installed")
    spec = importlib.util.spec_from_file_location("inference_worker_names", WORKER)
    module = importlib.util.module_from_spec(spec)
    sys.modules["inference_worker_names"] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        metrics = module.Metrics()
        metrics.observe_request("/v1/completions", 200, 0.2)
        worker = SimpleNamespace(engine=None, admission=SimpleNamespace(waiting=0, running=0), metrics=metrics)
        metrics.registry.register(module.StateCollector(worker))
        text = metrics.render().decode()
    finally:
        sys.modules.pop("inference_worker_names", None)
    return {line.split("{")[0].split()[0] for line in text.splitlines() if line and not line.startswith("#")}


@pytest.fixture(scope="module", name="exported")
def fixture_exported() -> set[str]:
    return (
        set(gpu_metrics.METRICS)
        | set(job_metrics.METRICS)
        | _inference_worker_metrics()
        | PROMETHEUS_AND_NODE_EXPORTER
        | _rapl_reader_metrics()
        | _recorded_series()
    )


def _recorded_series() -> set[str]:
    """The series role prometheus's recording rules write (the inference panels read those, the same for
    every engine: tests/unit/roles/test_prometheus_rules.py checks what the rules read)."""
    return set(re.findall(r"^\s*- record: (\S+)$", RULES.read_text(), re.MULTILINE))


def _rapl_reader_metrics() -> set[str]:
    """The names role node_exporter's RAPL reader writes, from energy.rapl_samples itself."""
    zone = {"zone": "package-0", "energy_uj": 1, "max_energy_range_uj": 9}
    return {
        name
        for name, _labels, _value in energy.rapl_samples(energy.rapl_update(None, {"intel-rapl:0": zone}, 0, "b"), 200)
    }


@pytest.fixture(name="dashboard")
def fixture_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def metric_names(expr: str) -> set[str]:
    """Return the metric names a PromQL expression selects: strings, label matchers, durations, grouping
    lists, variables, numbers and function calls taken out first."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\$\{?\w+\}?", " ", text)
    text = re.sub(r"(?<![A-Za-z0-9_:])\d[\w.]*", " ", text)  # numbers and durations (0.95, 5m)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        word, rest = match.group(0), text[match.end() :].lstrip()
        if not rest.startswith("(") and word.lower() not in PROMQL_WORDS:
            names.add(word)
    return names


def queries(dashboard: dict) -> list[str]:
    """Every PromQL the dashboard runs: the panels' targets and the query variables."""
    exprs = [t["expr"] for p in _panels(dashboard) for t in p.get("targets") or []]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            exprs.append(re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", variable["definition"]))
    return exprs


def unknown_metrics(dashboard: dict, exported: set[str]) -> list[str]:
    return sorted({name for expr in queries(dashboard) for name in metric_names(expr)} - exported)


def _panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out += [panel, *(panel.get("panels") or [])]
    return out


def test_the_dashboard_has_grafanas_structure(dashboard):
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert all(isinstance(i, int) for i in ids) and len(ids) == len(set(ids)), ids
    for panel in panels:
        grid = panel["gridPos"]
        assert set(grid) == {"h", "w", "x", "y"} and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["type"] == "timeseries" and panel["title"] and panel["description"], panel["id"]
        assert panel["targets"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip() and target["expr"].count("(") == target["expr"].count(")"), target
            assert target["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]
    # No two panels share a cell of the grid.
    cells = [
        (x, y)
        for p in panels
        for x in range(p["gridPos"]["x"], p["gridPos"]["x"] + p["gridPos"]["w"])
        for y in range(p["gridPos"]["y"], p["gridPos"]["y"] + p["gridPos"]["h"])
    ]
    assert len(cells) == len(set(cells))


def test_the_datasource_is_a_variable_so_it_imports_into_any_grafana(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    text = DASHBOARD.read_text()
    # Every datasource is the variable: no uid of one Grafana's datasource is baked in.
    assert set(re.findall(r'"uid": "([^"]*)"', text)) == {"${DS_PROMETHEUS}", "budgetgpu-cluster"}
    assert "__inputs" not in dashboard  # nothing to answer at import: the variable picks the default Prometheus


def test_the_panels_the_issue_asks_for_are_there(dashboard):
    titles = {p["title"] for p in _panels(dashboard)}
    for title in ("GPU temperature", "GPU power draw and limit", "GPU utilisation", "Job steps per second"):
        assert title in titles
    assert {
        "Straggler ratio",
        "Inference request latency",
        "Fan speed and target",
        "PCIe link width",
        "Xid errors",
        "Node power: GPUs, CPU and the rest",
    } <= titles
    names = {name for expr in queries(dashboard) for name in metric_names(expr)}
    assert {"DCGM_FI_DEV_GPU_UTIL", "budgetgpu_inference:request_duration_seconds_bucket:rate5m"} | JOB_METRICS <= names
    assert {"budgetgpu_node_cpu_energy_joules_total", "budgetgpu_node_base_watts"} <= names


def test_every_metric_the_dashboard_asks_for_is_one_the_project_exports(dashboard, exported):
    assert unknown_metrics(dashboard, exported) == []


def test_a_typo_in_a_metric_name_is_found(dashboard, exported):
    broken = copy.deepcopy(dashboard)
    broken["panels"][1]["targets"][0]["expr"] = 'DCGM_FI_DEV_GPU_TEMPERATURE{instance=~"$node"}'
    broken["panels"][-1]["targets"][0]["expr"] = "sum by (instance) (rate(budgetgpu_job_step_second[5m]))"
    assert unknown_metrics(broken, exported) == ["DCGM_FI_DEV_GPU_TEMPERATURE", "budgetgpu_job_step_second"]


def test_metric_names_skip_functions_labels_durations_and_grouping():
    expr = (
        "histogram_quantile(0.95, sum by (le, instance) (rate(budgetgpu_inference_request_duration_seconds_bucket"
        '{instance=~"$node",endpoint!="/health"}[$__rate_interval]))) > on (instance) group_left up offset 5m'
    )
    assert metric_names(expr) == {"budgetgpu_inference_request_duration_seconds_bucket", "up"}


def test_the_alerts_the_panels_name_exist(dashboard):
    alerts = set(re.findall(r"alert: (\w+)", RULES.read_text()))
    named = {a for p in _panels(dashboard) for a in re.findall(r"\bBudgetgpu\w+", p.get("description", ""))}
    assert named and named <= alerts, named - alerts
