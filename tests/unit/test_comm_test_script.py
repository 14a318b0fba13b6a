"""The communication test's worker (roles/nccl_network/files/comm_test.py): two "nodes" as two
torchrun agents on this machine (gloo over loopback), in a Python without numpy, as the nodes'
venvs are. Checks the JSON the report reads: ranks, sweep sizes with correct sums, the pair."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch (CPU) from .cache/wheelhouse is not installed in this venv")

SCRIPT = Path(__file__).resolve().parents[2] / "roles" / "nccl_network" / "files" / "comm_test.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.skipif(not TORCHRUN.exists(), reason="no torchrun in this venv")
def test_two_nodes_without_numpy_write_the_sweep_and_the_pair(tmp_path, no_numpy_path):
    out = tmp_path / "allreduce.json"
    port = free_port()
    agents = [
        subprocess.Popen(
            [str(TORCHRUN), "--nnodes=2", "--nproc-per-node=1", f"--node-rank={rank}", "--master-addr=127.0.0.1",
             f"--master-port={port}", "--max-restarts=0", str(SCRIPT), "--backend=gloo", "--min-bytes=1024",
             "--max-bytes=65536", "--warmup=1", "--iters=1", "--pair-iters=1", "--timeout=60", f"--out={out}"],
            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=no_numpy_path, GLOO_SOCKET_IFNAME="lo",
                     BUDGETGPU_NODE=f"node{rank + 1}", BUDGETGPU_NODE_ADDR="127.0.0.1"),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(2)
    ]  # fmt: skip
    outputs = [agent.communicate(timeout=180)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(outputs)

    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["nodes"] == ["node1", "node2"]
    assert [(r["rank"], r["node"], r["ifname"]) for r in result["ranks"]] == [(0, "node1", "lo"), (1, "node2", "lo")]
    assert [row["bytes"] for row in result["sizes"]] == [1024 << i for i in range(7)]
    assert all(row["wrong"] == 0 and row["busbw_gbs"] > 0 for row in result["sizes"])
    assert [(p["src"], p["dst"]) for p in result["pairs"]] == [("node1", "node2"), ("node2", "node1")]
    assert result["env"]["GLOO_SOCKET_IFNAME"] == "lo"
