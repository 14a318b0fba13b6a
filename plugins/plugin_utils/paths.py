"""Where the playbooks write on the control node: one directory, budgetgpu_state_dir."""

from __future__ import annotations

import os

# The default of budgetgpu_state_dir (XDG's state directory). scripts/nightly-reprovision, a shell
# script that runs before any inventory is read, keeps its own copy for its logs.
DEFAULT_STATE_DIR = "~/.local/state/budgetgpu"


def state_path(state_dir: str | None, name: str = "") -> str:
    """<budgetgpu_state_dir>/<name>, the default when the inventory sets none, with ~ expanded."""
    base = os.path.expanduser(state_dir or DEFAULT_STATE_DIR)
    return os.path.join(base, name) if name else base
