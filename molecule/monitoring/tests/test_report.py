"""Pictures of the metrics for real: every GPU metric the shipped Grafana dashboard asks for is in the
scenario's Prometheus for every simulated GPU, and playbooks/report.yml, run from the control node as a
user runs it, charts them from that Prometheus."""

from __future__ import annotations

import json
import sys

from test_metrics import GPUS_3090, H200, REPO, RUNNER, api, query

testinfra_hosts = RUNNER.get_hosts("prometheus")


def _dashboard_names() -> tuple[set[str], set[str]]:
    """Return (the metric names the shipped dashboard asks for, the names gpu_metrics writes)."""
    sys.path.insert(0, str(REPO / ".collections"))
    from ansible_collections.budgetgpu.cluster.plugins.module_utils.gpu_metrics import METRICS
    from ansible_collections.budgetgpu.cluster.tests.unit.roles import test_grafana_dashboard as board

    dashboard = json.loads(board.DASHBOARD.read_text())
    return {name for expr in board.queries(dashboard) for name in board.metric_names(expr)}, set(METRICS)


def test_every_gpu_metric_the_dashboard_asks_for_is_in_prometheus_for_every_simulated_gpu(host):
    names, written = _dashboard_names()
    gpu_names = sorted(names & written)
    assert "DCGM_FI_DEV_GPU_UTIL" in gpu_names and len(gpu_names) >= 10, gpu_names
    found = query(host, 'count by (__name__, UUID) ({__name__=~"' + "|".join(gpu_names) + '"})')
    uuids = {name: set() for name in gpu_names}
    for series in found:
        uuids[series["metric"]["__name__"]].add(series["metric"]["UUID"])
    fans = {"budgetgpu_gpu_fan_speed_percent", "budgetgpu_gpu_fan_target_percent"}  # the H200 has no fan
    assert {name: sorted(got) for name, got in uuids.items()} == {
        name: sorted(GPUS_3090 + ([] if name in fans else [H200])) for name in gpu_names
    }
    # The node panels' names are here too; the job and inference panels' have no source in this scenario
    # (the inference panels read the recorded budgetgpu_inference:* series, molecule/inference's).
    others = {n for n in names - written if not n.startswith(("budgetgpu_job_", "budgetgpu_inference"))}
    # The node power panel reads the RAPL reader's (role node_exporter); a container has no powercap
    # tree, so its per-zone CPU counter has no series here, and the base watts have.
    rapl = {"budgetgpu_node_base_watts", "budgetgpu_node_cpu_energy_joules_total"}
    assert others == {"up", "node_systemd_unit_state"} | rapl
    expected = others - {"budgetgpu_node_cpu_energy_joules_total"}
    present = query(host, 'count by (__name__) ({__name__=~"' + "|".join(sorted(expected)) + '"})')
    assert {s["metric"]["__name__"] for s in present} == expected


def test_the_report_charts_every_simulated_gpu_from_this_prometheus(host, playbook, tmp_path):
    targets = {t["labels"]["instance"]: t["scrapeUrl"] for t in api(host, "targets")["activeTargets"]}
    address = targets["monitoring-nvml"].split("//")[1].rsplit(":", 1)[0]  # its cluster address, as the host reaches it
    url = f"http://{address}:9090"
    done = playbook(
        "report.yml",
        "-e",
        "report_hours=0.1",
        "-e",
        f"budgetgpu_state_dir={tmp_path}",
        "-e",
        f"report_prometheus_url={url}",
    )
    assert done.returncode == 0, done.stdout
    assert f"open {tmp_path}/report/index.html in any browser" in done.stdout
    page = (tmp_path / "report" / "index.html").read_text()
    start = page.index("<h2>GPU temperature</h2>")
    temperature = page[start : page.index("</section>", start)]
    for number in range(4):
        assert f"monitoring-3090 GPU {number}" in temperature and GPUS_3090[number] in temperature
    assert "monitoring-h200 GPU 0" in temperature and H200 in temperature
    assert "NVIDIA H200" in temperature and "data:image/png;base64," in temperature
    pngs = {p.name: p.stat().st_size for p in (tmp_path / "report").glob("*.png")}
    assert "panel-2-gpu-temperature.png" in pngs and "panel-3-gpu-power-draw-and-limit.png" in pngs
    assert min(pngs.values()) > 5000, pngs
    # No inference service runs here: its panels say so instead of failing the report.
    assert "Inference request latency: no data" in done.stdout
