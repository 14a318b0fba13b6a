"""How the example training script (roles/torchrun/files/train_ddp.py) ends when a step fails: at once, with
the traceback and exit status 1, its DataLoader workers (which ignore SIGTERM) still running. Under torchrun a
rank that hung there was killed only by the agent's SIGKILL 30 s later, on each node in turn (molecule/cluster's
killed-worker test lost a minute to it)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ansible_collections.budgetgpu.cluster.tests.unit.node_package import NODE_PACKAGES

pytest.importorskip("torch", reason="torch (CPU) from .cache/wheelhouse is not installed in this venv")

SCRIPT = Path(__file__).resolve().parents[2] / "roles" / "torchrun" / "files" / "train_ddp.py"

# Runs the script as `python train_ddp.py` does (__main__), with the job's step_done failing after step 3 as
# a collective does when a peer dies (gloo's "Read error").
FAILING_STEP = """
import runpy, sys
from budgetgpu_node import training
real = training.Job.step_done
def step_done(self, *args, **kwargs):
    real(self, *args, **kwargs)
    if self.step >= 3:
        raise RuntimeError("the collective failed: a peer died")
training.Job.step_done = step_done
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_rank_whose_step_fails_ends_at_once_with_its_loader_workers_running(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(NODE_PACKAGES), OMP_NUM_THREADS="1")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "BUDGETGPU_CHECKPOINT_DIR"):
        env.pop(name, None)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", FAILING_STEP, str(SCRIPT), "--max-steps", "50", "--log-every", "1",
         "--data-workers", "1", "--checkpoint-dir", str(tmp_path / "ckpt")],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    took = time.monotonic() - start
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "step=3 loss=" in proc.stdout
    assert proc.stderr.rstrip().endswith("RuntimeError: the collective failed: a peer died"), proc.stderr[-2000:]
    # The start (imports, the model) takes a few seconds; the hang it replaces lasted until a SIGKILL.
    assert took < 60, f"the rank took {took:.0f} s to end"
