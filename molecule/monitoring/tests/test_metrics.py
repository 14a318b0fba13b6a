"""Metrics for real: node exporter on every node (the health watch's GPU metrics in its textfile
directory, the budgetgpu units through its systemd collector), Debian's Prometheus on monitoring-nvml
scraping them, its HTTP API asked for every simulated GPU, a dead fan injected beneath the watch and
its alert seen firing; the promtool tests of the alerting rules run with the node's own promtool."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path

import testinfra.utils.ansible_runner

RUNNER = testinfra.utils.ansible_runner.AnsibleRunner(os.environ["MOLECULE_INVENTORY_FILE"])
testinfra_hosts = RUNNER.get_hosts("prometheus")

REPO = Path(os.environ.get("MOLECULE_PROJECT_DIRECTORY", "."))
GPUS_3090 = [f"GPU-3090000{i}-5a1e-4c0d-9b7e-00000000000{i}" for i in range(4)]
H200 = "GPU-0f7beba8-d2ad-9855-c2eb-a600187383a0"
FAULTS = "/etc/budgetgpu-sim/faults.json"
KERN_LOG = "/var/lib/budgetgpu-sim/kern.log"
WATCH = "systemctl start budgetgpu-gpu-health.service"
# Ask Prometheus' HTTP API on its own host (the API is not published outside the scenario's network).
GET = (
    "import sys, urllib.request; "
    "print(urllib.request.urlopen('http://localhost:9090/api/v1/' + sys.argv[1], timeout=10).read().decode())"
)


def api(host, path: str) -> dict:
    answer = json.loads(host.check_output(f"python3 -c {shlex.quote(GET)} {shlex.quote(path)}"))
    assert answer["status"] == "success", answer
    return answer["data"]


def query(host, promql: str) -> list[dict]:
    from urllib.parse import quote

    return api(host, "query?query=" + quote(promql))["result"]


def wait_for(what, ready, timeout: float = 60):
    """Return what() once ready(it), polling each second; fail with the last answer after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if ready(got) or time.monotonic() > deadline:
            assert ready(got), got
            return got
        time.sleep(1)


def alerts(host, name: str) -> list[dict]:
    return [alert for alert in api(host, "alerts")["alerts"] if alert["labels"]["alertname"] == name]


def test_prometheus_scrapes_every_node_and_the_gpu_metrics_of_every_simulated_gpu(host):
    # Debian's own config scraped localhost:9100 until the role's replaced it: that series stays for
    # Prometheus' 5 minutes of lookback (a restart writes no staleness marker); the role's are named.
    nodes = {"monitoring-3090", "monitoring-h200", "monitoring-nvml"}
    wait_for(lambda: query(host, 'up{job="node",instance=~"monitoring-.+"} == 1'), lambda got: len(got) == 3)
    temps = wait_for(lambda: query(host, "DCGM_FI_DEV_GPU_TEMP"), lambda got: len(got) == 5)
    assert {(s["metric"]["instance"], s["metric"]["UUID"]) for s in temps} == {
        *(("monitoring-3090", uuid) for uuid in GPUS_3090),
        ("monitoring-h200", H200),
    }
    models = {s["metric"]["UUID"]: s["metric"]["modelName"] for s in temps}
    assert models[H200] == "NVIDIA H200" and models[GPUS_3090[0]] == "NVIDIA GeForce RTX 3090"
    # The caps of role gpu_power, as NVML reports them to the watch.
    caps = {s["metric"]["UUID"]: float(s["value"][1]) for s in query(host, "DCGM_FI_DEV_POWER_MGMT_LIMIT")}
    assert caps == {GPUS_3090[0]: 280, GPUS_3090[1]: 280, GPUS_3090[2]: 280, GPUS_3090[3]: 250, H200: 500}
    # The riser card trained at x1 at boot and still is: no alert for it, and the expectation is exported.
    widths = query(host, 'budgetgpu_gpu_pcie_link_width_expected{instance="monitoring-3090"}')
    assert sorted(int(s["value"][1]) for s in widths) == [1, 4, 4, 16]
    # node exporter's systemd collector sees the budgetgpu units.
    timer = query(host, 'node_systemd_unit_state{name="budgetgpu-gpu-health.timer",state="active"} == 1')
    assert {s["metric"]["instance"] for s in timer} == nodes - {"monitoring-nvml"}


