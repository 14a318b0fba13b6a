"""Role prometheus's rules: rendered with the role's defaults, every alert has a promtool test in
tests/prometheus/rules_test.yml with series that fire, every recording rule one per engine, the engines'
names the recording rules read are those the engines export, and promtool (Debian's prometheus package;
the probes scenario runs it there) checks and tests them where it is installed. render_rules() is what
the probes scenario's verifier writes beside the test file."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
from pathlib import Path

import jinja2
import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
ROLE = REPO / "roles" / "prometheus"
RULES_TEST = REPO / "tests" / "prometheus" / "rules_test.yml"
WORKER = REPO / "roles" / "inference" / "files" / "inference_worker.py"
DASHBOARD = ROLE / "files" / "grafana-dashboard.json"
# /metrics of llama.cpp's llama-server (a real run) and of vLLM (written from its code: it needs CUDA).
LLAMACPP_METRICS = REPO / "tests" / "fixtures" / "llamacpp-metrics.txt"
VLLM_METRICS = REPO / "tests" / "fixtures" / "vllm-metrics.txt"


def render_rules(overrides: dict | None = None) -> str:
    """Return the rules file as the role writes it, with its defaults (and overrides)."""
    variables = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    variables.update(overrides or {})
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters["comment"] = lambda text: "#\n# " + text + "\n#"
    template = env.from_string((ROLE / "templates" / "budgetgpu.rules.yml.j2").read_text())
    return template.render(ansible_managed="Ansible managed", **variables)


def _rules(text: str, kind: str) -> dict[str, dict]:
    return {rule[kind]: rule for group in yaml.safe_load(text)["groups"] for rule in group["rules"] if kind in rule}


def alerts(text: str) -> dict[str, dict]:
    return _rules(text, "alert")


def records(text: str) -> dict[str, dict]:
    return _rules(text, "record")


def read_names(exprs: list[str], prefix: str) -> set[str]:
    """The metric names with this prefix the expressions select (strings taken out: label values)."""
    text = " ".join(re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr) for expr in exprs)
    return set(re.findall(rf"(?<![\w:])({re.escape(prefix)}[\w:]*)", text))


def exposed_names(path: Path) -> set[str]:
    """The names of the samples of a /metrics text (comment lines left out)."""
    lines = path.read_text().splitlines()
    return {re.split(r"[{ ]", line, maxsplit=1)[0] for line in lines if line.strip() and not line.startswith("#")}


def test_every_alert_the_issue_asks_for_is_there_with_its_variables():
    rules = alerts(render_rules({"prometheus_alert_for": "7m", "prometheus_gpu_hot_c": 88}))
    assert set(rules) == {
        "BudgetgpuNodeDown",
        "BudgetgpuHealthWatchStale",
        "BudgetgpuUnitFailed",
        "BudgetgpuUnitRestarting",
        "BudgetgpuGpuTooHot",
        "BudgetgpuGpuFanDead",
        "BudgetgpuGpuLost",
        "BudgetgpuGpuQuarantined",
        "BudgetgpuGpuXid",
        "BudgetgpuPcieLinkBelowExpected",
        "BudgetgpuJobStraggler",
        "BudgetgpuJobSlowedDown",
        "BudgetgpuInferenceWorkerDown",
    }
    assert rules["BudgetgpuGpuTooHot"]["expr"] == "DCGM_FI_DEV_GPU_TEMP >= 88"
    assert rules["BudgetgpuNodeDown"]["for"] == "7m"
    assert all(rule["labels"]["severity"] in ("warning", "critical") for rule in rules.values())
    assert all("{{ $labels." in rule["annotations"]["summary"] for rule in rules.values())


def test_every_alert_has_a_promtool_test_that_fires():
    tested = {
        case["alertname"]
        for test in yaml.safe_load(RULES_TEST.read_text())["tests"]
        for case in test.get("alert_rule_test") or []
        if case["exp_alerts"]
    }
    assert tested == set(alerts(render_rules()))


def test_the_metrics_the_gpu_rules_read_are_the_ones_the_watch_writes():
    from ansible_collections.budgetgpu.cluster.plugins.module_utils import gpu_metrics, job_metrics

    text = render_rules()
    # The inference workers' names: test_the_builtin_names_the_recording_rules_read_are_the_ones_the_worker_exports.
    used = {name for name in re.findall(r"\b(DCGM_FI_DEV_\w+|budgetgpu_\w+)", text) if "inference" not in name}
    written = set(gpu_metrics.METRICS) | set(job_metrics.METRICS)
    assert used and used <= written, used - written


def test_the_job_rules_follow_their_variables():
    rules = alerts(render_rules({"prometheus_job_slowdown_ratio": 0.25, "prometheus_job_rate_window": "6h"}))
    slowed = rules["BudgetgpuJobSlowedDown"]
    assert slowed["expr"] == (
        "budgetgpu_job_steps_per_second < 0.25 * avg_over_time(budgetgpu_job_steps_per_second[6h])"
    )
    assert "under 25% of its average over the last 6h" in slowed["annotations"]["summary"]
    assert rules["BudgetgpuJobStraggler"]["for"] == "10m"


# What each engine's series begin with (the builtin worker's, llama.cpp's llama-server, vLLM).
ENGINES = {"builtin": "budgetgpu_inference_", "llamacpp": "llamacpp:", "vllm": "vllm:"}
RECORDED = "budgetgpu_inference:"


def test_every_recording_rule_has_a_promtool_test_for_each_engine():
    """One input set per engine; a record that reads an engine's series has samples for it, one that
    does not (no counterpart) none."""
    expected: dict[str, dict[str, list]] = {}
    for test in yaml.safe_load(RULES_TEST.read_text())["tests"]:
        if not test.get("promql_expr_test"):
            continue
        names = {series["series"].split("{")[0] for series in test["input_series"]}
        engines = [engine for engine, prefix in ENGINES.items() if any(n.startswith(prefix) for n in names)]
        assert len(engines) == 1, names
        expected.setdefault(engines[0], {}).update({c["expr"]: c["exp_samples"] for c in test["promql_expr_test"]})
    assert set(expected) == set(ENGINES)
    rules = records(render_rules())
    assert rules and all(name.startswith(RECORDED) for name in rules)
    for name, rule in rules.items():
        for engine, prefix in ENGINES.items():
            if read_names([rule["expr"]], prefix):
                assert expected[engine].get(name), f"{name}: no promtool test with {engine}'s series"
            else:
                assert expected[engine].get(name, []) == [], f"{name}: {engine} has no counterpart"


def test_the_engines_names_the_recording_rules_read_are_the_ones_they_export():
    exprs = [rule["expr"] for rule in records(render_rules()).values()]
    for prefix, fixture in (("llamacpp:", LLAMACPP_METRICS), ("vllm:", VLLM_METRICS)):
        used, exported = read_names(exprs, prefix), exposed_names(fixture)
        assert used and used <= exported, used - exported


def test_the_builtin_names_the_recording_rules_read_are_the_ones_the_worker_exports():
    from ansible_collections.budgetgpu.cluster.tests.unit.roles.test_grafana_dashboard import (
        _inference_worker_metrics,
    )

    used = read_names([rule["expr"] for rule in records(render_rules()).values()], ENGINES["builtin"])
    assert used and used <= _inference_worker_metrics(), used - _inference_worker_metrics()


def test_the_recorded_requests_are_those_of_the_builtins_model_endpoints():
    # Not /health, /metrics, /v1/models: the gateway's checks and Prometheus' scrapes would swamp them.
    assign = next(
        node
        for node in ast.parse(WORKER.read_text()).body
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["ENDPOINTS"]
    )
    endpoints = ast.literal_eval(assign.value)
    rules = records(render_rules())
    for name in (f"{RECORDED}requests:rate5m", f"{RECORDED}request_duration_seconds_bucket:rate5m"):
        pattern = re.search(r'endpoint=~"([^"]+)"', rules[name]["expr"]).group(1)
        counted = {endpoint for endpoint in endpoints if re.fullmatch(pattern, endpoint)}
        assert counted == {"/v1/completions", "/v1/chat/completions", "/v1/embeddings"}, name


def test_the_dashboards_inference_panels_read_only_recorded_series():
    """So they show every engine's workers: each recorded series on a panel, no engine's own name."""
    from ansible_collections.budgetgpu.cluster.tests.unit.roles.test_grafana_dashboard import metric_names

    panels = json.loads(DASHBOARD.read_text())["panels"]
    rows = [i for i, panel in enumerate(panels) if panel["type"] == "row"] + [len(panels)]
    start = next(i for i in rows if i < len(panels) and panels[i]["title"] == "Inference")
    inference = panels[start + 1 : next(i for i in rows if i > start)]
    read = {name for panel in inference for target in panel["targets"] for name in metric_names(target["expr"])}
    assert inference and read == set(records(render_rules())), read ^ set(records(render_rules()))


@pytest.mark.skipif(not shutil.which("promtool"), reason="promtool (Debian's prometheus) is not installed here")
def test_promtool_checks_and_tests_the_rules(tmp_path):
    (tmp_path / "budgetgpu.rules.yml").write_text(render_rules())
    shutil.copy(RULES_TEST, tmp_path)
    for argv in (["check", "rules", "budgetgpu.rules.yml"], ["test", "rules", "rules_test.yml"]):
        done = subprocess.run(["promtool", *argv], cwd=tmp_path, capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
