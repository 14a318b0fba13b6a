"""The example training script (roles/torchrun/files/train_ddp.py): checkpoints written atomically,
resume from the newest readable one, loss going down; in-process on CPU, and with torchrun."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ansible_collections.budgetgpu.cluster.plugins.module_utils.gpt2 import gpt2_params

torch = pytest.importorskip("torch", reason="torch (CPU) from .cache/wheelhouse is not installed in this venv")

SCRIPT = Path(__file__).resolve().parents[2] / "roles" / "torchrun" / "files" / "train_ddp.py"


@pytest.fixture(scope="module")
def train():
    spec = importlib.util.spec_from_file_location("train_ddp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_ddp"] = module  # dataclasses look their module up there
    # As `python train_ddp.py` runs it: its own folder first on the path; budgetgpu_node from the
    # node package's folder (tests/unit/node_package.py), as the job venv's .pth gives it.
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(SCRIPT.parent))
        sys.modules.pop("train_ddp", None)


@pytest.fixture(autouse=True)
def _alone(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "BUDGETGPU_CHECKPOINT_DIR"):
        monkeypatch.delenv(name, raising=False)


def run(train, capsys, *argv: str) -> list[str]:
    assert train.main(list(argv)) == 0
    return capsys.readouterr().out.splitlines()


def steps_and_losses(lines: list[str]) -> list[tuple[int, float]]:
    return [(int(m[1]), float(m[2])) for line in lines if (m := re.match(r"step=(\d+) loss=([\d.]+)", line))]


def test_a_run_learns_checkpoints_every_n_steps_and_keeps_the_newest(train, capsys, tmp_path):
    lines = run(train, capsys, "--max-steps", "60", "--log-every", "5", "--checkpoint-every-steps", "10",
                "--checkpoint-every-minutes", "0", "--checkpoint-dir", str(tmp_path))  # fmt: skip
    assert lines[0] == f"no checkpoint in {tmp_path}: starting at step 0"
    losses = steps_and_losses(lines)
    assert [s for s, _unused in losses] == list(range(5, 61, 5))
    assert losses[-1][1] < 0.6 * losses[0][1], losses
    saved = [int(m[1]) for line in lines if (m := re.match(r"checkpoint step=(\d+) ", line))]
    assert saved == [10, 20, 30, 40, 50, 60]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000040.pt", "step-00000050.pt", "step-00000060.pt"]
    assert lines[-1] == "finished at step 60"


def test_a_second_run_resumes_where_the_first_stopped(train, capsys, tmp_path):
    common = ("--log-every", "5", "--checkpoint-every-steps", "10", "--checkpoint-dir", str(tmp_path))
    first = run(train, capsys, "--max-steps", "25", *common)
    assert first[-2].startswith("checkpoint step=25 ") and first[-2].endswith("(final)")
    second = run(train, capsys, "--max-steps", "40", *common)
    assert second[0] == f"resumed from step 25 (checkpoint {tmp_path / 'step-00000025.pt'})"
    assert steps_and_losses(second)[0][0] == 30
    # The resumed run continues the same trajectory as an uninterrupted one.
    other = tmp_path / "straight"
    straight = run(train, capsys, "--max-steps", "40", "--log-every", "5", "--checkpoint-dir", str(other))
    assert steps_and_losses(straight)[-1] == pytest.approx(steps_and_losses(second)[-1], abs=1e-3)


def test_gpt2_is_the_planners_size_and_learns_the_text(train, capsys, tmp_path):
    for size in ("tiny", "1.5b"):
        with torch.device("meta"):  # the guide's 1.5B, without its 6 GB
            model = train.GPT2Model(train.GPT2[size])
        assert sum(p.numel() for p in model.parameters()) == gpt2_params(train.GPT2[size])
    assert gpt2_params(train.GPT2["1.5b"]) == 1_557_611_200
    # A rank's windows start in its shard of the text (rank, rank + world, ...); labels are the next tokens.
    positions = torch.arange(1000)
    inputs, labels = train.text_batch(positions, 0, 2, 8, 3, 1, 5)
    assert inputs.shape == (5, 8) and torch.equal(labels, inputs + 1) and (inputs[:, 0] % 2 == 1).all()
    assert torch.equal(train.text_batch(positions, 0, 2, 8, 3, 1, 5)[0], inputs)
    lines = run(train, capsys, "--model", "gpt2", "--lr", "3e-3", "--max-steps", "40", "--log-every", "5",
                "--checkpoint-every-minutes", "0", "--checkpoint-dir", str(tmp_path))  # fmt: skip
    losses = steps_and_losses(lines)
    # Knowing nothing is a guess of 1/256 a byte (ln 256 = 5.55 nats); forty steps learn the text's bytes.
    assert losses[-1][1] < losses[0][1] and losses[-1][1] < 0.65 * math.log(256), losses


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(train, capsys, tmp_path):
    run(train, capsys, "--max-steps", "20", "--checkpoint-every-steps", "10", "--checkpoint-dir", str(tmp_path))
    (tmp_path / "step-00000020.pt").write_bytes(b"half a checkpoint")
    lines = run(train, capsys, "--max-steps", "20", "--checkpoint-dir", str(tmp_path))
    assert any("step-00000020.pt is unreadable" in line for line in lines)
    assert any(line.startswith("resumed from step 10 ") for line in lines)


def test_sigterm_stops_at_a_step_boundary_with_a_checkpoint(train, capsys, tmp_path, monkeypatch):
    real_sleep = train.time.sleep
    calls = {"n": 0}

    def sleep_then_term(seconds):
        calls["n"] += 1
        if calls["n"] == 7:
            train.signal.raise_signal(train.signal.SIGTERM)
        real_sleep(0)

    monkeypatch.setattr(train.time, "sleep", sleep_then_term)
    lines = run(train, capsys, "--max-steps", "1000", "--step-sleep", "0.001", "--checkpoint-dir", str(tmp_path))
    assert lines[-2] == f"checkpoint step=7 path={tmp_path / 'step-00000007.pt'} (stop requested)"
    assert lines[-1] == "stopped at step 7"


@pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None, reason="no torchrun")
def test_two_processes_with_gloo_share_one_checkpoint_and_resume(tmp_path, no_numpy_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1", BUDGETGPU_DIST_BACKEND="gloo", PYTHONPATH=no_numpy_path)
    ckpt = tmp_path / "ckpt"

    def launch(max_steps: int) -> str:
        proc = subprocess.run(
            [torchrun, "--standalone", "--nproc-per-node=2", str(SCRIPT), "--max-steps", str(max_steps),
             "--log-every", "5", "--checkpoint-every-steps", "10", "--checkpoint-dir", str(ckpt)],
            env=env, capture_output=True, text=True, timeout=240, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    first = launch(20)
    assert "training world=2" in first and "step=20 loss=" in first
    second = launch(30)
    assert "resumed from step 20 (checkpoint " in second
    assert re.search(r"^step=25 loss=", second, re.MULTILINE)
    assert "step=5 " not in second


@pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None, reason="no torchrun")
def test_a_stop_on_one_node_stops_every_rank_at_the_same_step(tmp_path, no_numpy_path):
    """Two "nodes" (torchrun agents over loopback), one rank each; only node B's worker gets SIGTERM,
    as when one node is stopped first. Both must checkpoint the same step; A's rank exits 75."""
    import signal
    import socket
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1", BUDGETGPU_DIST_BACKEND="gloo", PYTHONPATH=no_numpy_path,
               GLOO_SOCKET_IFNAME="lo")  # fmt: skip
    agents = [
        subprocess.Popen(
            [torchrun, "--nnodes=2", "--nproc-per-node=1", f"--node-rank={rank}", "--master-addr=127.0.0.1",
             f"--master-port={port}", "--max-restarts=0", str(SCRIPT), "--max-steps", "100000", "--log-every", "1",
             "--step-sleep", "0.02", "--checkpoint-every-steps", "7", "--checkpoint-every-minutes", "0",
             "--checkpoint-dir", str(tmp_path / f"node{rank}")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(2)
    ]  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        worker = None
        while worker is None and time.monotonic() < deadline:
            found = subprocess.run(["pgrep", "-P", str(agents[1].pid), "-f", "train_ddp.py"],
                                   capture_output=True, text=True, check=False).stdout.split()  # fmt: skip
            worker = int(found[0]) if found else None
            time.sleep(0.2)
        assert worker, "node B's worker did not start"
        while not list((tmp_path / "node1").glob("step-*.pt")) and time.monotonic() < deadline:
            time.sleep(0.2)  # training, not starting up
        os.kill(worker, signal.SIGTERM)
        outputs = [agent.communicate(timeout=120)[0] for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    saved = {rank: max(p.name for p in (tmp_path / f"node{rank}").glob("step-*.pt")) for rank in range(2)}
    assert saved[0] == saved[1], (saved, outputs)
    step = int(saved[0][5:13])
    reason = "" if step % 7 == 0 else r" \(stop requested\)"  # a stop on a periodic step writes no second one
    for output in outputs:
        assert re.search(rf"^checkpoint step={step} .*{reason}$", output, re.M), output[-3000:]
    assert f"rank 0: a peer stopped at step {step}; waiting for it to come back" in outputs[0]
    assert agents[1].returncode == 0, outputs[1]
    assert agents[0].returncode != 0, "node A was not stopped: it must not look finished"