CONNECT = (
    "import socket, sys; s = socket.socket(); s.settimeout(5)\n"
    "try:\n s.connect((sys.argv[1], int(sys.argv[2]))); print('open')\n"
    "except ConnectionRefusedError:\n print('refused')"
)


def connect(address: str, port: int | str) -> str:
    return f"python3 -c {shlex.quote(CONNECT)} {shlex.quote(address)} {port}"


def node_addresses(host) -> dict[str, str]:
    targets = {t["labels"]["instance"]: t["scrapeUrl"] for t in api(host, "targets")["activeTargets"]}
    return {name: url.split("//")[1].split("/")[0].rsplit(":", 1)[0] for name, url in targets.items()}


def test_node_exporter_answers_prometheus_only(host):
    probe = connect(node_addresses(host)["monitoring-h200"], 9100)
    assert host.check_output(probe) == "open"  # from Prometheus' host
    assert RUNNER.get_host("monitoring-3090").check_output(probe) == "refused"  # from another node


def test_prometheus_answers_its_clients_only(host):
    # prometheus_clients: [monitoring-h200] (and no network): the host itself, monitoring-h200, nobody else.
    probe = connect(node_addresses(host)["monitoring-nvml"], 9090)
    assert host.check_output(probe) == "open"
    assert RUNNER.get_host("monitoring-h200").check_output(probe) == "open"
    assert RUNNER.get_host("monitoring-3090").check_output(probe) == "refused"
    assert "budgetgpu_prometheus" in host.check_output("nft list tables")


def test_a_dead_fan_fires_its_alert_and_a_healthy_fan_does_not(host):
    node = RUNNER.get_host("monitoring-3090")
    node.check_output(f"echo '{{}}' > {FAULTS} && {WATCH}")
    wait_for(lambda: alerts(host, "BudgetgpuGpuFanDead"), lambda got: got == [])
    fault = {GPUS_3090[0]: {"fans": [{"speed": 0, "target": 80}], "temp": 88}}
    node.check_output(f"echo {shlex.quote(json.dumps(fault))} > {FAULTS} && {WATCH}")
    try:
        firing = wait_for(
            lambda: alerts(host, "BudgetgpuGpuFanDead"), lambda got: [a["state"] for a in got] == ["firing"]
        )
        labels = firing[0]["labels"]
        assert (labels["UUID"], labels["instance"], labels["severity"]) == (GPUS_3090[0], "monitoring-3090", "critical")
        assert firing[0]["annotations"]["summary"].startswith("monitoring-3090: GPU 0 (GPU-30900000-")
        # The watch took the GPU out: the quarantine alert names it, beside the GPU the inventory lists.
        out = wait_for(lambda: alerts(host, "BudgetgpuGpuQuarantined"), lambda got: len(got) == 2)
        assert {a["labels"]["UUID"] for a in out} == {GPUS_3090[0], GPUS_3090[1]}
    finally:
        node.check_output(f"echo '{{}}' > {FAULTS} && {WATCH} && gpu-health release {GPUS_3090[0]}")
        node.check_output(WATCH)


