"""container_runtime refuses bad input in its first tasks, naming the variable and the host.

Each case runs the role's preflight with ansible-playbook on a fake host (local connection,
check mode): no node, no Docker. The preflight only reads (stat, slurp, getent).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
PLAYBOOK = """\
- name: Run container_runtime
  hosts: all
  gather_facts: false
  roles:
    - role: budgetgpu.cluster.container_runtime
"""


def run_preflight(tmp_path: Path, extra_vars: dict) -> subprocess.CompletedProcess[str]:
    playbook = tmp_path / "play.yml"
    playbook.write_text(PLAYBOOK)
    variables = {"ansible_python_interpreter": sys.executable, **extra_vars}
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_COLLECTIONS_PATH": str(REPO / ".collections"),
        "ANSIBLE_CACHE_PLUGIN": "memory",
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp"),
    }
    return subprocess.run(
        [
            str(Path(sys.executable).with_name("ansible-playbook")),
            *("-i", "node5,", "-c", "local", "--check", "--tags", "container_runtime_preflight"),
            *("-e", json.dumps(variables), str(playbook)),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )


def output_of(result: subprocess.CompletedProcess[str]) -> str:
    return " ".join((result.stdout + result.stderr).split())


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
