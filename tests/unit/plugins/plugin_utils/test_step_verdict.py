"""The verdict job_state=status prints on a job's step breakdown (plugin_utils/jobs.py step_verdict),
on made-up breakdowns: the median rank's split, the worst rank's data wait, communication not hidden
on every rank, and advice that never names what the job runs already or its backend cannot run."""

from __future__ import annotations

import pytest
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.jobs import step_verdict, torchrun_job_status


def rank(number: int, compute: float, comm: float, data: float, host: str = "node1") -> dict:
    return {"rank": number, "host": host, "local_rank": number % 4, "step_s": compute, "comm_s": comm,
            "data_s": data, "wall_s": compute + comm + data}  # fmt: skip


def status(*ranks: dict, backend: str = "nccl", compression: str = "none", accumulate: int = 1) -> dict:
    return {"ranks": list(ranks), "backend": backend, "gradient_compression": compression,
            "accumulate_steps": accumulate}  # fmt: skip


def test_a_rank_waiting_for_data_is_named_with_the_guides_fix():
    lines = step_verdict(status(rank(0, 0.6, 0.05, 0.05), rank(1, 0.6, 0.05, 0.05), rank(2, 0.6, 0.05, 0.05),
                                rank(3, 0.4, 0.05, 0.31 * 0.45 / 0.69, host="node2")))  # fmt: skip
    assert lines[1] == (
        "node2 rank 3 waits 31% of each step for data: the data loader does not keep up "
        "(more workers, or a faster CPU: the guide saw 15%)"
    )
    assert len(lines) == 2  # communication is hidden: no advice about it


def test_communication_not_hidden_on_every_rank_names_the_levers_nccl_can_run():
    lines = step_verdict(status(rank(0, 0.5, 0.45, 0.05), rank(1, 0.5, 0.45, 0.05)))
    assert lines[0] == (
        "step time 1.000 s (median of 2 ranks): compute 50%, communication not hidden 45%, waiting for data 5%"
    )
    assert lines[1] == (
        "communication not hidden by compute: 45% of a step; try gradient_compression: powersgd, "
        "fp16 (bf16 on NCCL), a larger batch per GPU, or accumulate_steps"
    )


def test_on_gloo_the_advice_is_the_measured_order_and_never_names_bf16():
    # docs/benchmarks/scaling.md: accumulation, then fp16, then PowerSGD (slower than stock DDP on gloo).
    two = (rank(0, 0.5, 0.45, 0.05), rank(1, 0.5, 0.45, 0.05))
    (line,) = step_verdict(status(*two, backend="gloo"))[1:]
    assert line.endswith("try accumulate_steps, a larger batch per process, gradient_compression: fp16, or powersgd"), (
        line
    )
    fp16 = step_verdict(status(*two, backend="gloo", compression="fp16"))[1]
    assert fp16.endswith("try accumulate_steps, a larger batch per process, or gradient_compression: powersgd")
    powersgd = step_verdict(status(*two, backend="gloo", compression="powersgd", accumulate=2))[1]
    assert powersgd.endswith("try accumulate_steps above 2, or a larger batch per process"), powersgd


def test_the_advice_leaves_out_what_the_job_runs_already():
    two = (rank(0, 0.5, 0.45, 0.05), rank(1, 0.5, 0.45, 0.05))
    fp16 = step_verdict(status(*two, compression="fp16"))[1]
    assert fp16.endswith("try gradient_compression: powersgd, a larger batch per GPU, or accumulate_steps")
    powersgd = step_verdict(status(*two, compression="powersgd", accumulate=4))[1]
    assert powersgd.endswith("try a larger batch per GPU, or accumulate_steps above 4")


def test_a_straggler_waits_least_so_the_others_wait_is_not_called_communication():
    # Rank 1 is slow: rank 0 waits for it in the all-reduce (60%), rank 1 hardly (5%).
    lines = step_verdict(status(rank(0, 0.35, 0.6, 0.05), rank(1, 0.9, 0.05, 0.05)))
    assert not any(line.startswith("communication not hidden") for line in lines)


def test_a_compute_bound_job_gets_its_split_and_no_advice():
    assert step_verdict(status(rank(0, 0.9, 0.05, 0.05), rank(1, 0.9, 0.05, 0.05))) == [
        "step time 1.000 s (median of 2 ranks): compute 90%, communication not hidden 5%, waiting for data 5%"
    ]


@pytest.mark.parametrize(
    "bad",
    [None, {}, {"ranks": []}, {"ranks": [{"rank": 0, "step_s": 0.1}]}, {"ranks": [rank(0, 0, 0, 0)]},
     {"ranks": [{**rank(0, 0.1, 0.1, 0.1), "comm_s": "x"}]}, {"ranks": "nope"}],
)  # fmt: skip
def test_a_status_without_a_whole_breakdown_gives_no_verdict(bad):
    assert step_verdict(bad) == []


def test_job_state_status_prints_the_verdict_after_the_straggler_line():
    job = {"name": "demo", "unit": "budgetgpu-job-demo.service"}
    unit = {"ActiveState": "active", "SubState": "running", "NRestarts": "0"}
    found = {**status(rank(0, 0.5, 0.45, 0.05), rank(1, 0.5, 0.45, 0.05), backend="gloo"), "step": 40,
             "steps_per_s": 1.0, "straggler": "", "time": 100.0}  # fmt: skip
    result = torchrun_job_status(job, unit, found, None, None, now=103.0)
    assert result["lines"][2] == "straggler: no report yet"
    assert result["lines"][3].startswith("step time 1.000 s (median of 2 ranks)")
    assert result["lines"][4].startswith("communication not hidden by compute: 45% of a step; try ")
    assert result["verdict"] == result["lines"][3:5]