def test_a_jobs_status_becomes_its_metrics_and_a_stopped_job_leaves_no_rate(host):
    """Rank 0's status file, as the trainer writes it, in a job directory the watch may not list (0751,
    another user's), and the job's unit running (a stand-in): the watch's pass exports it, Prometheus
    keeps the job's name as label job, the straggler alert fires; the unit stopped, the rate is gone."""
    node = RUNNER.get_host("monitoring-3090")
    status = {
        "step": 400,
        "steps_per_s": 7.5,
        "world": 2,
        "restarts": 0,
        "straggler": "straggler: rank 1 (monitoring-h200 GPU 0): 31% slower than the median over the last 200 steps",
        "straggler_ratio": 1.31,
        "straggler_threshold": 0.15,
        "window_steps": 200,
        "ranks": [
            {"rank": 0, "host": "monitoring-3090", "local_rank": 0, "step_s": 0.1},
            {"rank": 1, "host": "monitoring-h200", "local_rank": 0, "step_s": 0.131},
        ],
    }
    script = (
        "import json, sys, time; s = json.loads(sys.argv[1]); s['time'] = time.time(); "
        "open('/var/lib/budgetgpu/jobs/probe/status.json', 'w').write(json.dumps(s))"
    )
    node.check_output(
        "install -d -m 0751 -o nobody -g nogroup /var/lib/budgetgpu/jobs/probe && "
        f"python3 -c {shlex.quote(script)} {shlex.quote(json.dumps(status))} && "
        "chown nobody:nogroup /var/lib/budgetgpu/jobs/probe/status.json && "
        "chmod 0644 /var/lib/budgetgpu/jobs/probe/status.json && "
        "systemd-run --quiet --unit=budgetgpu-job-probe sleep infinity && " + WATCH
    )
    try:
        rate = wait_for(lambda: query(host, 'budgetgpu_job_steps_per_second{job="probe"}'), lambda got: len(got) == 1)
        assert rate[0]["metric"]["instance"] == "monitoring-3090" and float(rate[0]["value"][1]) == 7.5
        steps = query(host, 'budgetgpu_job_step_seconds{job="probe"}')
        assert {(s["metric"]["rank"], s["metric"]["node"], float(s["value"][1])) for s in steps} == {
            ("0", "monitoring-3090", 0.1),
            ("1", "monitoring-h200", 0.131),
        }
        firing = wait_for(
            lambda: alerts(host, "BudgetgpuJobStraggler"), lambda got: [a["state"] for a in got] == ["firing"]
        )
        assert firing[0]["labels"]["job"] == "probe"
        assert "1.31 times the median" in firing[0]["annotations"]["summary"]
    finally:
        node.check_output(f"systemctl stop budgetgpu-job-probe.service && {WATCH}")
    text = node.check_output("cat /var/lib/prometheus/node-exporter/budgetgpu_jobs.prom")
    assert 'budgetgpu_job_running{job="probe"} 0.0' in text and "budgetgpu_job_steps_per_second" not in text
    wait_for(lambda: query(host, 'budgetgpu_job_steps_per_second{job="probe"}'), lambda got: got == [])
    wait_for(lambda: alerts(host, "BudgetgpuJobStraggler"), lambda got: got == [])
    node.check_output(f"rm -r /var/lib/budgetgpu/jobs/probe && {WATCH}")


def test_the_rules_pass_their_promtool_tests_with_the_nodes_promtool(host):
    sys.path.insert(0, str(REPO / ".collections"))
    from ansible_collections.budgetgpu.cluster.tests.unit.roles.test_prometheus_rules import render_rules

    host.check_output("mkdir -p /tmp/budgetgpu-rules")
    for name, text in (
        ("budgetgpu.rules.yml", render_rules()),
        ("rules_test.yml", (REPO / "tests" / "prometheus" / "rules_test.yml").read_text()),
    ):
        host.check_output(f"printf %s {shlex.quote(text)} > /tmp/budgetgpu-rules/{name}")
    done = host.run("cd /tmp/budgetgpu-rules && promtool test rules rules_test.yml")
    assert done.rc == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr
    # The file the role installed passes promtool's check (it was validated before it landed).
    assert host.run("promtool check rules /etc/prometheus/budgetgpu.rules.yml").rc == 0


