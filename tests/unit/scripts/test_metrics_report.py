"""playbooks/report.yml and its script (playbooks/files/metrics_report.py) against a fake Prometheus: a
small HTTP server answering /api/v1/query_range with canned matrices. The panels come from the shipped
Grafana dashboard; a panel without data says so; Prometheus down, or something else at its URL, fails
with the URL and what was found, without a traceback."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import NO_NODE_VENV_INSTALL

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "playbooks" / "files" / "metrics_report.py"
DASHBOARD = REPO / "roles" / "prometheus" / "files" / "grafana-dashboard.json"
NOW = 1_764_570_000.0
GPU_LABELS = {"instance": "node1", "Hostname": "node1", "modelName": "NVIDIA GeForce RTX 3090"}


def _matrix(name: str, gpus: int, value: float) -> list[dict]:
    return [
        {
            "metric": {"__name__": name, **GPU_LABELS, "gpu": str(i), "UUID": f"GPU-{i}"},
            "values": [[NOW - 60 * (5 - step), str(value + i + step)] for step in range(6)],
        }
        for i in range(gpus)
    ]


# What the fake Prometheus answers, by the first metric name found in the query; anything else: no data.
CANNED = {
    "DCGM_FI_DEV_GPU_TEMP": _matrix("DCGM_FI_DEV_GPU_TEMP", 2, 40),
    "DCGM_FI_DEV_POWER_USAGE": _matrix("DCGM_FI_DEV_POWER_USAGE", 2, 250),
    "DCGM_FI_DEV_POWER_MGMT_LIMIT": _matrix("DCGM_FI_DEV_POWER_MGMT_LIMIT", 2, 280),
    # The RAPL reader's counter (role node_exporter), as the CPU's rate: the node power panel's CPU.
    "budgetgpu_node_cpu_energy_joules_total": _matrix("budgetgpu_node_cpu_energy_joules_total", 1, 45),
}


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("metrics_report", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["metrics_report"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("metrics_report", None)


class _Prometheus(BaseHTTPRequestHandler):
    queries: list[dict] = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        url = urllib.parse.urlparse(self.path)
        params = dict(urllib.parse.parse_qsl(url.query))
        if url.path != "/api/v1/query_range":
            return self._send(404, "text/plain", b"404 page not found\n")
        self.queries.append(params)
        if "TYPO(" in params["query"]:
            body = {"status": "error", "errorType": "bad_data", "error": 'unknown function "TYPO"'}
            return self._send(400, "application/json", json.dumps(body).encode())
        result = next((m for name, m in CANNED.items() if name in params["query"]), [])
        body = {"status": "success", "data": {"resultType": "matrix", "result": result}}
        return self._send(200, "application/json", json.dumps(body).encode())

    def _send(self, code: int, kind: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # quiet
        pass


class _NotPrometheus(_Prometheus):
    def do_GET(self):  # noqa: N802
        self._send(200, "text/html", b"<html><body>Welcome to nginx!</body></html>")


def _serve(handler):
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(name="prometheus")
def fixture_prometheus():
    _Prometheus.queries = []
    server = _serve(_Prometheus)
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _closed_port() -> int:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Prometheus)
    port = server.server_address[1]
    server.server_close()
    return port


def _section(page: str, title: str) -> str:
    start = page.index(f"<h2>{title}</h2>")
    return page[start : page.index("</section>", start)]


def test_every_panel_is_asked_and_charted_and_a_panel_without_data_says_so(report, prometheus, tmp_path):
    out = tmp_path / "report"
    out.mkdir()
    (out / "panel-99-stale.png").write_bytes(b"old")  # an earlier report's chart of a panel gone quiet
    assert report.main(["--url", prometheus, "--dashboard", str(DASHBOARD), "--out", str(out), "--hours", "1"]) == 0
    page = (out / "index.html").read_text()
    temperature = _section(page, "GPU temperature")
    assert "node1 GPU 0" in temperature and "node1 GPU 1" in temperature and "GPU-1" in temperature
    assert "45 °C" in temperature  # GPU 0's last sample, 40 + 5
    assert "data:image/png;base64," in temperature and "no data" not in temperature
    assert "node1 GPU 1 limit" in _section(page, "GPU power draw and limit")
    steps = _section(page, "Job steps per second")
    assert "no data in this time range" in steps and "<img" not in steps
    pngs = sorted(p.name for p in out.glob("*.png"))
    # The panels with data (power per node sums the canned power draw); the stale chart is gone.
    assert pngs == [
        "panel-2-gpu-temperature.png",
        "panel-21-node-power-gpus-cpu-and-the-rest.png",
        "panel-3-gpu-power-draw-and-limit.png",
        "panel-5-power-per-node.png",
    ]
    node = _section(page, "Node power: GPUs, CPU and the rest")
    assert "node1 node" in node and "node1 GPUs (NVML)" in node and "node1 CPU (RAPL)" in node
    assert all((out / p).read_bytes().startswith(b"\x89PNG") for p in pngs)
    # Grafana's variables expanded: the node variable at its "All" value, a rate window of whole seconds.
    exprs = [q["query"] for q in _Prometheus.queries]
    assert len(exprs) == sum(len(p["targets"]) for p in json.loads(DASHBOARD.read_text())["panels"] if "targets" in p)
    assert not [e for e in exprs if "$" in e]
    assert 'DCGM_FI_DEV_GPU_TEMP{instance=~".*"}' in exprs
    assert any("[120s]" in e for e in exprs)
    step = {float(q["end"]) - float(q["start"]) for q in _Prometheus.queries}
    assert step == {3600.0}


def test_a_query_prometheus_refuses_shows_on_its_panel_and_the_rest_is_written(report, prometheus, tmp_path):
    dashboard = json.loads(DASHBOARD.read_text())
    dashboard["panels"][1]["targets"][0]["expr"] = "TYPO(DCGM_FI_DEV_GPU_TEMP)"
    path = tmp_path / "dashboard.json"
    path.write_text(json.dumps(dashboard))
    assert report.main(["--url", prometheus, "--dashboard", str(path), "--out", str(tmp_path / "r")]) == 0
    page = (tmp_path / "r" / "index.html").read_text()
    assert 'query failed: TYPO(DCGM_FI_DEV_GPU_TEMP): bad_data: unknown function "TYPO"' in page.replace("&quot;", '"')
    assert (tmp_path / "r" / "panel-3-gpu-power-draw-and-limit.png").stat().st_size > 1000


def test_without_matplotlib_the_page_holds_the_tables_and_says_why(report, prometheus, tmp_path, monkeypatch):
    monkeypatch.setattr(report, "_pyplot", lambda: None)
    assert report.main(["--url", prometheus, "--dashboard", str(DASHBOARD), "--out", str(tmp_path)]) == 0
    page = (tmp_path / "index.html").read_text()
    assert "matplotlib is not installed on the control node (pip install matplotlib)" in page
    assert "node1 GPU 1" in page and not list(tmp_path.glob("*.png"))


def _run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--dashboard", str(DASHBOARD), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_prometheus_down_fails_naming_the_url_without_a_traceback(tmp_path):
    url = f"http://127.0.0.1:{_closed_port()}"
    done = _run_script("--url", url, "--out", str(tmp_path))
    assert done.returncode == 1
    assert done.stderr.startswith(f"report: Prometheus at {url} did not answer: ")
    assert "Connection refused" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "index.html").exists()


def test_something_else_at_the_url_is_named_with_what_it_answered(tmp_path):
    server = _serve(_NotPrometheus)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        done = _run_script("--url", url, "--out", str(tmp_path))
    finally:
        server.shutdown()
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert (
        f"report: {url} is not Prometheus' HTTP API: /api/v1/query_range answered HTTP 200 (text/html)" in done.stderr
    )
    assert "Welcome to nginx!" in done.stderr


def test_a_dashboard_that_is_not_there_is_named(report, tmp_path, capsys):
    argv = ["--url", "http://127.0.0.1:1", "--dashboard", str(tmp_path / "none.json"), "--out", str(tmp_path)]
    assert report.main(argv) == 2
    assert f"report: cannot read the dashboard {tmp_path}/none.json: " in capsys.readouterr().err


def test_the_time_range_from_hours_or_start_and_end(report):
    assert report.time_range(24, None, None, NOW) == (NOW - 86400, NOW, 288)
    assert report.time_range(0.1, None, None, NOW) == (NOW - 360, NOW, 2)
    start, end, step = report.time_range(24, "2026-12-01T06:00:00Z", "2026-12-01T07:00:00+00:00", NOW)
    assert (end - start, step) == (3600, 12)
    assert report.time_range(24, "1764568800", None, NOW)[:2] == (1764568800.0, NOW)
    with pytest.raises(report.BadArguments, match="'yesterday' is neither Unix seconds nor an ISO 8601 time"):
        report.time_range(24, "yesterday", None, NOW)
    with pytest.raises(report.BadArguments, match="starts .* at or after its end"):
        report.time_range(24, str(NOW), str(NOW - 1), NOW)


def test_legends_fill_grafanas_format_and_a_missing_label_is_left_empty(report):
    labels = {"instance": "node1", "gpu": "3", "job": "pretrain"}
    assert report.legend("{{instance}} GPU {{ gpu }}", labels) == "node1 GPU 3"
    assert report.legend("{{job}} rank {{rank}}", labels) == "pretrain rank"
    assert report.legend("", {"__name__": "up", "instance": "n"}) == '{instance="n"}'


def _playbook(tmp_path: Path, inventory: str, *extra: str) -> subprocess.CompletedProcess:
    (tmp_path / "hosts.yml").write_text(inventory)
    env = {
        **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_CACHE_PLUGIN": "memory",
        "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp"),
        "ANSIBLE_REMOTE_TEMP": str(tmp_path / "remote-tmp"),
    }
    argv = [str(Path(sys.executable).with_name("ansible-playbook")), "-i", str(tmp_path / "hosts.yml")]
    # The playbook includes role prometheus' api_url.yml, and with it prometheus' dependencies (run_inputs,
    # torchrun's jobs, node_venv), which would install the node venv on this machine.
    variables = {
        "ansible_python_interpreter": sys.executable,
        "budgetgpu_state_dir": str(tmp_path),
        **NO_NODE_VENV_INSTALL,
    }
    argv += ["-e", json.dumps(variables)]
    argv += [*extra, str(REPO / "playbooks" / "report.yml")]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=False, cwd=tmp_path)


def test_the_playbook_finds_prometheus_in_the_inventory_and_writes_under_the_state_dir(prometheus, tmp_path):
    port = prometheus.rsplit(":", 1)[1]
    inventory = (
        "all:\n  children:\n    prometheus:\n      hosts:\n        mon1:\n          ansible_host: 127.0.0.1\n"
        f"          prometheus_listen_address: 0.0.0.0:{port}\n"
    )
    done = _playbook(tmp_path, inventory, "-e", "report_hours=2")
    words = " ".join(done.stdout.split())
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"open {tmp_path}/report/index.html in any browser" in words
    assert "GPU temperature: 2 series" in words and "Straggler ratio: no data" in words
    assert (tmp_path / "report" / "panel-2-gpu-temperature.png").stat().st_size > 1000
    assert {float(q["end"]) - float(q["start"]) for q in _Prometheus.queries} == {7200.0}


def test_the_playbook_fails_clearly_when_prometheus_is_down_or_unknown(tmp_path):
    port = _closed_port()
    inventory = "all:\n  children:\n    prometheus:\n      hosts:\n        mon1:\n          ansible_host: 127.0.0.1\n"
    done = _playbook(tmp_path, inventory, "-e", f"prometheus_listen_address=0.0.0.0:{port}")
    words = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 2
    assert f"report: Prometheus at http://127.0.0.1:{port} did not answer: " in words
    assert "Traceback" not in words
    done = _playbook(tmp_path, "all:\n  hosts:\n    node1:\n")
    words = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 2
    assert "report_prometheus_url is not set and the inventory has no host in group prometheus" in words
