"""Role _trusted_venv's look on a fake host (check mode, nothing written): it refuses a venv that someone
other than root may change, naming the venv as its caller does and the reason, and keeps what it found by
the venv's path for its caller (node_venv, python_env, inference)."""

from __future__ import annotations

import json

from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import output_of, run_playbook

PLAYBOOK = """\
- name: Look at a venv
  hosts: all
  gather_facts: false
  tasks:
    - name: Look
      ansible.builtin.include_role:
        name: budgetgpu.cluster._trusted_venv
        tasks_from: look
      vars:
        _trusted_venv_path: "{{ test_venv }}"
        _trusted_venv_packages: [demo==1.0]
        _trusted_venv_name: test_venv {{ test_venv }}
        _trusted_venv_advice: choose another path
    - name: Say what the look kept
      ansible.builtin.debug:
        msg: "KEPT {{ _trusted_venv_state[test_venv] | to_json }} KEPT"
"""


def test_a_venv_below_a_folder_every_user_may_write_is_refused(tmp_path):
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o1777)
    venv = tmp_path / "open" / "venv"
    result = run_playbook(tmp_path, PLAYBOOK, {"test_venv": str(venv)}, options=("--check",))
    output = output_of(result)
    assert result.returncode != 0, output
    reason = f"{tmp_path / 'open'} is writable by every user (mode 1777)"
    assert f"node7: test_venv {venv}: {reason}: choose another path" in output, output
    assert "KEPT" not in output


def test_a_venv_that_does_not_exist_yet_passes_and_is_kept_by_its_path(tmp_path):
    venv = "/nonexistent/budgetgpu-unit-test/venv"
    result = run_playbook(tmp_path, PLAYBOOK, {"test_venv": venv}, options=("--check",))
    output = output_of(result)
    assert result.returncode == 0, output
    kept = json.loads(output.split("KEPT ")[1].split(" KEPT")[0])
    assert kept["exists"] is False and kept["unsafe_above"] is None and kept["unsafe_inside"] is None
    assert kept["satisfied"] == [None] and kept["site_packages"].startswith(f"{venv}/lib/python3")
