"""A node's users are not trusted by its services (issue 40 item 2): on the Alertmanager and Prometheus node
a job (any local user but root and the prometheus user) cannot create a silence, nor reach Prometheus or
node exporter, on loopback or on the node's own address; Prometheus' user (Prometheus and Alertmanager run
as it) and root (Ansible, amtool) still can. Role firewall's chain output checks each new local connection's
socket owner. The silence it creates matches no alert and is expired at once: the later tests see none."""

from __future__ import annotations

import json
import os
import shlex

import testinfra.utils.ansible_runner

RUNNER = testinfra.utils.ansible_runner.AnsibleRunner(os.environ["MOLECULE_INVENTORY_FILE"])
testinfra_hosts = RUNNER.get_hosts("prometheus")

# Posts a silence (argv[2] == "silence") or GETs argv[1]; prints the silence's ID, the HTTP status or "refused".
CLIENT = r"""
import datetime, json, sys, urllib.error, urllib.request
url, what = sys.argv[1], sys.argv[2]
now = datetime.datetime.now(datetime.timezone.utc)
body = None
if what == "silence":
    body = json.dumps({
        "matchers": [{"name": "alertname", "value": "BudgetgpuLocalAccessProbe", "isRegex": False}],
        "startsAt": now.isoformat(), "endsAt": (now + datetime.timedelta(minutes=5)).isoformat(),
        "createdBy": "test_local_access", "comment": "issue 40: may a local user silence?",
    }).encode()
request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(request, timeout=10) as answer:
        print(json.loads(answer.read())["silenceID"] if what == "silence" else answer.status)
except urllib.error.HTTPError as err:
    print(err.code)
except (urllib.error.URLError, ConnectionError) as err:
    print("refused" if isinstance(getattr(err, "reason", err), ConnectionRefusedError) else repr(err))
"""


def as_user(host, user: str, url: str, what: str = "get") -> str:
    """Run CLIENT on the node as `user` (setpriv: that uid and group, no root, no other groups)."""
    group = host.check_output(f"id -gn {user}")
    prefix = "" if user == "root" else f"setpriv --reuid={user} --regid={group} --clear-groups "
    return host.check_output(f"{prefix}python3 -c {shlex.quote(CLIENT)} {shlex.quote(url)} {what}").strip()


def own_address(host) -> str:
    return host.check_output("ip -4 -o addr show scope global | awk '{print $4}' | cut -d/ -f1 | head -n1")


def test_a_job_on_the_alertmanager_node_cannot_create_a_silence_prometheus_user_and_root_can(host):
    for address in ("127.0.0.1", own_address(host)):
        silences = f"http://{address}:9093/api/v2/silences"
        assert as_user(host, "nobody", silences, "silence") == "refused", address
        # Alertmanager's own user (Prometheus posts alerts as it) and root, which runs amtool, still can.
        for user in ("prometheus", "root"):
            silence = as_user(host, user, silences, "silence")
            assert len(silence) == 36, (user, address, silence)
            host.check_output(f"curl -fsS -X DELETE http://127.0.0.1:9093/api/v2/silence/{silence}")
    active = json.loads(host.check_output("curl -fsS http://127.0.0.1:9093/api/v2/silences"))
    assert not [s for s in active if s["createdBy"] == "test_local_access" and s["status"]["state"] != "expired"]


def test_a_job_on_the_prometheus_node_reaches_neither_prometheus_nor_node_exporter(host):
    address = own_address(host)
    for url in (f"http://{address}:9090/api/v1/status/buildinfo", "http://127.0.0.1:9100/metrics"):
        assert as_user(host, "nobody", url) == "refused", url
        assert as_user(host, "prometheus", url) == "200", url
    for table in ("alertmanager", "prometheus", "metrics"):
        assert "meta skuid" in host.check_output(f"nft list chain inet budgetgpu_{table} output"), table
