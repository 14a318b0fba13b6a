"""The straggler helper (plugins/module_utils/straggler.py, the node package's budgetgpu_node.straggler):
the median, the slowest rank against it, the line rank 0 logs, the status file, and the defaults kept equal to
the job model's, the communication settings. The torch part (StepTimer, wrap_ddp) runs in
test_torchrun_ddp_options.py and the cluster scenario."""

from __future__ import annotations

import json

import pytest
from ansible_collections.budgetgpu.cluster.plugins.module_utils import job_metrics, straggler
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.jobs import JOB_DEFAULTS

RankTime = straggler.RankTime


def ranks(*seconds: float, hosts: tuple[str, ...] = ("node1", "node2"), per_node: int = 4) -> list:
    return [RankTime(i, hosts[i // per_node], i % per_node, s) for i, s in enumerate(seconds)]


def test_median_of_odd_and_even_counts():
    assert straggler.median([3.0, 1.0, 2.0]) == 2.0
    assert straggler.median([4.0, 1.0, 3.0, 2.0]) == 2.5
    with pytest.raises(ValueError, match="no values"):
        straggler.median([])


def test_the_slowest_rank_is_named_with_its_node_and_gpu():
    # 8 ranks on 2 nodes; rank 5 (node2 GPU 1) computes 31% longer than the others.
    found = straggler.slowest_against_median(ranks(10, 10, 10, 10, 10, 13.1, 10, 10), steps=200)
    assert found.slowest.rank == 5 and found.straggler
    assert found.ratio == pytest.approx(0.31)
    assert found.line == "straggler: rank 5 (node2 GPU 1): 31% slower than the median over the last 200 steps"


def test_below_the_threshold_the_slowest_is_reported_but_no_straggler():
    found = straggler.slowest_against_median(ranks(10, 10.4, 10, 10), steps=50)
    assert not found.straggler and found.slowest.rank == 1
    assert found.line == (
        "step times: slowest rank 1 (node1 GPU 1) 4% slower than the median over the last 50 steps (straggler from 15%)"
    )


def test_the_threshold_is_15_percent_and_inclusive():
    assert straggler.STRAGGLER_THRESHOLD == 0.15
    assert straggler.slowest_against_median(ranks(1.0, 1.0, 1.0, 1.15), steps=1).straggler
    assert not straggler.slowest_against_median(ranks(1.0, 1.0, 1.0, 1.14), steps=1).straggler
    assert not straggler.slowest_against_median(ranks(1.0, 1.0, 1.0, 1.15), steps=1, threshold=0.2).straggler


def test_a_slow_node_against_the_median_of_two_nodes():
    # The cluster scenario: 2 nodes x 2 ranks, node2 throttled; the median is between the two nodes.
    found = straggler.slowest_against_median(ranks(1.0, 1.1, 3.0, 2.9, per_node=2), steps=20)
    assert found.slowest.rank == 2 and found.slowest.host == "node2"
    assert found.median_s == pytest.approx(2.0) and found.ratio == pytest.approx(0.5)


def test_cpu_ranks_are_called_processes_and_ties_name_the_lowest_rank():
    times = [RankTime(0, "a", 0, 2.0, "cpu"), RankTime(1, "b", 0, 2.0, "cpu"), RankTime(2, "b", 1, 1.0, "cpu")]
    found = straggler.slowest_against_median(times, steps=10)
    assert found.slowest.rank == 0 and "(a CPU process 0)" in found.line


@pytest.mark.parametrize("times", [[], [RankTime(0, "a", 0, 5.0)], ranks(0.0, 0.0, 0.0)])
def test_nothing_to_compare_gives_no_finding(times):
    assert straggler.slowest_against_median(times, steps=10) is None


def test_every_steps_comes_from_the_environment_and_defaults_to_the_job_models():
    assert JOB_DEFAULTS["straggler_every_steps"] == straggler.DEFAULT_EVERY_STEPS
    assert straggler.every_steps_from_env({}) == JOB_DEFAULTS["straggler_every_steps"]
    assert straggler.every_steps_from_env({"BUDGETGPU_STRAGGLER_EVERY_STEPS": "20"}) == 20
    assert straggler.every_steps_from_env({"BUDGETGPU_STRAGGLER_EVERY_STEPS": "0"}) == 0
    with pytest.raises(ValueError, match="BUDGETGPU_STRAGGLER_EVERY_STEPS=-3"):
        straggler.every_steps_from_env({"BUDGETGPU_STRAGGLER_EVERY_STEPS": "-3"})


def test_the_status_file_is_replaced_whole(tmp_path):
    path = tmp_path / "status.json"
    straggler.write_status(str(path), {"step": 10, "steps_per_s": 2.5, "straggler": ""})
    straggler.write_status(str(path), {"step": 20, "steps_per_s": 2.5, "straggler": "straggler: rank 1 (x GPU 1): ..."})
    status = json.loads(path.read_text())
    assert status["step"] == 20 and status["straggler"].startswith("straggler: rank 1") and status["time"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]


def test_the_step_timer_reports_only_every_n_steps_and_never_alone():
    timer = straggler.StepTimer(rank=0, world=1, device="cpu", every=2, local_rank=0)
    with timer.compute():
        pass
    assert timer.window_s >= 0
    assert [timer.step_done() for _step in range(4)] == [None] * 4  # one rank: nothing to compare


def test_the_findings_status_holds_the_ratio_and_each_ranks_step_time():
    found = straggler.slowest_against_median(ranks(10, 10, 13.1, 10, per_node=2), steps=100)
    status = found.status()
    assert status["straggler_ratio"] == pytest.approx(1.31) and status["straggler_threshold"] == 0.15
    assert status["window_steps"] == 100
    assert [{k: r[k] for k in ("rank", "host", "local_rank", "step_s")} for r in status["ranks"]] == [
        {"rank": 0, "host": "node1", "local_rank": 0, "step_s": 0.1},
        {"rank": 1, "host": "node1", "local_rank": 1, "step_s": 0.1},
        {"rank": 2, "host": "node2", "local_rank": 0, "step_s": 0.131},
        {"rank": 3, "host": "node2", "local_rank": 1, "step_s": 0.1},
    ]
    even = straggler.slowest_against_median(ranks(2, 2, per_node=2), steps=10).status()
    assert even["straggler_ratio"] == 1.0


def test_the_communication_settings_come_from_the_environment_with_the_job_models_defaults():
    from ansible_collections.budgetgpu.cluster.plugins.plugin_utils import jobs

    default = straggler.CommSettings.from_env({})
    assert {key: getattr(default, key) for key in vars(default)} == {key: JOB_DEFAULTS[key] for key in vars(default)}
    assert straggler.COMPRESSIONS == jobs.COMPRESSIONS
    env = {
        "BUDGETGPU_GRADIENT_COMPRESSION": "powersgd",
        "BUDGETGPU_POWERSGD_RANK": "4",
        "BUDGETGPU_POWERSGD_START_STEP": "50",
        "BUDGETGPU_BUCKET_CAP_MB": "100",
        "BUDGETGPU_ACCUMULATE_STEPS": "8",
    }
    assert straggler.CommSettings.from_env(env) == straggler.CommSettings("powersgd", 4, 50, 100.0, 8)
    # What the job model writes into the unit's environment is what the helper reads.
    (job,) = jobs.torchrun_jobs_normalize([{"name": "j", "script": "/s.py", "gradient_compression": "fp16",
                                            "accumulate_steps": "2"}])  # fmt: skip
    written = jobs.torchrun_environment(job, "node1", {"node1": {"simulated": True}})
    assert straggler.CommSettings.from_env(written) == straggler.CommSettings("fp16", accumulate_steps=2)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("BUDGETGPU_GRADIENT_COMPRESSION", "int8", "expected one of none, fp16, bf16, powersgd"),
        ("BUDGETGPU_ACCUMULATE_STEPS", "0", "BUDGETGPU_ACCUMULATE_STEPS=0: expected a int of at least 1"),
        ("BUDGETGPU_POWERSGD_START_STEP", "1", "BUDGETGPU_POWERSGD_START_STEP=1: expected a int of at least 2"),
        ("BUDGETGPU_BUCKET_CAP_MB", "big", "BUDGETGPU_BUCKET_CAP_MB=big: expected a float"),
    ],
)
def test_bad_communication_settings_are_refused_by_name(name, value, message):
    with pytest.raises(ValueError, match=message):
        straggler.CommSettings.from_env({name: value})


def test_bf16_is_refused_off_nccl_and_accepted_on_it():
    bf16 = straggler.CommSettings(gradient_compression="bf16")
    assert bf16.refusal("gloo") == (
        "gradient_compression bf16 needs the nccl backend, this job runs gloo: use fp16 or powersgd"
    )
    assert bf16.refusal("nccl") is None and straggler.CommSettings().refusal("gloo") is None


def test_the_status_lists_at_most_1024_ranks_with_their_breakdown():
    times = [RankTime(i, f"n{i // 8}", i % 8, 2.0, "cuda", 1.0, 0.5, 4.0) for i in range(1100)]
    status = straggler.ranks_status(times, steps=10)
    # One bound: the writer's is the watch's (job_metrics.parse_status refuses more).
    assert len(status["ranks"]) == straggler.MAX_STATUS_RANKS == job_metrics.STATUS_MAX_RANKS == 1024
    assert status["ranks"][0] == {"rank": 0, "host": "n0", "local_rank": 0, "step_s": 0.2, "comm_s": 0.1,
                                  "data_s": 0.05, "wall_s": 0.4}  # fmt: skip


def test_the_status_the_trainer_writes_is_the_watchs_schema():
    # Every field the writer puts in a rank's entry is one the watch's schema types: a field added to one
    # side and not the other fails here, not on a node.
    times = [RankTime(i, f"n{i}", 0, 2.0, "cpu", 1.0, 0.5, 4.0) for i in range(2)]
    status = {"step": 10, "steps_per_s": 1.5, "world": 2, "restarts": 0, **straggler.ranks_status(times, steps=10)}
    status |= {"backend": "gloo", "gradient_compression": "fp16", "bucket_cap_mb": 25, "accumulate_steps": 1}
    parsed = job_metrics.parse_status(json.dumps(status).encode())
    assert set(parsed["ranks"][0]) <= set(job_metrics.RANK_FIELDS)
    assert set(parsed) - {"ranks"} <= set(job_metrics.STATUS_FIELDS)
    status["ranks"][0]["comm_s"] = "slow"
    with pytest.raises(job_metrics.StatusError):
        job_metrics.parse_status(json.dumps(status).encode())
