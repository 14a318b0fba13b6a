"""slurm_batch: the training jobs of slurm_jobs checked against the Slurm nodes' GPUs by the job model's
rules, and given their #SBATCH options, environment and arguments (the batch script rendered from them:
tests/unit/roles/test_slurm_image_jobs.py, which renders every template of the batch jobs in one run)."""

from __future__ import annotations

import pytest
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.jobs import (
    TRAINING_SETTINGS,
    torchrun_environment,
    torchrun_job_normalize,
)
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.slurm_batch import batch_jobs


def node(name: str, *types: str) -> dict:
    """A Slurm node as slurm_nodes returns it, with GPUs of these GRES types."""
    return {"host": name, "name": name, "gpus": [{"index": i, "type": kind} for i, kind in enumerate(types)]}


NODES = [node("node1", "rtx3090", "rtx3090"), node("node2", "rtx3090", "rtx3090", "rtx4090")]
HOSTVARS = {"node1": {}, "node2": {}}
SIMULATED = {"node1": {"budgetgpu_simulated": True}, "node2": {}}


def one(job: dict, nodes: list | None = None, hostvars: dict | None = None) -> dict:
    return batch_jobs([job], NODES if nodes is None else nodes, HOSTVARS if hostvars is None else hostvars, "head")[0]


def refusal(jobs: list, hostvars: dict | None = None) -> str:
    with pytest.raises(ValueError) as raised:
        batch_jobs(jobs, NODES, HOSTVARS if hostvars is None else hostvars, "head")
    return str(raised.value)


def test_a_job_gets_its_sbatch_options_and_the_training_environment_of_the_job_model():
    job = one(
        {"name": "pretrain", "script": "/srv/train.py", "args": ["--epochs", 3], "nodes": "2", "gpus_per_node": 2,
         "gpu_type": "rtx3090", "time": "1-00:00:00", "gradient_compression": "fp16", "environment": {"SEED": 7},
         "group": "ml-team"}
    )  # fmt: skip
    assert job["sbatch"] == ["--job-name=pretrain", "--nodes=2", "--gres=gpu:rtx3090:2", "--time=1-00:00:00"]
    assert job["argv"] == ["/srv/train.py", "--epochs", "3"]
    # The same variables, from the same place, as a systemd job's unit with these settings.
    unit = torchrun_job_normalize({"name": "pretrain", "script": "/srv/train.py", "gradient_compression": "fp16"})
    unit_env = torchrun_environment({**unit, "state_dir": "/x"}, "node1", {})
    shared = {key: unit_env[key] for key in unit_env if key.startswith("BUDGETGPU_") and key in job["env"]}
    # One variable per training setting of the job model.
    assert len(shared) == len(TRAINING_SETTINGS) and shared["BUDGETGPU_GRADIENT_COMPRESSION"] == "fp16"
    assert job["env"]["BUDGETGPU_VENV"] == "/opt/budgetgpu/venv" and job["user_env"] == {"SEED": "7"}
    # The entry's environment is not among what every user's copy of the script exports.
    assert "SEED" not in job["env"]


def test_a_module_job_without_gpus_or_a_type_asks_slurm_for_what_it_said():
    job = one({"name": "m", "module": "mypkg.train", "gpus_per_node": 0})
    assert job["sbatch"] == ["--job-name=m", "--nodes=1"]
    assert job["argv"] == ["--module", "mypkg.train"]
    assert one({"name": "any", "script": "/t.py", "gpus_per_node": 3})["sbatch"][-1] == "--gres=gpu:3"


def test_none_is_no_jobs():
    assert batch_jobs(None, NODES, HOSTVARS, "head") == []


@pytest.mark.parametrize(
    ("job", "said"),
    [
        ({"gpu_type": "3090"},
         "head: slurm_jobs[j].gpu_type: found '3090', expected a GRES type of the nodes: rtx3090, rtx4090"),
        ({"gpus_per_node": 3, "gpu_type": "rtx3090"},
         "slurm_jobs[j].nodes: found '1 with 3 rtx3090s each', expected at most what the nodes offer (node1 2, node2"),
        ({"nodes": 2, "gpu_type": "rtx4090"},
         "found '2 with 1 rtx4090s each', expected at most what the nodes offer (node1 0,"),
        ({"nodes": 0}, "slurm_jobs[j].nodes: found 0, expected a number of Slurm nodes, 1 or more"),
        ({"time": "2 days"}, "slurm_jobs[j].time: found '2 days', expected minutes, HH:MM:SS"),
        ({"gradient_compression": "int8"},
         "slurm_jobs[j].gradient_compression: found 'int8', expected one of none, fp16, bf16, powersgd"),
        ({"accumulate_steps": 0}, "slurm_jobs[j].accumulate_steps: found 0"),
        ({"script": None}, "slurm_jobs[j].script: found 'script=None, module=None', expected exactly one of script"),
        ({"venv": "venv"}, "slurm_jobs[j].venv: found 'venv', expected an absolute path"),
        ({"environment": {"A B": 1}, "group": "g"}, "slurm_jobs[j].environment.A B"),
        ({"environment": {"TOKEN": "x"}},
         "slurm_jobs[j].group: found None, expected the Unix group whose members submit the job, e.g. ml-team (its "
         "environment lands in a file only that group can read)"),
        ({"group": "Bad Group"}, "slurm_jobs[j].group: found 'Bad Group'"),
        ({"gpus": 2}, "slurm_jobs[j].gpus: found 2, expected one of the known keys"),
    ],
)  # fmt: skip
def test_a_bad_field_is_refused_naming_host_job_field_and_what_was_expected(job, said):
    assert said in refusal([{"name": "j", "script": "/t.py", **job}])


def test_bf16_is_refused_where_a_node_trains_on_gloo():
    said = refusal([{"name": "j", "script": "/t.py", "gradient_compression": "bf16"}], SIMULATED)
    assert "slurm_jobs[j].gradient_compression: found bf16 on backend gloo on node1, expected backend nccl" in said
    on_gpus = one({"name": "j", "script": "/t.py", "gradient_compression": "bf16"})
    assert on_gpus["env"]["BUDGETGPU_GRADIENT_COMPRESSION"] == "bf16"


def test_every_bad_job_is_named_and_two_of_one_name_are_refused():
    jobs = [{"name": "a b", "script": "/t.py"}, {"name": "x", "script": "/t.py"}, {"name": "x", "module": "m"}]
    assert "slurm_jobs: each job must be a dict" in refusal([*jobs, "job"])
    said = refusal(jobs)
    assert "head: slurm_jobs[a b].name: found 'a b'" in said
    assert "head: slurm_jobs: found two jobs named x, expected one" in said
    assert "found dict" in refusal({"name": "x"})  # type: ignore[arg-type]
