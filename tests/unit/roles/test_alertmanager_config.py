"""Role alertmanager: its config rendered with the role's defaults and the inventory's receivers, the
night-sane timings, critical and warning routes, secrets in the file only; amtool (Debian's
prometheus-alertmanager; the probes scenario runs it there) checks it where it is installed. And the
URL other code posts alerts to."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import jinja2
import pytest
import yaml
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils import monitoring

REPO = Path(__file__).resolve().parents[3]
ROLE = REPO / "roles" / "alertmanager"
HOOK = "http://hooks.example/budgetgpu?token=s3cret"


def render(overrides: dict | None = None, name: str = "alertmanager.yml.j2") -> str:
    variables = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    variables.update(overrides or {})
    variables["_alertmanager_receivers"] = {
        "webhook": bool(variables["alertmanager_webhook_url"]),
        "email": bool(variables["alertmanager_email_to"]),
    }
    variables["_alertmanager_url"] = "http://10.0.0.5:9093"
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters["comment"] = lambda text: "#\n# " + text + "\n#"
    env.filters["to_json"] = json.dumps
    env.filters["bool"] = bool
    return env.from_string((ROLE / "templates" / name).read_text()).render(
        ansible_managed="Ansible managed", **variables
    )


EMAIL = {
    "alertmanager_webhook_url": HOOK,
    "alertmanager_email_to": "oncall@example.org",
    "alertmanager_smtp_smarthost": "smtp.example.org:587",
    "alertmanager_smtp_from": "budgetgpu@example.org",
    "alertmanager_smtp_auth_username": "budgetgpu",
    "alertmanager_smtp_auth_password": 'pa"ss',
}


def test_the_defaults_are_night_sane_with_critical_and_warning_routes():
    config = yaml.safe_load(render())
    route = config["route"]
    assert (route["group_wait"], route["group_interval"], route["repeat_interval"]) == ("30s", "5m", "12h")
    assert route["group_by"] == ["alertname", "instance"]
    routes = {tuple(r["matchers"]): r for r in route["routes"]}
    assert routes[('severity="critical"',)] == {
        "matchers": ['severity="critical"'],
        "receiver": "critical",
        "repeat_interval": "4h",
    }
    assert routes[('severity="warning"',)]["receiver"] == "warning"
    # Nothing named: the receivers exist and send nothing (the alerts stay in Alertmanager's UI).
    assert config["receivers"] == [{"name": "critical"}, {"name": "warning"}]
    assert "global" not in config


def test_the_inventorys_webhook_and_relay_receive_each_severity_they_are_named_for():
    config = yaml.safe_load(render({**EMAIL, "alertmanager_warning_receivers": ["webhook"]}))
    receivers = {r["name"]: r for r in config["receivers"]}
    assert receivers["critical"]["webhook_configs"] == [{"url": HOOK, "send_resolved": True}]
    assert receivers["critical"]["email_configs"] == [{"to": "oncall@example.org", "send_resolved": True}]
    assert "email_configs" not in receivers["warning"] and receivers["warning"]["webhook_configs"][0]["url"] == HOOK
    assert config["global"] == {
        "smtp_smarthost": "smtp.example.org:587",
        "smtp_from": "budgetgpu@example.org",
        "smtp_require_tls": True,
        "smtp_auth_username": "budgetgpu",
        "smtp_auth_password": 'pa"ss',
    }


def test_the_cluster_port_is_off_and_the_url_is_the_control_nodes():
    args = render(name="prometheus-alertmanager.default.j2")
    assert "--cluster.listen-address= " in args and "--web.listen-address=0.0.0.0:9093" in args
    assert "--web.external-url=http://10.0.0.5:9093" in args


def test_the_secrets_never_reach_ansibles_output():
    specs = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
    assert specs["alertmanager_webhook_url"]["no_log"] and specs["alertmanager_smtp_auth_password"]["no_log"]
    tasks = yaml.safe_load((ROLE / "tasks" / "configure.yml").read_text())
    writes = [task for task in tasks if task.get("ansible.builtin.template", {}).get("src") == "alertmanager.yml.j2"]
    assert writes[0]["no_log"] is True and writes[0]["ansible.builtin.template"]["mode"] == "0640"


def test_the_defaults_match_the_argument_specs():
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    specs = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
    assert {name: spec.get("default") for name, spec in specs.items()} == defaults
    assert defaults["alertmanager_listen_address"] == monitoring.ALERTMANAGER_LISTEN_ADDRESS


def test_the_url_other_code_posts_to():
    hostvars = {
        "mon": {"ansible_host": "192.168.1.5"},
        "mon2": {"ansible_host": "192.168.1.6", "alertmanager_listen_address": "10.0.0.6:9193"},
    }
    assert monitoring.alertmanager_url("mon", hostvars) == "http://192.168.1.5:9093"
    assert monitoring.alertmanager_url("mon2", hostvars) == "http://10.0.0.6:9193"
    assert monitoring.alertmanager_targets(["mon", "mon2"], hostvars) == ["192.168.1.5:9093", "10.0.0.6:9193"]


@pytest.mark.skipif(
    not shutil.which("amtool"), reason="amtool (Debian's prometheus-alertmanager) is not installed here"
)
@pytest.mark.parametrize("overrides", [{}, EMAIL], ids=["no receiver", "webhook and e-mail"])
def test_amtool_checks_the_config(tmp_path, overrides):
    (tmp_path / "alertmanager.yml").write_text(render(overrides))
    done = subprocess.run(
        ["amtool", "check-config", "alertmanager.yml"], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
