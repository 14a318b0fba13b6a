"""container_runtime refuses bad input in its first tasks, naming the variable and the host.

Each case runs the role's preflight with ansible-playbook on a fake host (local connection,
check mode): no node, no Docker. The preflight only reads (stat, slurp, getent).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import output_of, run_playbook

REPO = Path(__file__).resolve().parents[3]
PLAYBOOK = """\
- name: Run container_runtime
  hosts: all
  gather_facts: false
  roles:
    - role: budgetgpu.cluster.container_runtime
"""


def run_preflight(tmp_path: Path, extra_vars: dict) -> subprocess.CompletedProcess[str]:
    options = ("--check", "--tags", "container_runtime_preflight")
    return run_playbook(tmp_path, PLAYBOOK, extra_vars, host="node5", options=options)


def assert_refused(result: subprocess.CompletedProcess[str], *expected: str) -> None:
    output = output_of(result)
    assert result.returncode != 0, output
    for text in expected:
        assert text in output, output


def test_unknown_source(tmp_path):
    assert_refused(
        run_preflight(tmp_path, {"container_runtime_source": "snap"}),
        "fatal: [node5]",
        "container_runtime_source must be one of: distribution, docker, got: snap",
    )


def test_repository_url_that_is_not_http(tmp_path):
    assert_refused(
        run_preflight(
            tmp_path,
            {"container_runtime_source": "docker", "container_runtime_docker_repo_url": "download.docker.com/linux"},
        ),
        "node5: container_runtime_docker_repo_url is 'download.docker.com/linux', expected an http:// or https:// URL",
    )


def test_user_that_does_not_exist(tmp_path):
    assert_refused(
        run_preflight(tmp_path, {"container_runtime_users": ["root", "no-such-user-budgetgpu"]}),
        "node5: container_runtime_users names no-such-user-budgetgpu, not a user on this node",
    )


def test_daemon_config_of_the_wrong_type(tmp_path):
    assert_refused(
        run_preflight(tmp_path, {"container_runtime_daemon_config": ["live-restore"]}),
        "fatal: [node5]",
        "container_runtime_daemon_config",
    )


def test_good_input_passes_the_preflight(tmp_path):
    result = run_preflight(tmp_path, {"container_runtime_users": ["root"]})
    assert result.returncode == 0, output_of(result)
