"""The units' launcher (roles/torchrun/files/budgetgpu-torchrun): a node whose master is down waits
for the master's store instead of failing start after start into systemd's start limit, and a
stop while it waits is a clean stop (143); the workers' store is on the job's store port, across in-place
restarts, and a torch that cannot put it there holds the job."""

from __future__ import annotations

import os
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


def read_until(proc: subprocess.Popen, text: str) -> str:
    """The launcher's output up to the first line with text (all of it where none comes within 30 s)."""
    timer = threading.Timer(30, proc.kill)
    timer.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if text in line:
                break
    finally:
        timer.cancel()
    return "".join(lines)


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
    waiting = read_until(proc, "does not answer: waiting")
    assert proc.poll() is None, waiting + proc.communicate()[0]
    proc.send_signal(signal.SIGTERM)
    out = waiting + proc.communicate(timeout=30)[0]
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
    out = read_until(proc, "still waiting for the master's rendezvous")
    proc.send_signal(signal.SIGTERM)
    out += proc.communicate(timeout=30)[0]
    assert "still waiting for the master's rendezvous" in out, out


# The worker joins the group (rank 0's worker listens on MASTER_PORT, the workers' store, and connects to it as every
# rank does) and says where the store was; the first round's worker then fails, and torch's agent starts the second
# round in place, whose rank 0 binds the port again. One rank a round: each worker imports torch.
STORE_WORKER = """
import os, sys
import torch.distributed as dist
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo")
dist.barrier()
print(f"rank={dist.get_rank()} restart={restart} MASTER_PORT={os.environ['MASTER_PORT']}", flush=True)
dist.destroy_process_group()
sys.exit(1 if restart == 0 else 0)
"""


def test_the_workers_store_is_on_the_jobs_store_port_across_an_in_place_restart(tmp_path):
    pytest.importorskip("torch", reason="torch (CPU) from .cache/wheelhouse is not installed in this venv")
    (tmp_path / "worker.py").write_text(STORE_WORKER)
    port = closed_port()
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(LAUNCHER), f"--store-port={port}", "--standalone", "--nproc-per-node=1",
         "--max-restarts=1", str(tmp_path / "worker.py")],
        env=env, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank="))
    assert said == [f"rank=0 restart={restart} MASTER_PORT={port}" for restart in (0, 1)]


@pytest.mark.parametrize("old_build", [lambda rank, store: None, lambda rank, store, local_addr: None])
def test_a_torch_that_cannot_place_the_store_holds_the_job_and_says_why(launcher, monkeypatch, capsys, old_build):
    api = pytest.importorskip("torch.distributed.elastic.rendezvous.api")
    # torch 2.4's first build had no server_port: its agent would take a free port, which every local user reaches.
    monkeypatch.setattr(api.RendezvousStoreInfo, "build", staticmethod(old_build))
    monkeypatch.setenv("BUDGETGPU_JOB", "pretrain")
    monkeypatch.delenv("BUDGETGPU_GPUS", raising=False)
    assert launcher.main(["--store-port=30500", "--nproc-per-node=1", "x.py"]) == launcher.HELD_EXIT
    out = capsys.readouterr().out
    assert "job pretrain held, not started: this torch (" in out and "not on the job's store_port 30500" in out
    # Without the class at all (torch before 2.4), likewise.
    monkeypatch.setitem(sys.modules, "torch.distributed.elastic.rendezvous.api", None)
    assert launcher.announce_store_port(30500) is False