def test_a_gpu_off_the_bus_stays_in_the_metrics_and_its_alerts_fire(host):
    """GPU 3 of monitoring-3090 falls off the bus under NVML (gpu_sim's fault "gone") with its Xid 79 in the
    kernel log: its series stay (present 0, quarantined 1, its Xid), and the node's lost-GPU alert, its
    quarantine and its Xid alert fire in Prometheus."""
    node = RUNNER.get_host("monitoring-3090")
    lost = GPUS_3090[3]
    xid = (
        "Dec  1 03:00:00 monitoring-3090 kernel: NVRM: Xid (PCI:0000:04:00): 79, pid=4243, name=python3, "
        "GPU has fallen off the bus."
    )
    fault = {lost: {"gone": True}}
    node.check_output(
        f"echo {shlex.quote(json.dumps(fault))} > {FAULTS} && echo {shlex.quote(xid)} >> {KERN_LOG} && {WATCH}"
    )
    try:
        present = wait_for(
            lambda: query(host, f'budgetgpu_gpu_present{{UUID="{lost}"}}'),
            lambda got: [s["value"][1] for s in got] == ["0"],
        )
        assert present[0]["metric"]["instance"] == "monitoring-3090" and present[0]["metric"]["gpu"] == "3"
        assert [s["value"][1] for s in query(host, f'DCGM_FI_DEV_XID_ERRORS{{UUID="{lost}"}}')] == ["79"]
        fired = wait_for(lambda: alerts(host, "BudgetgpuGpuLost"), lambda got: [a["state"] for a in got] == ["firing"])
        assert fired[0]["labels"]["instance"] == "monitoring-3090"
        assert fired[0]["annotations"]["summary"].startswith(
            "monitoring-3090: NVML lists 3 GPUs, fewer than the node had"
        )
        for name in ("BudgetgpuGpuQuarantined", "BudgetgpuGpuXid"):
            wait_for(
                lambda name=name: alerts(host, name),
                lambda got: any(a["labels"]["UUID"] == lost and a["state"] == "firing" for a in got),
            )
    finally:
        node.check_output(f"echo '{{}}' > {FAULTS} && {WATCH} && gpu-health release {lost} && {WATCH}")
    wait_for(lambda: alerts(host, "BudgetgpuGpuLost"), lambda got: got == [])


WEBHOOK_FILE = "/var/lib/budgetgpu-webhook/alerts.jsonl"


def received() -> list[dict]:
    """What the webhook receiver on monitoring-h200 got from Alertmanager, one notification each."""
    text = RUNNER.get_host("monitoring-h200").check_output(f"cat {WEBHOOK_FILE} 2>/dev/null || true")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def notified(since: int, name: str, status: str, uuid: str) -> list[dict]:
    return [
        alert
        for message in received()[since:]
        for alert in message["alerts"]
        if alert["labels"]["alertname"] == name and alert["status"] == status and alert["labels"].get("UUID") == uuid
    ]


def test_alertmanager_answers_prometheus_and_the_control_node_only_with_its_cluster_port_off(host):
    address = node_addresses(host)["monitoring-nvml"]
    assert host.check_output(connect(address, 9093)) == "open"  # Prometheus' host (its own address)
    assert RUNNER.get_host("monitoring-h200").check_output(connect(address, 9093)) == "refused"
    assert RUNNER.get_host("monitoring-3090").check_output(connect(address, 9093)) == "refused"
    # The control node (this machine, the scenario network's gateway): what posts alerts and runs amtool.
    import urllib.request

    with urllib.request.urlopen(f"http://{address}:9093/api/v2/status", timeout=10) as answer:
        status = json.loads(answer.read())
    assert status["cluster"]["status"] == "disabled"  # --cluster.listen-address= : no gossip port
    assert host.check_output("ss -Hltn 'sport = :9094'") == ""
    assert RUNNER.get_host("monitoring-h200").check_output(connect(address, 9094)) == "refused"
    managers = api(host, "alertmanagers")["activeAlertmanagers"]
    assert [m["url"] for m in managers] == [f"http://{address}:9093/api/v2/alerts"]


