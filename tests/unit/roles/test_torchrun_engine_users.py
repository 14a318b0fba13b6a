"""No job's user may use the Docker engine (issue 44 item 2): the docker group is root's equal (docker run
-v /:/host), for the user of a venv job as much as of an image job, and no job needs an engine (an image
job's unit runs its image). On the control node, before anything changes, torchrun's `jobs` entry point
(which preflight runs first) refuses container_runtime_users naming a job's user; on the node, torchrun's
preflight refuses a job's user in the docker group as the node has it. Both run here as the role runs them,
on fake local nodes whose `getent` is a script on PATH (the module runs the first getent it finds).
"""

from __future__ import annotations

import json
import os

import pytest
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.jobs import (
    engine_user_problems,
    torchrun_jobs_normalize,
)
from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import (
    host_results,
    local_inventory,
    output_of,
    run_playbook,
    texts_of,
)

PLAYBOOK = """\
- name: Torchrun's checks of the jobs' users on fake nodes
  hosts: all
  gather_facts: false
  tasks:
    - name: Work out the jobs as preflight does (role run_inputs)
      ansible.builtin.include_role:
        name: budgetgpu.cluster.torchrun
        tasks_from: jobs
    - name: Check the node's jobs as the torchrun role does
      ansible.builtin.include_role:
        name: budgetgpu.cluster.torchrun
        tasks_from: preflight
"""
# Every user exists; the docker group holds alice (a person who runs containers) and budgetgpu.
GETENT = """#!/bin/sh
case "$1" in
  passwd) echo "$2:x:1000:1000::/home/$2:/bin/sh" ;;
  group) echo "docker:x:999:alice,budgetgpu" ;;
  *) exit 2 ;;
esac
"""
# A venv job: no image.
JOB = {"name": "main", "script": "/srv/train.py", "nodes": "all", "nproc_per_node": 1}
WAY_OUT = "take budgetgpu out of container_runtime_users and out of the docker group on {host} (gpasswd -d USER docker)"


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    tmp_path = tmp_path_factory.mktemp("engine-users")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "getent").write_text(GETENT)
    (bin_dir / "getent").chmod(0o755)
    nccl_env = tmp_path / "nccl.env"
    nccl_env.write_text("")
    common = {"torchrun_jobs": [JOB], "torchrun_nccl_env_file": str(nccl_env)}
    hosts = {
        # budgetgpu trains and is in the node's docker group.
        "grouped": common,
        # The job runs as carol, whom the inventory would put in the docker group.
        "listed": {**common, "torchrun_user": "carol", "container_runtime_users": ["alice", "carol"]},
        # carol trains, alice runs containers: nothing refused.
        "apart": {**common, "torchrun_user": "carol", "container_runtime_users": ["alice"]},
        # The job is to be removed: its user is no job's.
        "removed": {"torchrun_jobs": [{**JOB, "state": "absent"}], "torchrun_nccl_env_file": str(nccl_env)},
    }
    result = run_playbook(
        tmp_path,
        PLAYBOOK,
        {},
        inventory=local_inventory(tmp_path, hosts),
        env={
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.json",
            "ANSIBLE_COLLECTIONS_SCAN_SYS_PATH": "true",
        },
        timeout=300,
    )
    try:
        return json.loads(result.stdout)
    except json.JSONDecodeError as error:
        raise AssertionError(f"ansible-playbook wrote no json report ({error}): {output_of(result)}") from error


def tasks(report: dict, host: str) -> list[tuple[str, dict]]:
    """(task name without the role's, result) of each task that ran on host."""
    return [(task.removeprefix("budgetgpu.cluster.torchrun : "), result) for task, result in host_results(report, host)]


def task_names(report: dict, host: str) -> list[str]:
    return [pair[0] for pair in tasks(report, host)]


def failed(report: dict, host: str) -> tuple[str, str]:
    """The task that failed on host and its message ("", "" where none did)."""
    for task, result in tasks(report, host):
        if result.get("failed"):
            return task, texts_of(result.get("msg"))
    return "", ""


def test_a_venv_jobs_user_in_the_nodes_docker_group_is_refused_naming_the_way_out(report):
    # The old rule refused only an image job's user: this venv job ran with an engine at hand.
    task, message = failed(report, "grouped")
    assert task == "Refuse a job whose user may use the Docker engine"
    assert message == (
        "grouped: job(s) main run as budgetgpu, in the docker group: the docker group is root's equal "
        "(docker run -v /:/host) and no job needs an engine (an image job's unit runs its image, "
        f"docs/job-images.md): {WAY_OUT.format(host='grouped')}"
    )


def test_container_runtime_users_naming_a_jobs_user_is_refused_before_the_node_is_read(report):
    task, message = failed(report, "listed")
    assert task == "Refuse container_runtime_users naming a job's user"
    assert message.startswith("listed: job(s) main run as carol, listed in container_runtime_users: ")
    assert message.endswith(WAY_OUT.format(host="listed").replace("budgetgpu", "carol"))
    # Refused by the jobs' entry point: torchrun's preflight (which reads the node) never ran there.
    assert "Read the users the jobs run as" not in task_names(report, "listed")


@pytest.mark.parametrize("host", ["apart", "removed"])
def test_a_job_whose_user_has_no_engine_passes(report, host):
    assert failed(report, host) == ("", "")
    assert "Refuse a job whose user may use the Docker engine" in task_names(report, host)


def test_the_rule_names_every_job_and_user_of_the_node_and_no_other_nodes():
    jobs = torchrun_jobs_normalize(
        [
            {"name": "a", "nodes": "gpu_nodes", "user": "bob"},
            {"name": "b", "nodes": "gpu_nodes", "user": "budgetgpu", "image": f"reg/x@sha256:{'ab' * 32}"},
            {"name": "c", "nodes": "gpu_nodes", "user": "carol"},
            {"name": "elsewhere", "nodes": "other", "user": "bob"},
            {"name": "gone", "nodes": "gpu_nodes", "user": "dave", "state": "absent"},
        ]
    )
    groups = {"gpu_nodes": ["node1"], "other": ["node2"]}
    (line,) = engine_user_problems(jobs, "node1", groups, ["budgetgpu", "bob", "dave"], "in the docker group")
    assert line.startswith("node1: job(s) a, b run as bob, budgetgpu, in the docker group: ")
    assert "take bob, budgetgpu out of container_runtime_users" in line
    assert engine_user_problems(jobs, "node1", groups, ["dave", "alice"], "in the docker group") == []
    assert engine_user_problems(jobs, "node2", groups, [], "in the docker group") == []
