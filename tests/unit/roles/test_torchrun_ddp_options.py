"""CI's short version of the scaling benchmark (docs/benchmarks/scaling.md): two local gloo ranks
train with each communication option through budgetgpu_straggler.wrap_ddp and the trainer's
train_step, and each rank's step breakdown (compute, communication not hidden, data wait) adds up to
its step time within 10%; a rank slowed on purpose is named the straggler while DDP keeps its
overlap; the trainer itself takes the job's settings from the unit's environment and writes the
breakdown to its status file.

Each option is also seen taking effect in what DDP sends (the worker records every all-reduce torch's
hooks issue and every bucket DDP hands the job's hook): fp16's half-precision gradients in half the
bytes, more buckets for a smaller bucket_cap_mb, one all-reduce round per optimizer step under
accumulate_steps, and PowerSGD's rank-r factors from its start step on."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.jobs import step_verdict

torch = pytest.importorskip("torch", reason="torch (CPU) from .cache/wheelhouse is not installed in this venv")

FILES = Path(__file__).resolve().parents[3] / "roles" / "torchrun" / "files"
WORKER = Path(__file__).with_name("ddp_options_worker.py")
OPTIONS = ("none", "fp16", "powersgd", "powersgd_buckets", "bucket_cap_mb", "accumulate_steps")
MIB = 1024 * 1024


def torchrun(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *argv]
    run_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    proc = subprocess.run(command, env=run_env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def adds_up(rank: dict) -> bool:
    parts = rank["step_s"] + rank["comm_s"] + rank["data_s"]
    return abs(parts - rank["wall_s"]) <= 0.10 * rank["wall_s"]


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    """One torchrun of the worker for every option (one start of torch, not five). With numpy, which
    PowerSGD needs (python_env installs it into the job venvs)."""
    pytest.importorskip("numpy", reason="PowerSGD needs numpy")
    out = tmp_path_factory.mktemp("ddp") / "found.json"
    torchrun(str(WORKER), str(FILES), str(out))
    return json.loads(out.read_text())


@pytest.mark.parametrize("option", OPTIONS)
def test_each_option_trains_and_its_breakdown_adds_up_to_the_step_time(measured, option):
    found = measured[option]
    losses = found["losses"]
    assert sum(losses[-4:]) < sum(losses[:4]), losses  # it learns (12 noisy steps: the ends' means)
    assert found["in_sync"] == 0, found  # both ranks hold the same parameters: DDP averaged alike
    ranks = found["status"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and found["status"]["window_steps"] == 12
    assert all(adds_up(r) for r in ranks), ranks
    # DDP's own all-reduce ran in backward: the timing hook marked the last bucket, so some of the
    # step is communication apart from compute (none would mean the hook never ran).
    assert all(r["comm_s"] > 0 for r in ranks), ranks
    assert found["comm_state"] == ("PowerSGDState" if option.startswith("powersgd") else "NoneType")


def test_a_slowed_rank_is_named_the_straggler_with_the_overlap_on(measured):
    found = measured["slow rank 1"]
    assert found["line"].startswith("straggler: rank 1 ("), found["line"]
    fast, slow = found["status"]["ranks"]
    # The fast rank waits for the slow one in communication, not in its compute.
    assert slow["step_s"] > 1.5 * fast["step_s"] and fast["comm_s"] > slow["comm_s"], (fast, slow)
    assert all(adds_up(r) for r in (fast, slow))


def test_bf16_on_gloo_is_refused_with_the_reason(measured):
    assert measured["bf16"] == (
        "gradient_compression bf16 needs the nccl backend, this job runs gloo: use fp16 or powersgd"
    )


def sent(found: dict, step: int) -> list[tuple[str, int, int]]:
    """(dtype, elements, bytes) of each all-reduce the option's hook issued in a step, in order."""
    return [(dtype, elements, nbytes) for s, _micro, dtype, elements, nbytes in found["all_reduces"] if s == step]


def buckets(found: dict, step: int) -> list[tuple[int, int, int]]:
    """(micro-batch, bucket index, elements) of each bucket DDP handed the job's hook in a step."""
    return [(micro, index, elements) for s, micro, index, elements in found["buckets"] if s == step]


def gradient_elements(measured: dict) -> int:
    return sum(math.prod(shape) for shape in measured["model"]["shapes"])


def test_fp16_sends_every_gradient_as_float16_in_half_the_bytes(measured):
    elements = gradient_elements(measured)
    for step in range(measured["model"]["steps"]):
        plain, fp16 = sent(measured["none"], step), sent(measured["fp16"], step)
        assert {dtype for dtype, _e, _b in plain} == {"torch.float32"}, plain
        assert {dtype for dtype, _e, _b in fp16} == {"torch.float16"}, fp16
        assert sum(e for _d, e, _b in fp16) == sum(e for _d, e, _b in plain) == elements
        assert 2 * sum(b for _d, _e, b in fp16) == sum(b for _d, _e, b in plain) == 4 * elements


