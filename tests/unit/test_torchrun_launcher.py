"""The units' launcher (roles/torchrun/files/budgetgpu-torchrun): a node whose master is down waits
for the master's store instead of failing start after start into systemd's start limit, and a
stop while it waits is a clean stop (143)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

LAUNCHER = Path(__file__).resolve().parents[2] / "roles" / "torchrun" / "files" / "budgetgpu-torchrun"


@pytest.fixture(scope="module")
def launcher():
    from ansible_collections.budgetgpu.cluster.tests.unit.file_modules import load_file_module

    return load_file_module("budgetgpu_torchrun", LAUNCHER)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_endpoints_split_with_and_without_brackets(launcher):
    assert launcher.split_endpoint("10.0.0.1:29500") == ("10.0.0.1", 29500)
    assert launcher.split_endpoint("[fd00::1]:29500") == ("fd00::1", 29500)
    assert launcher.split_endpoint("gpu-master.lan:29501") == ("gpu-master.lan", 29501)


def test_the_wait_ends_when_the_master_listens(launcher, capsys):
    port = closed_port()
    server = socket.socket()

    def master_comes_back() -> None:
        time.sleep(0.6)
        server.bind(("127.0.0.1", port))
        server.listen()

    threading.Thread(target=master_comes_back, daemon=True).start()
    try:
        waited = launcher.wait_for_master(f"127.0.0.1:{port}", poll_s=0.1, report_every_s=0.3)
    finally:
        server.close()
    assert 0.5 < waited < 10
    out = capsys.readouterr().out
    assert f"the master's rendezvous 127.0.0.1:{port} does not answer: waiting" in out
    assert "still waiting for the master's rendezvous" in out
    assert f"answers after {waited:.0f} s: starting torchrun" in out


def test_a_master_that_answers_costs_no_wait(launcher, capsys):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert launcher.wait_for_master(f"127.0.0.1:{server.getsockname()[1]}") == 0.0
    assert capsys.readouterr().out == ""


def test_a_stop_while_waiting_exits_143_without_a_traceback():
    proc = subprocess.Popen(
        [sys.executable, str(LAUNCHER), f"--wait-for-master=127.0.0.1:{closed_port()}", "--nproc-per-node=1", "x.py"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    time.sleep(1.5)
    assert proc.poll() is None, proc.communicate()[0]
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 143, out
    assert "stopped by signal 15 while waiting for the master" in out
    assert "Traceback" not in out


def test_the_wait_reports_once_per_store_timeout_of_the_jobs_rendezvous(launcher):
    conf = "--rdzv-conf=join_timeout=900,read_timeout=1,is_host=0"
    assert launcher.store_timeout(["--nproc-per-node=1", conf, "x.py"]) == 1.0
    assert launcher.store_timeout(["--nproc-per-node=1", "--master-port=29500", "x.py"]) == 60.0  # torch's default
    proc = subprocess.Popen(
        [sys.executable, str(LAUNCHER), f"--wait-for-master=127.0.0.1:{closed_port()}", "--nproc-per-node=1", conf,
         "x.py"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    time.sleep(4)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=30)[0]
    assert "still waiting for the master's rendezvous" in out, out