def test_a_dead_fan_reaches_the_webhook_naming_node_and_gpu_then_resolved(host):
    node = RUNNER.get_host("monitoring-3090")
    since = len(received())
    fault = {GPUS_3090[0]: {"fans": [{"speed": 0, "target": 80}], "temp": 88}}
    started = time.monotonic()
    node.check_output(f"echo {shlex.quote(json.dumps(fault))} > {FAULTS} && {WATCH}")
    try:
        firing = wait_for(
            lambda: notified(since, "BudgetgpuGpuFanDead", "firing", GPUS_3090[0]), lambda got: len(got) >= 1
        )
        labels = firing[0]["labels"]
        assert (labels["instance"], labels["Hostname"], labels["gpu"], labels["severity"]) == (
            "monitoring-3090",
            "monitoring-3090",
            "0",
            "critical",
        )
        assert firing[0]["annotations"]["summary"].startswith("monitoring-3090: GPU 0 (GPU-30900000-")
        print(f"dead fan to webhook: {time.monotonic() - started:.0f} s")
    finally:
        node.check_output(f"echo '{{}}' > {FAULTS} && {WATCH} && gpu-health release {GPUS_3090[0]} && {WATCH}")
    cleared = time.monotonic()
    wait_for(lambda: notified(since, "BudgetgpuGpuFanDead", "resolved", GPUS_3090[0]), lambda got: len(got) >= 1)
    print(f"resolved to webhook: {time.monotonic() - cleared:.0f} s")


def booted_before(host, first: str, then: str) -> bool:
    """Whether unit `first` was active before unit `then` started, in this boot."""
    shown = [
        int(host.check_output(f"systemctl show -p {prop} --value {unit}"))
        for unit, prop in ((first, "ActiveEnterTimestampMonotonic"), (then, "ExecMainStartTimestampMonotonic"))
    ]
    return 0 < shown[0] <= shown[1]


def test_after_a_reboot_the_tables_are_loaded_before_the_services_and_refuse_as_before(host, reboot):
    """monitoring-nvml (Prometheus, Alertmanager, node exporter, a table each) rebooted: the kernel's rules went with
    the old network namespace (a table of the test's own proves it); budgetgpu's units load the tables at boot,
    before the services start, and each port refuses whom it refused before; Prometheus scrapes every node
    again. The last test of the file: monitoring-h200's webhook receiver (a transient unit) is not affected."""
    host.check_output("nft add table inet budgetgpu_reboot_probe")
    since = int(host.check_output("date +%s"))
    reboot(host)
    tables = host.check_output("nft list tables").splitlines()
    assert "table inet budgetgpu_reboot_probe" not in tables, "the rules survived the restart: not a boot"
    assert {f"table inet budgetgpu_{name}" for name in ("metrics", "prometheus", "alertmanager")} <= set(tables)
    for name, service in (
        ("metrics", "prometheus-node-exporter"),
        ("prometheus", "prometheus"),
        ("alertmanager", "prometheus-alertmanager"),
    ):
        assert booted_before(host, f"budgetgpu-{name}-firewall.service", f"{service}.service"), service
    # An early unit ordered into a cycle is one systemd drops from the boot, with this line.
    assert "ordering cycle" not in host.check_output(f"journalctl --since=@{since} -o cat --no-pager")
    # Scraped in this boot: a sample after it, not one Prometheus kept from before.
    booted = int(host.check_output("date +%s"))
    wait_for(
        lambda: host.run(f"python3 -c {shlex.quote(GET)} {shlex.quote('query?query=up')}").rc == 0, bool, timeout=120
    )
    wait_for(
        lambda: query(host, f'timestamp(up{{job="node",instance=~"monitoring-.+"}} == 1) > {booted}'),
        lambda got: len(got) == 3,
        timeout=120,
    )
    # Prometheus' API answers a few seconds before it lists its targets again.
    address = wait_for(lambda: node_addresses(host), lambda got: "monitoring-nvml" in got)["monitoring-nvml"]
    # Open to one (so the service listens) and refused to another: the table's doing, not a port still closed.
    for port, admitted, refused in (
        (9090, "monitoring-h200", "monitoring-3090"),
        (9093, "monitoring-nvml", "monitoring-h200"),
        (9100, "monitoring-nvml", "monitoring-3090"),
    ):
        assert RUNNER.get_host(admitted).check_output(connect(address, port)) == "open", (port, admitted)
        assert RUNNER.get_host(refused).check_output(connect(address, port)) == "refused", (port, refused)
