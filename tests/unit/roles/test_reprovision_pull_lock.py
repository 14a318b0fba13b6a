"""reprovision's pull mode: the cron entry's lock has a limit. A hung ansible-pull is ended past
reprovision_timeout_seconds (exit 124) and the lock is free again, even where the run left a process of its own
behind (an ssh ControlPersist master): the next night's run is not refused for ever."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import run_playbook

ROLE = Path(__file__).resolve().parents[3] / "roles" / "reprovision"


def pull_argv(tmp_path: Path, pull_command: Path, timeout_s: int) -> list[str]:
    """The pull entry's argv as the role renders it (its defaults and vars), for a fake host."""
    play = f"""
- hosts: all
  gather_facts: false
  vars_files: [{ROLE}/defaults/main.yml, {ROLE}/vars/main.yml]
  tasks:
    - ansible.builtin.copy:
        content: "{{{{ _reprovision_pull_argv | to_json }}}}"
        dest: {tmp_path}/argv.json
        mode: "0600"
"""
    extra = {
        "reprovision_mode": "pull",
        "reprovision_log_dir": str(tmp_path / "logs"),
        "reprovision_pull_command": str(pull_command),
        "reprovision_pull_url": "https://git.example.org/ops/budgetgpu.git",
        "reprovision_timeout_seconds": timeout_s,
        "role_path": str(ROLE),
    }
    done = run_playbook(tmp_path, play, extra)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads((tmp_path / "argv.json").read_text())


def test_a_hung_pull_is_ended_at_its_limit_and_leaves_the_lock_free(tmp_path):
    (tmp_path / "logs").mkdir()
    hung = tmp_path / "ansible-pull"
    # Leaves a process of its own behind, out of its process group (as ssh's ControlPersist master does), then hangs.
    left = tmp_path / "left.pid"
    hung.write_text(f"#!/bin/sh\nsetsid sleep 60 >/dev/null 2>&1 < /dev/null &\necho $! > {left}\nexec sleep 600\n")
    hung.chmod(0o755)
    argv = pull_argv(tmp_path, hung, 2)
    lock = tmp_path / "logs" / "nightly.lock"
    assert argv[argv.index("flock") + 1 : argv.index(str(lock))] == ["-n", "-o", "-E", "75"]
    started = time.monotonic()
    # A session of its own: where the limit does not hold, the test ends what the run started, and fails.
    run = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        try:
            _out, err = run.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            run.communicate()
            raise AssertionError("the pull run still held the lock after 60 s: no limit") from None
        assert run.returncode == 124, err
        assert time.monotonic() - started < 30
        # The next run takes the lock at once (flock -n exits 75 where another holds it).
        assert subprocess.run(["flock", "-n", "-E", "75", str(lock), "true"], check=False).returncode == 0
    finally:
        if left.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(left.read_text()), signal.SIGTERM)
