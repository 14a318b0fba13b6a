"""slurm_batch: the training jobs of slurm_jobs checked against the Slurm nodes' GPUs by the job model's
rules, and given their #SBATCH options, environment and arguments; the batch script rendered from them
runs torchrun.sbatch with that environment (bash reads it back)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.jobs import (
    TRAINING_SETTINGS,
    torchrun_environment,
    torchrun_job_normalize,
)
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.slurm_batch import batch_jobs
from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import REPO, output_of, run_playbook


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


RENDER = """\
- name: Render a batch script and its environment as role slurm does
  hosts: all
  gather_facts: false
  tasks:
    - name: Render the job's script and environment
      ansible.builtin.template:
        src: "{{ test_repo }}/roles/slurm/templates/{{ item }}"
        dest: "{{ test_out }}/{{ item }}"
        mode: "0644"
      loop: [slurm-job.sbatch.j2, slurm-job-environment.j2]
      vars:
        role_path: "{{ test_repo }}/roles/slurm"
        _slurm_home: /opt/s
        _slurm_jobs_dir: "{{ test_out }}"
        job: "{{ test_job }}"
"""


def render(tmp_path: Path, job: dict) -> str:
    """The role's templates as Ansible renders them, for the job as batch_jobs gives it (role slurm's plan): the
    script's text (the environment file lies beside it as <job>.env, where the script looks)."""
    variables = {
        "test_repo": str(REPO),
        "test_out": str(tmp_path),
        "test_job": batch_jobs([job], NODES, {}, "node7")[0],
    }
    result = run_playbook(tmp_path, RENDER, variables)
    assert result.returncode == 0, output_of(result)
    (tmp_path / "slurm-job-environment.j2").rename(tmp_path / f"{job['name']}.env")
    return (tmp_path / "slurm-job.sbatch.j2").read_text()


def test_the_batch_script_carries_torchrun_sbatchs_options_and_hands_it_the_environment(tmp_path):
    job = {"name": "q", "script": "/srv/my train.py", "args": ["--lr", "1e-3; rm -rf /"], "nodes": 2,
           "environment": {"NOTE": "it's $HOME"}, "group": "ml-team"}  # fmt: skip
    text = render(tmp_path, job)
    # The entry's environment is in the file only its group reads, not in the script every user reads.
    assert "it's" not in text and "NOTE" not in text
    assert "NOTE='it'\"'\"'s $HOME'" in (tmp_path / "q.env").read_text()
    # torchrun.sbatch's own lines, then the job's; sbatch reads them up to the first command.
    assert [line for line in text.splitlines() if line.startswith("#SBATCH")] == [
        "#SBATCH --ntasks-per-node=1", "#SBATCH --requeue", "#SBATCH --open-mode=append",
        "#SBATCH --job-name=q", "#SBATCH --nodes=2", "#SBATCH --gres=gpu:1",
    ]  # fmt: skip
    assert text.index("#SBATCH --gres") < text.index("set -euo pipefail")
    # bash runs it up to the exec: torchrun.sbatch stands in as a script that prints what it was given.
    fake = tmp_path / "torchrun.sbatch"
    fake.write_text('#!/bin/bash\nprintf "%s\\n" "$@" "$BUDGETGPU_ACCUMULATE_STEPS" "$NOTE"\n')
    fake.chmod(0o755)
    script = tmp_path / "q.sbatch"
    script.write_text(text.replace("exec /opt/s/torchrun.sbatch", f"exec {fake}"))
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["/srv/my train.py", "--lr", "1e-3; rm -rf /", "1", "it's $HOME"]
