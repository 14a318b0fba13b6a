"""container_runtime's daemon.json merge and its reload-or-restart decision, evaluated by Ansible.

The role's own defaults and vars files are loaded into a play on a fake host; each case
sets what daemon.json holds now and reads back the merged content and the decision.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import run_playbook

REPO = Path(__file__).resolve().parents[3]
ROLE = REPO / "roles/container_runtime"
PLAYBOOK = f"""\
- name: Evaluate the merge
  hosts: all
  gather_facts: false
  vars_files:
    - {ROLE}/defaults/main.yml
    - {ROLE}/vars/Debian.yml
    - {ROLE}/vars/main.yml
  tasks:
    - name: Write the result
      ansible.builtin.copy:
        content: >-
          {{{{ {{'desired': _container_runtime_desired,
                'restart': _container_runtime_restart_needed}} | to_json }}}}
        dest: "{{{{ result_file }}}}"
        mode: "0644"
"""


def merge(tmp_path: Path, current: dict, **role_vars) -> tuple[dict, bool]:
    result_file = tmp_path / "result.json"
    variables = {"_container_runtime_current": current, "result_file": str(result_file), **role_vars}
    result = run_playbook(tmp_path, PLAYBOOK, variables, host="node3")
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(result_file.read_text())
    return data["desired"], data["restart"]


NVIDIA = {"nvidia": {"path": "nvidia-container-runtime", "args": []}}


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("merge")


def test_fresh_file_gets_live_restore_and_the_nvidia_runtime_by_reload(module_tmp):
    desired, restart = merge(module_tmp, {})
    assert desired == {"live-restore": True, "runtimes": NVIDIA}
    assert restart is False  # both keys are reloadable


def test_users_keys_survive_and_a_storage_driver_needs_a_restart(module_tmp):
    current = {"log-level": "warn", "runtimes": {"mine": {"path": "/usr/sbin/runc"}}}
    desired, restart = merge(module_tmp, current, container_runtime_daemon_config={"storage-driver": "vfs"})
    assert desired == {
        "log-level": "warn",
        "runtimes": {"mine": {"path": "/usr/sbin/runc"}, **NVIDIA},
        "live-restore": True,
        "storage-driver": "vfs",
    }
    assert restart is True


def test_converged_file_is_left_as_it_is(module_tmp):
    current = {"live-restore": True, "runtimes": NVIDIA, "storage-driver": "vfs", "debug": False}
    desired, restart = merge(module_tmp, current, container_runtime_daemon_config={"storage-driver": "vfs"})
    assert desired == current
    assert restart is False


def test_live_restore_turned_off_by_hand_is_turned_on_again_by_reload(module_tmp):
    desired, restart = merge(module_tmp, {"live-restore": False, "runtimes": NVIDIA})
    assert desired["live-restore"] is True
    assert restart is False


def test_default_runtime_only_when_asked_and_no_runtime_without_the_toolkit(module_tmp):
    desired, _unused = merge(module_tmp, {}, container_runtime_nvidia_default_runtime=True)
    assert desired["default-runtime"] == "nvidia"
    desired, _unused = merge(module_tmp, {}, container_runtime_nvidia_toolkit=False)
    assert desired == {"live-restore": True}
