"""Role prometheus's alerting rules: rendered with the role's defaults, every alert has a promtool test
in tests/prometheus/rules_test.yml with series that fire, and promtool (Debian's prometheus package; the
probes scenario runs it there) checks and tests them where it is installed. render_rules() is what the
probes scenario's verifier writes beside the test file."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import jinja2
import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
ROLE = REPO / "roles" / "prometheus"
RULES_TEST = REPO / "tests" / "prometheus" / "rules_test.yml"


def render_rules(overrides: dict | None = None) -> str:
    """Return the rules file as the role writes it, with its defaults (and overrides)."""
    variables = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    variables.update(overrides or {})
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters["comment"] = lambda text: "#\n# " + text + "\n#"
    template = env.from_string((ROLE / "templates" / "budgetgpu.rules.yml.j2").read_text())
    return template.render(ansible_managed="Ansible managed", **variables)


def alerts(text: str) -> dict[str, dict]:
    return {rule["alert"]: rule for group in yaml.safe_load(text)["groups"] for rule in group["rules"]}


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
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert tested == set(alerts(render_rules()))


def test_the_metrics_the_gpu_rules_read_are_the_ones_the_watch_writes():
    from ansible_collections.budgetgpu.cluster.plugins.module_utils import gpu_metrics, job_metrics

    text = render_rules()
    used = set(__import__("re").findall(r"\b(DCGM_FI_DEV_\w+|budgetgpu_\w+)", text))
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


@pytest.mark.skipif(not shutil.which("promtool"), reason="promtool (Debian's prometheus) is not installed here")
def test_promtool_checks_and_tests_the_rules(tmp_path):
    (tmp_path / "budgetgpu.rules.yml").write_text(render_rules())
    shutil.copy(RULES_TEST, tmp_path)
    for argv in (["check", "rules", "budgetgpu.rules.yml"], ["test", "rules", "rules_test.yml"]):
        done = subprocess.run(["promtool", *argv], cwd=tmp_path, capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
