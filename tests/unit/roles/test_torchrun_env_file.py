"""A job's environment file (its `environment:` may hold secrets) is never readable by others with its content in
it: it exists, empty, root's and mode 0640, before the template writes it. A local racer watches the first write."""

from __future__ import annotations

import os
import threading

from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import run_playbook

PLAY = """
- hosts: all
  gather_facts: false
  tasks:
    - ansible.builtin.include_role:
        name: budgetgpu.cluster.torchrun
        tasks_from: env_files.yml
"""
SECRET = "hf_0123456789abcdef"


def test_the_first_write_of_a_jobs_env_file_is_never_readable_by_others(tmp_path):
    env_file = tmp_path / "jobs" / "secret.env"
    env_file.parent.mkdir()
    job = {"name": "secret", "env_file": str(env_file), "state": "started", "env": {"HF_TOKEN": SECRET}}
    seen: list[int] = []
    done = threading.Event()

    def racer() -> None:
        # What a local user watching the directory gets: a file with content that others may read.
        while not done.is_set():
            try:
                info = os.stat(env_file)
            except FileNotFoundError:
                continue
            if info.st_size > 0 and info.st_mode & 0o007:
                seen.append(info.st_mode & 0o777)

    for _attempt in range(3):
        env_file.unlink(missing_ok=True)
        done.clear()
        watcher = threading.Thread(target=racer)
        watcher.start()
        try:
            result = run_playbook(tmp_path, PLAY, {"_torchrun_plan": [job], "torchrun_nccl_env_file": "/nonexistent"})
        finally:
            done.set()
            watcher.join()
        assert result.returncode == 0, result.stdout[-3000:]
        assert SECRET in env_file.read_text()
        assert env_file.stat().st_mode & 0o777 == 0o640
        # no_log: the job's environment is not in the run's output.
        assert SECRET not in result.stdout + result.stderr
    assert seen == [], f"others could read the env file with its content, modes {sorted(set(map(oct, seen)))}"
