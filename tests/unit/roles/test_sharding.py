"""Sharding is real (issue 42 item 6), on local gloo ranks: under fsdp each rank holds about 1/world of the
parameters; a sharded checkpoint saved by 4 ranks loads into 3 with the same weights; the example
trainer under fsdp learns the same losses as under ddp for the same seed and batches (its MLP, and its GPT-2 on
text, stopped and resumed); hsdp over two torchrun
agents (two "nodes" of two ranks) keeps a whole checkpoint on each node and resumes; a rank killed with
SIGKILL costs the job a restart from its last sharded checkpoint, not step 0; a job restarted on fewer GPUs than it
plans (a GPU taken out, issue 42 item 5) resumes there too, keeps its global batch where it can and says why."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ansible_collections.budgetgpu.cluster.plugins.module_utils import sharding
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils import jobs

torch = pytest.importorskip("torch", reason="torch (CPU) from .cache/wheelhouse is not installed in this venv")
TORCHRUN = shutil.which("torchrun", path=os.path.dirname(sys.executable))
pytestmark = pytest.mark.skipif(TORCHRUN is None, reason="no torchrun beside this Python")

FILES = Path(__file__).resolve().parents[3] / "roles" / "torchrun" / "files"
TRAINER = FILES / "train_ddp.py"
WORKER = Path(__file__).with_name("sharding_worker.py")
# fsdp's losses against ddp's: the same arithmetic, summed in another order.
LOSS_TOLERANCE = 1e-4


def env(**extra: str) -> dict[str, str]:
    # As the job's unit runs it (jobs.torchrun_environment): a store of its own for each rendezvous round.
    job = {"BUDGETGPU_DIST_BACKEND": "gloo", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", **job, **extra)


def torchrun(nproc: int, *argv: str, **extra: str) -> str:
    command = [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", *argv]
    proc = subprocess.run(command, env=env(**extra), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def losses(log: str) -> dict[int, float]:
    return {int(m[1]): float(m[2]) for m in re.finditer(r"^step=(\d+) loss=([\d.]+)", log, re.MULTILINE)}


def test_the_node_package_knows_the_job_models_values():
    assert sharding.PARALLELISMS == jobs.PARALLELISMS and sharding.SHARDED == jobs.SHARDED
    assert sharding.PRECISIONS == jobs.PRECISIONS and sharding.STATE_PRECISIONS == jobs.STATE_PRECISIONS
    default = sharding.ShardSettings.from_env({})
    assert vars(default) == {key: jobs.JOB_DEFAULTS[key] for key in vars(default)}
    job = jobs.torchrun_job_normalize({"name": "j", "parallelism": "hsdp", "activation_checkpointing": True})
    expected = sharding.ShardSettings("hsdp", activation_checkpointing=True)
    assert sharding.ShardSettings.from_env(jobs.training_environment(job)) == expected
    with pytest.raises(ValueError, match="BUDGETGPU_PARALLELISM='zero3'"):
        sharding.ShardSettings.from_env({"BUDGETGPU_PARALLELISM": "zero3"})


def test_a_checkpoint_saved_by_four_ranks_loads_into_three_with_the_same_weights(tmp_path):
    saved = tmp_path / "saved.json"
    torchrun(4, str(WORKER), str(FILES), str(tmp_path / "ckpt"), "save", str(saved), BUDGETGPU_PARALLELISM="fsdp")
    found = json.loads(saved.read_text())
    # Each rank holds its shards only: a quarter of the parameters, give or take a row of each uneven tensor.
    assert sum(found["local"]) == found["total"]
    assert all(abs(local - found["total"] / 4) <= 0.05 * found["total"] for local in found["local"]), found["local"]
    assert (tmp_path / "ckpt" / "step-00000003.dcp" / ".metadata").is_file()
    for world in (3,):
        out = tmp_path / f"loaded{world}.json"
        torchrun(world, str(WORKER), str(FILES), str(tmp_path / "ckpt"), "load", str(out), BUDGETGPU_PARALLELISM="fsdp")
        loaded = json.loads(out.read_text())
        assert loaded["step"] == 3 and len(loaded["local"]) == world
        assert max(abs(a - b) for a, b in zip(loaded["weights"], found["weights"], strict=True)) == 0.0


def test_the_trainer_learns_the_same_under_fsdp_as_under_ddp(tmp_path):
    argv = [str(TRAINER), "--max-steps", "12", "--log-every", "1", "--layers", "2", "--checkpoint-every-minutes", "0"]
    ddp = torchrun(2, *argv, "--checkpoint-dir", str(tmp_path / "ddp"), BUDGETGPU_PARALLELISM="ddp")
    fsdp = torchrun(2, *argv, "--checkpoint-dir", str(tmp_path / "fsdp"), BUDGETGPU_PARALLELISM="fsdp")
    assert "parallelism=fsdp" in fsdp and "parallelism=ddp" in ddp
    assert len(losses(ddp)) == 12 and losses(fsdp).keys() == losses(ddp).keys()
    assert max(abs(losses(fsdp)[s] - losses(ddp)[s]) for s in losses(ddp)) <= LOSS_TOLERANCE, (
        losses(ddp),
        losses(fsdp),
    )
    local = int(re.search(r"params_local=(\d+)", fsdp)[1])
    assert local < 0.6 * int(re.search(r"params_local=(\d+)", ddp)[1])
    # The final checkpoint is sharded.
    assert (tmp_path / "fsdp" / "step-00000012.dcp" / ".metadata").is_file()


def test_gpt2_on_text_learns_the_same_under_fsdp_as_under_ddp_and_resumes_where_it_stopped(tmp_path):
    argv = [str(TRAINER), "--model", "gpt2", "--gpt2-size", "tiny", "--lr", "3e-3", "--log-every", "1",
            "--checkpoint-every-steps", "4", "--checkpoint-every-minutes", "0"]  # fmt: skip
    ddp_dir, fsdp_dir = str(tmp_path / "ddp"), str(tmp_path / "fsdp")
    ddp = torchrun(2, *argv, "--max-steps", "12", "--checkpoint-dir", ddp_dir, BUDGETGPU_PARALLELISM="ddp")
    first = torchrun(2, *argv, "--max-steps", "8", "--checkpoint-dir", fsdp_dir, BUDGETGPU_PARALLELISM="fsdp")
    resumed = torchrun(2, *argv, "--max-steps", "12", "--checkpoint-dir", fsdp_dir, BUDGETGPU_PARALLELISM="fsdp")
    assert "model=gpt2-tiny" in ddp and "parallelism=fsdp" in first
    assert "resumed from step 8 (sharded checkpoint" in resumed and min(losses(resumed)) == 9
    # The run stopped at step 8 and resumed goes on as one ddp run of 12 steps: same weights, optimizer and text.
    fsdp = {**losses(first), **losses(resumed)}
    assert sorted(fsdp) == sorted(losses(ddp)) == list(range(1, 13))
    assert max(abs(fsdp[s] - losses(ddp)[s]) for s in fsdp) <= LOSS_TOLERANCE, (losses(ddp), fsdp)
    # FSDP shards the transformer blocks (blocks_of finds them) and the tied embeddings: about half on each rank.
    local = int(re.search(r"params_local=(\d+)", first)[1])
    assert local < 0.6 * int(re.search(r"params_local=(\d+)", ddp)[1])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_hsdp_over_two_nodes_keeps_a_whole_checkpoint_on_each_and_resumes(tmp_path):
    def run_nodes(max_steps: int) -> list[str]:
        port = free_port()
        agents = [
            subprocess.Popen(
                [TORCHRUN, "--nnodes=2", "--nproc-per-node=2", f"--node-rank={node}", "--master-addr=127.0.0.1",
                 f"--master-port={port}", str(TRAINER), "--max-steps", str(max_steps), "--log-every", "1",
                 "--checkpoint-every-steps", "4", "--checkpoint-every-minutes", "0", "--layers", "2",
                 "--checkpoint-dir", str(tmp_path / f"node{node}")],
                env=env(BUDGETGPU_PARALLELISM="hsdp"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            for node in range(2)
        ]  # fmt: skip
        outs = [agent.communicate(timeout=300)[0] for agent in agents]
        assert [agent.returncode for agent in agents] == [0, 0], outs
        return outs

    first = run_nodes(8)
    for node in range(2):
        # Each node's own ranks wrote every shard of its replica and the metadata.
        assert sharding.sharded_steps(str(tmp_path / f"node{node}")) == [4, 8]
    second = run_nodes(10)
    assert "resumed from step 8 (sharded checkpoint" in second[0], second[0]
    assert min(losses(second[0])) == 9 and "parallelism=hsdp" in first[0]


def test_a_rank_killed_costs_a_restart_from_the_last_sharded_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    # Through the units' launcher, the workers' store on a fixed port (the job's store_port): the restarted round's
    # rank 0 listens on the port the killed round's held.
    command = [sys.executable, str(FILES / "budgetgpu-torchrun"), f"--store-port={free_port()}", "--standalone",
               "--nproc-per-node=2", "--max-restarts=1", str(TRAINER), "--max-steps", "60",
               "--log-every", "1", "--step-sleep", "0.05", "--checkpoint-every-steps", "5",
               "--checkpoint-every-minutes", "0", "--checkpoint-dir", str(ckpt)]  # fmt: skip
    agent = subprocess.Popen(command, env=env(BUDGETGPU_PARALLELISM="fsdp"), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)  # fmt: skip
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not any(line.startswith("checkpoint step=15 ") for line in lines):
            line = agent.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        workers = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True, check=False)
        os.kill(int(workers.stdout.split()[-1]), signal.SIGKILL)
        rest, _unused = agent.communicate(timeout=240)
    finally:
        agent.kill()
    log = "".join(lines) + rest
    assert agent.returncode == 0, log[-3000:]
    resumed = int(re.search(r"resumed from step (\d+) \(sharded checkpoint", log)[1])
    assert resumed >= 15 and resumed % 5 == 0, log[-3000:]
    assert "finished at step 60" in log


def test_fewer_ranks_than_planned_keep_the_global_batch_where_the_world_divides():
    comm = sharding.CommSettings(accumulate_steps=2)
    assert sharding.keep_global_batch(comm, 4, 4) == (comm, {})
    halved, change = sharding.keep_global_batch(comm, 4, 2, "node1: 2 of 4 GPUs: left out ...")
    assert halved.accumulate_steps == 4 and halved.bucket_cap_mb == comm.bucket_cap_mb
    assert change == {
        "planned_world": 4,
        "world_change": "2 of the 4 ranks planned: node1: 2 of 4 GPUs: left out ...; accumulate_steps 2 -> 4 keeps "
        "the global batch",
    }
    kept, change = sharding.keep_global_batch(comm, 4, 3)
    assert kept == comm and change["world_change"] == (
        "3 of the 4 ranks planned: GPUs out of service on another node; the global batch changed from 8 to 6 "
        "micro-batches (4 ranks do not divide by 3)"
    )


def test_a_job_restarted_on_fewer_gpus_resumes_from_its_sharded_checkpoint_and_says_why(tmp_path):
    """What the launcher does when the health watch took one of the node's 4 GPUs out: it starts 3 ranks and tells
    them the node planned 4 (budgetgpu-torchrun)."""
    status = tmp_path / "status.json"
    argv = [str(TRAINER), "--log-every", "1", "--layers", "2", "--data-workers", "0", "--checkpoint-every-steps", "4",
            "--checkpoint-every-minutes", "0", "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--status-file", str(status)]  # fmt: skip
    torchrun(4, *argv, "--max-steps", "8", BUDGETGPU_PARALLELISM="fsdp")
    full = json.loads(status.read_text())
    assert full["world"] == 4 and "planned_world" not in full and "world_change" not in full
    left_out = "node1: 3 of 4 GPUs: left out GPU-2 quarantined since t1 (fan 0%)"
    planned = {"BUDGETGPU_PLANNED_LOCAL_WORLD_SIZE": "4", "BUDGETGPU_LEFT_OUT": left_out}
    three = torchrun(3, *argv, "--max-steps", "12", BUDGETGPU_PARALLELISM="fsdp", **planned)
    assert "resumed from step 8 (sharded checkpoint" in three and min(losses(three)) == 9
    why = f"3 of the 4 ranks planned: {left_out}; the global batch changed from 4 to 3 micro-batches"
    assert f"world changed: {why}" in three
    found = json.loads(status.read_text())
    assert (found["step"], found["world"], found["planned_world"], found["accumulate_steps"]) == (12, 3, 4, 1)
    assert found["world_change"].startswith(why)
    # Two of the four: twice the micro-batches, the same global batch.
    two = torchrun(2, *argv, "--max-steps", "14", BUDGETGPU_PARALLELISM="fsdp", **planned)
    assert "resumed from step 12 (sharded checkpoint" in two and "accumulate_steps 1 -> 2 keeps the global batch" in two
    assert json.loads(status.read_text())["accumulate_steps"] == 2
