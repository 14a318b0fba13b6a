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
