"""The run's one job list: torchrun's `jobs` entry point sets budgetgpu_jobs from torchrun_jobs and
every default, and refuses a torchrun_jobs that is not a list, naming it. The job defaults live in
JOB_DEFAULTS; the argument spec documents the same values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.jobs import JOB_DEFAULTS, JOB_KEYS
from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import REPO, output_of, run_playbook

PLAYBOOK = """\
- name: Work out the jobs as role probe does
  hosts: all
  gather_facts: false
  tasks:
    - name: Include the jobs entry point
      ansible.builtin.include_role:
        name: budgetgpu.cluster.torchrun
        tasks_from: jobs
    - name: Write the jobs
      ansible.builtin.copy:
        content: "{{ budgetgpu_jobs | to_json }}"
        dest: "{{ test_out }}"
        mode: "0644"
"""
JOB = {"name": "main", "script": "/srv/train.py"}


def budgetgpu_jobs(tmp_path: Path, **variables) -> list[dict]:
    out = tmp_path / "jobs.json"
    result = run_playbook(tmp_path, PLAYBOOK, {"test_out": str(out), **variables})
    assert result.returncode == 0, output_of(result)
    return json.loads(out.read_text())


def test_the_argument_spec_documents_the_job_defaults_of_the_job_model():
    spec = yaml.safe_load((REPO / "roles/torchrun/meta/argument_specs.yml").read_text())
    options = spec["argument_specs"]["main"]["options"]["torchrun_jobs"]["options"]
    assert set(options) == JOB_KEYS
    # A dict of options documents no default {} (the validator would fill it in place: test below).
    documented = {key: options[key].get("default", {} if "options" in options[key] else None) for key in JOB_DEFAULTS}
    assert documented == JOB_DEFAULTS


def test_the_argument_spec_takes_two_jobs_without_a_model():
    # A `default: {}` of model was filled in place by the first job, and the second job's model was refused.
    spec = yaml.safe_load((REPO / "roles/torchrun/meta/argument_specs.yml").read_text())
    validator = ArgumentSpecValidator(spec["argument_specs"]["main"]["options"])
    result = validator.validate({"torchrun_jobs": [JOB, {**JOB, "name": "other"}]})
    assert result.error_messages == []


def test_the_job_user_is_torchrun_user_then_budgetgpu_user(tmp_path: Path):
    # preflight once checked jobs as budgetgpu_user while the units ran as torchrun_user.
    assert budgetgpu_jobs(tmp_path, torchrun_jobs=[JOB], torchrun_user="alice")[0]["user"] == "alice"
    assert budgetgpu_jobs(tmp_path, torchrun_jobs=[JOB], budgetgpu_user="bob")[0]["user"] == "bob"
    assert budgetgpu_jobs(tmp_path, torchrun_jobs=[JOB])[0]["user"] == "budgetgpu"


def test_job_keys_win_over_job_defaults_over_the_shared_settings(tmp_path: Path):
    jobs = budgetgpu_jobs(
        tmp_path,
        torchrun_jobs=[JOB, {**JOB, "name": "own", "port": 29700, "user": "carol"}],
        torchrun_job_defaults={"port": 29600, "user": "dave"},
        torchrun_user="alice",
        python_env_path="/srv/venv",
    )
    assert [(j["port"], j["user"], j["venv"]) for j in jobs] == [
        (29600, "dave", "/srv/venv"),
        (29700, "carol", "/srv/venv"),
    ]
    assert jobs[0]["unit"] == "budgetgpu-job-main.service" and jobs[0]["rendezvous"] == "c10d"


@pytest.mark.parametrize("value", [{"name": "main", "script": "/srv/train.py"}, "main"])
def test_torchrun_jobs_that_is_not_a_list_of_jobs_is_refused_by_name(tmp_path: Path, value):
    result = run_playbook(tmp_path, PLAYBOOK, {"torchrun_jobs": value, "test_out": str(tmp_path / "jobs.json")})
    assert result.returncode != 0
    out = output_of(result)
    assert "Validating arguments against arg spec 'jobs'" in out
    assert "argument 'torchrun_jobs' is of type dict" in out or "option 'torchrun_jobs' is of type str" in out
