"""The job model's normalisation: the one place job defaults are applied (budgetgpu_jobs)."""

from __future__ import annotations

import pytest
from ansible.errors import AnsibleFilterError
from ansible_collections.budgetgpu.cluster.plugins.filter import torchrun as torchrun_filters
from ansible_collections.budgetgpu.cluster.plugins.module_utils.unit_sandbox import unit_hardening
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.jobs import JOB_DEFAULTS, torchrun_jobs_normalize

JOB = {"name": "main", "script": "/srv/train.py"}


def test_builtin_defaults_fill_every_key():
    (job,) = torchrun_jobs_normalize([JOB])
    assert {key: job[key] for key in JOB_DEFAULTS if JOB_DEFAULTS[key] is not None} == {
        key: value for key, value in JOB_DEFAULTS.items() if value is not None
    }
    assert job["workdir"] == "/var/lib/budgetgpu/jobs/main"
    assert job["checkpoint_dir"] == "/var/lib/budgetgpu/jobs/main/checkpoints"


def test_precedence_is_builtin_then_user_and_venv_then_job_defaults_then_the_job():
    jobs = [JOB, {**JOB, "name": "own", "user": "carol", "port": "29700"}]
    first, own = torchrun_jobs_normalize(jobs, {"port": 29600, "venv": "/srv/v2"}, user="alice", venv="/srv/v1")
    assert (first["user"], first["venv"], first["port"]) == ("alice", "/srv/v2", 29600)
    assert (own["user"], own["venv"], own["port"]) == ("carol", "/srv/v2", 29700)


def test_a_jobs_store_port_is_its_port_plus_1000_unless_it_names_one():
    # Not port + 1: jobs on consecutive ports (29600, 29601) would put one job's store on the next one's rendezvous.
    jobs = [JOB, {**JOB, "name": "next", "port": "29601"}, {**JOB, "name": "own", "store_port": "31000"}]
    first, following, own = torchrun_jobs_normalize(jobs, {"port": 29600})
    assert [(job["port"], job["store_port"]) for job in (first, following, own)] == [
        (29600, 30600), (29601, 30601), (29600, 31000)
    ]  # fmt: skip


def test_empty_shared_settings_keep_the_builtin_ones():
    (job,) = torchrun_jobs_normalize([JOB], None, user="", venv=None)
    assert (job["user"], job["venv"]) == ("budgetgpu", "/opt/budgetgpu/venv")


@pytest.mark.parametrize(
    ("jobs", "defaults", "message"),
    [
        ({"name": "main"}, None, "torchrun_jobs must be a list of jobs, got dict"),
        ("main", None, "torchrun_jobs must be a list of jobs, got str"),
        (["main"], None, "torchrun_jobs: each job must be a dict, got str"),
        ([JOB], ["port"], "torchrun_job_defaults must be a dict"),
    ],
)
def test_bad_shapes_are_named_and_raise_a_filter_error_through_the_filter(jobs, defaults, message):
    with pytest.raises(ValueError, match=message):
        torchrun_jobs_normalize(jobs, defaults)
    with pytest.raises(AnsibleFilterError, match=message):
        torchrun_filters.torchrun_jobs_normalize(jobs, defaults)


def test_the_filter_file_keeps_the_names_other_plugins_import():
    assert torchrun_filters.job_master({"nodes": "g"}, {"g": ["a", "b"]}) == "a"
    assert torchrun_filters.job_master_addr({"nodes": "g", "master_addr": "10.0.0.1"}, {"g": ["a"]}, {}) == "10.0.0.1"


def test_unit_hardening_is_one_list_for_jobs_and_workers():
    no_sandbox = unit_hardening(False)
    assert no_sandbox["NoNewPrivileges"] == "yes" and no_sandbox["DevicePolicy"] == "closed"
    assert "ProtectSystem" not in no_sandbox and "PrivateDevices" not in no_sandbox
    full = unit_hardening(True, {"ProtectHome": "read-only"})
    assert full["ProtectSystem"] == "strict" and full["ProtectHome"] == "read-only"


def _slurp(data: object) -> dict:
    import base64
    import json

    return {"content": base64.b64encode(json.dumps(data).encode()).decode(), "encoding": "base64"}


