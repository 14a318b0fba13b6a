"""budgetgpu_state_dir: the one directory the playbooks write to on the control node."""

from __future__ import annotations

import os

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.paths import state_path


def test_without_a_state_dir_the_default_is_under_the_users_home():
    home = os.path.expanduser("~")
    assert state_path(None, "report") == f"{home}/.local/state/budgetgpu/report"
    assert state_path("", "comm-test") == f"{home}/.local/state/budgetgpu/comm-test"


def test_the_inventorys_state_dir_wins_and_tilde_is_expanded():
    assert state_path("/srv/budgetgpu", "gpu-bench") == "/srv/budgetgpu/gpu-bench"
    assert state_path("~/cluster-a") == os.path.expanduser("~/cluster-a")
