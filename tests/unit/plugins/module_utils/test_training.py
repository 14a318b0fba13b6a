"""The job's side of the contract (module_utils/training.py, budgetgpu_node.training): its settings are what the
job's unit sets, checkpoints are written atomically and by steps or minutes, and README.md's own script, run
exactly as the README shows it under torchrun (two gloo ranks), trains, stops every rank at the same step with a
checkpoint when one rank gets SIGTERM, resumes from that step and data position, and writes the step to its
status. The example trainer's runs are tests/unit/test_train_script.py and tests/unit/roles/test_sharding.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ansible_collections.budgetgpu.cluster.plugins.module_utils import training
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils import jobs

REPO = Path(__file__).resolve().parents[4]
README_MARK = "<!-- the script of tests/unit/plugins/module_utils/test_training.py -->"
TORCHRUN = shutil.which("torchrun", path=os.path.dirname(sys.executable))


def test_the_settings_are_what_the_jobs_unit_sets():
    job = jobs.torchrun_job_normalize(
        {"name": "j", "checkpoint_every_minutes": 5, "checkpoint_every_steps": 50, "accumulate_steps": 2}
    )
    env = jobs.torchrun_environment(job, "node1", {"node1": {}})
    settings = training.JobSettings.from_env(env)
    assert (settings.checkpoint_dir, settings.status_file) == (job["checkpoint_dir"], env["BUDGETGPU_STATUS_FILE"])
    assert (settings.checkpoint_every_minutes, settings.checkpoint_every_steps) == (5, 50)
    assert settings.straggler_every_steps == job["straggler_every_steps"] and settings.comm.accumulate_steps == 2
    assert settings.backend == env["BUDGETGPU_DIST_BACKEND"] and settings.shard.parallelism == "ddp"
    assert training.JobSettings.from_env({}) == training.JobSettings()


def test_a_crash_while_saving_leaves_the_previous_checkpoint_and_no_partial_file(tmp_path, monkeypatch):
    pytest.importorskip("torch", reason="torch (CPU) from .cache/wheelhouse is not installed in this venv")
    training.save_checkpoint(tmp_path, 10, {"step": 10})

    def crash(*_args):
        raise OSError("disk full")

    monkeypatch.setattr(training.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        training.save_checkpoint(tmp_path, 20, {"step": 20})
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000010.pt"]
    assert training.load_latest(tmp_path)[0] == 10


def test_the_policy_saves_by_steps_or_by_minutes():
    policy = training.CheckpointPolicy(minutes=15, steps=0, last_time=0.0, last_step=0)
    assert not policy.due(1000, 899.0) and policy.due(1001, 900.0)
    policy = training.CheckpointPolicy(minutes=0, steps=50, last_time=0.0, last_step=100)
    assert not policy.due(149, 1e9) and policy.due(150, 0.0)


def readme_script() -> str:
    """The fenced block after README_MARK in README.md, exactly."""
    text = (REPO / "README.md").read_text()
    block = re.search(re.escape(README_MARK) + r"\n```python\n(.*?)^```$", text, re.DOTALL | re.MULTILINE)
    assert block, f"README.md has no ```python block after {README_MARK}"
    return block[1]


def rank_of(pid: int) -> int:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in environ if v.startswith(b"RANK="))[5:])


@pytest.mark.skipif(TORCHRUN is None, reason="no torchrun beside this Python")
def test_the_readme_script_stops_every_rank_at_one_step_and_resumes_there(tmp_path, no_numpy_path):
    import torch

    script, ckpt, status = tmp_path / "train.py", tmp_path / "ckpt", tmp_path / "status.json"
    script.write_text(readme_script())
    unit = {"BUDGETGPU_DIST_BACKEND": "gloo", "BUDGETGPU_CHECKPOINT_DIR": str(ckpt),
            "BUDGETGPU_CHECKPOINT_EVERY_STEPS": "5", "BUDGETGPU_CHECKPOINT_EVERY_MINUTES": "0",
            "BUDGETGPU_STATUS_FILE": str(status), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=no_numpy_path, **unit)
    command = [TORCHRUN, "--standalone", "--nproc-per-node=2", "--max-restarts=0", str(script)]
    agent = subprocess.Popen(
        [*command, "1000000"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while not list(ckpt.glob("step-*.pt")) and time.monotonic() < deadline and agent.poll() is None:
            time.sleep(0.1)  # training, not starting up
        workers = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True, check=False)
        # Rank 1 alone is stopped: rank 0, which writes the node's checkpoints, stops at the same step.
        os.kill(next(pid for pid in map(int, workers.stdout.split()) if rank_of(pid) == 1), signal.SIGTERM)
        first = agent.communicate(timeout=120)[0]
    finally:
        agent.kill()
    step = int(re.search(r"^rank 0: a peer stopped at step (\d+); waiting for it to come back$", first, re.M)[1])
    assert f"stopped at step {step}" in first and agent.returncode != 0, first[-3000:]
    assert max(p.name for p in ckpt.glob("step-*.pt")) == f"step-{step:08d}.pt", first[-3000:]
    # The data position: 4096 samples over 2 ranks in batches of 64 are 32 batches a rank and epoch.
    data = torch.load(ckpt / f"step-{step:08d}.pt", weights_only=True)["data"]
    assert data["epoch"] * 32 + data["batch"] == step
    assert json.loads(status.read_text())["step"] == step
    second = subprocess.run(
        [*command, str(step + 10)], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"resumed from step {step} (checkpoint {ckpt / f'step-{step:08d}.pt'})" in second.stdout
    assert f"finished at step {step + 10}" in second.stdout
    assert json.loads(status.read_text())["step"] == step + 10