def test_job_status_on_rank_0s_node_shows_step_rate_straggler_and_energy():
    from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.jobs import torchrun_job_status

    job = torchrun_jobs_normalize([{"name": "e2e", "script": "/srv/t.py"}])[0]
    unit = {"Id": job["unit"], "LoadState": "loaded", "ActiveState": "active", "SubState": "running", "NRestarts": "1"}
    line = "straggler: rank 2 (node2 CPU process 0): 40% slower than the median over the last 20 steps"
    status = _slurp({"step": 240, "steps_per_s": 5.8, "straggler": line, "time": 990.0})
    start = _slurp({"time": 900.0, "gpus": {"GPU-a": 100.0, "GPU-b": 100.0}})
    gpus = {"gpus": [{"index": 0, "uuid": "GPU-a", "energy_total_j": 3_600_100.0},
                     {"index": 1, "uuid": "GPU-b", "energy_total_j": 3_600_100.0}]}  # fmt: skip
    result = torchrun_job_status(job, unit, status, start, gpus, now=1000.0, price=0.12, currency="$")
    assert (result["step"], result["steps_per_s"], result["straggler"]) == (240, 5.8, line)
    # 2 kWh on the GPUs, and 100 s of the rest of the node at the default 200 W.
    assert result["energy"]["gpu_kwh"] == pytest.approx(2.0)
    assert result["energy"]["kwh"] == pytest.approx(2.0 + 200 * 100 / 3.6e6)
    assert result["lines"] == [
        "job e2e: unit budgetgpu-job-e2e.service active (running), restarts 1",
        "step 240, 5.80 steps/s (rank 0's status of 10 s ago)",
        line,
        "energy since the job started: 2.006 kWh (GPUs 2.000 kWh on 2 GPUs; rest of the node, CPU included,"
        " estimated at budgetgpu_node_base_watts 200 W (no RAPL reading): 0.006 kWh over 0.0 h) = $0.24 at $0.12/kWh",
    ]


def test_job_status_says_why_a_job_runs_fewer_ranks_than_planned():
    from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.jobs import torchrun_job_status

    job = torchrun_jobs_normalize([{"name": "e2e", "script": "/srv/t.py"}])[0]
    why = "3 of the 4 ranks planned: node1: 3 of 4 GPUs: left out GPU-2 quarantined since t1 (fan 0%); ..."
    status = {"step": 12, "steps_per_s": 2.0, "time": 990.0, "world": 3, "planned_world": 4, "world_change": why}
    result = torchrun_job_status(job, {"ActiveState": "active"}, _slurp(status), None, None, now=1000.0)
    assert result["lines"][3] == f"world changed: {why}"


def test_job_status_elsewhere_says_where_rank_0_is_and_survives_missing_files():
    from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.jobs import torchrun_job_status

    job = torchrun_jobs_normalize([{"name": "e2e", "script": "/srv/t.py"}])[0]
    result = torchrun_job_status(job, {"LoadState": "not-found"}, None, {"content": "bm90IGpzb24="}, None, now=5.0)
    assert result["state"] == "no unit" and result["step"] is None
    assert result["lines"][1:] == [
        "no status from rank 0 on this node (rank 0 writes it on the job's master)",
        "energy: no counters recorded at the job's start",
    ]


@pytest.mark.parametrize(
    ("gpu_count", "nproc_per_node"), [(0, "gpu"), (1, "gpu"), (4, "gpu"), (1, 1), (4, 1), (4, 2), (4, "3"), (4, 4)]
)
def test_the_gpus_a_job_holds_are_those_its_launcher_starts_it_on(gpu_count, nproc_per_node):
    # The controller (inference's placement, Slurm's GRES, the unit's DeviceAllow) and the node's launcher
    # (gpu_health.start_plan, with nothing quarantined) must agree on which GPUs a job's ranks use (a job
    # asking for more processes than the node has GPUs is the cluster check's to refuse).
    from ansible_collections.budgetgpu.cluster.plugins.module_utils.gpu_health import start_plan
    from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.jobs import job_gpus, job_nproc, job_nproc_fixed

    (job,) = torchrun_jobs_normalize([{**JOB, "nproc_per_node": nproc_per_node}])
    node = {"gpu_count": gpu_count}
    uuids = [f"GPU-{index}" for index in range(gpu_count)]
    plan = start_plan(uuids, {}, job_nproc(job, node), job_nproc_fixed(job))
    assert job_gpus(job, node) == [uuids.index(uuid) for uuid in plan["visible"]]