def test_a_smaller_bucket_cap_splits_the_gradients_into_more_buckets(measured):
    # DDP rebuilds its buckets after the first step, in the order gradients became ready: the last step's.
    last = measured["model"]["steps"] - 1
    default, small = buckets(measured["none"], last), buckets(measured["bucket_cap_mb"], last)
    assert [index for _m, index, _e in default] == [0]  # the model's 0.6 MB in one bucket of 25 MB
    assert [index for _m, index, _e in small] == list(range(len(small))) and len(small) > 1, small
    assert sum(e for _m, _i, e in small) == sum(e for _m, _i, e in default) == gradient_elements(measured)
    # DDP closes a bucket once it holds the cap: every bucket but the last reached it.
    cap_bytes = measured["bucket_cap_mb"]["settings"]["bucket_cap_mb"] * MIB
    assert all(4 * e >= cap_bytes for _m, _i, e in small[:-1]), small


def test_accumulation_all_reduces_once_per_optimizer_step_after_the_last_micro_batch(measured):
    found = measured["accumulate_steps"]
    micro = found["settings"]["accumulate_steps"]
    steps = measured["model"]["steps"]
    assert micro > 1 and found["micro_batches"] == [micro] * steps
    # One bucket (as without accumulation), all-reduced in the last micro-batch's backward only: the
    # earlier ones ran under no_sync.
    assert [(step, *bucket) for step in range(steps) for bucket in buckets(found, step)] == [
        (step, micro - 1, 0, gradient_elements(measured)) for step in range(steps)
    ]
    assert sum(nbytes for *_unused, nbytes in found["all_reduces"]) == steps * 4 * gradient_elements(measured)


def test_powersgd_sends_rank_r_factors_of_the_weight_matrices_from_its_start_step(measured):
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    found = measured["powersgd"]
    rank, start = found["settings"]["powersgd_rank"], found["settings"]["powersgd_start_step"]
    elements = gradient_elements(measured)
    # PowerSGD sees each gradient as an n x (the rest) matrix and sends the ones worth it (torch's own
    # rule) as P (n x rank) and Q (m x rank); the model has two such matrices at rank 2.
    matrices = [(shape[0], math.prod(shape[1:])) for shape in measured["model"]["shapes"] if len(shape) > 1]
    factored = [(n, m) for n, m in matrices if _should_compress(n, m, rank, found["min_compression_rate"])[0]]
    assert rank > 1 and len(factored) == 2, factored
    whole = elements - sum(n * m for n, m in factored)
    # Plain all-reduces of the whole bucket before the start step (its error feedback needs them);
    # from it on the gradients it leaves whole, then every P, then every Q.
    for step in range(measured["model"]["steps"]):
        expected = (
            [elements]
            if step < start
            else [whole, rank * sum(n for n, _m in factored), rank * sum(m for _n, m in factored)]
        )
        assert [e for _d, e, _b in sent(found, step)] == expected, (step, sent(found, step))


def test_the_trainer_takes_the_jobs_settings_and_writes_the_breakdown(tmp_path):
    pytest.importorskip("numpy", reason="PowerSGD needs numpy")
    status_file = tmp_path / "status.json"
    env = {
        "BUDGETGPU_DIST_BACKEND": "gloo",
        "BUDGETGPU_GRADIENT_COMPRESSION": "powersgd",
        "BUDGETGPU_POWERSGD_START_STEP": "2",
        "BUDGETGPU_ACCUMULATE_STEPS": "2",
        "BUDGETGPU_STRAGGLER_EVERY_STEPS": "5",
        "BUDGETGPU_STATUS_FILE": str(status_file),
    }
    torchrun(str(FILES / "train_ddp.py"), "--max-steps", "10", "--log-every", "5", "--hidden", "128", "--layers", "1",
             "--data-delay", "0.1", "--checkpoint-dir", str(tmp_path / "ckpt"), env=env)  # fmt: skip
    status = json.loads(status_file.read_text())
    assert status["gradient_compression"] == "powersgd" and status["accumulate_steps"] == 2
    assert status["backend"] == "gloo" and status["step"] == 10
    assert [r["rank"] for r in status["ranks"]] == [0, 1] and all(adds_up(r) for r in status["ranks"])
    # Two micro-batches of 100 ms each per step from one loader worker, which runs ahead only while the
    # rank computes and communicates (a few ms here, some tens on a loaded machine: 20 ms batches let a
    # rank wait under 10 ms in CI): the rank waits for data, and the verdict says so.
    assert all(r["data_s"] > 0.05 for r in status["ranks"]), status["ranks"]
    assert any(" waits " in line and "for data: the data loader does not keep up" in line
               for line in step_verdict(status)), status  # fmt: skip
