"""docs/root-actions.md's "Who runs what on a node" table stays complete: every unit template, timer and drop-in
a role renders, and every task that runs as root on a path a job's user can reach, has a row.

A row names what it is about in its first column: a template by its path (`roles/<role>/templates/<file>`),
a task by its task file's path and its name in double quotes. A row's user column is never empty.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
SECTION = "# Who runs what on a node"
# Unit files, timers and drop-ins the roles render (nft scripts, apt pins and the like start nothing).
UNIT_TEMPLATES = ("*.service.j2", "*.timer.j2", "*-order.conf.j2", "worker.conf.j2")
# A job's (or the comm test user's) paths in a task, and root's record directory beside them.
JOB_PATH = re.compile(
    r"\.state_dir\b|\bworkdir\b|\bcheckpoint_dir\b|comm_test_state_dir|_nccl_network_result_file|_torchrun_records_root"
)
# Modules that act on no node file.
NO_FILE = {"ansible.builtin.fail", "ansible.builtin.assert", "ansible.builtin.debug", "ansible.builtin.set_fact"}


def table_rows(text: str) -> list[list[str]]:
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines[1:]]


def tasks(node, inherited_become_user: bool = False):
    if isinstance(node, list):
        for item in node:
            yield from tasks(item, inherited_become_user)
    elif isinstance(node, dict):
        become_user = inherited_become_user or bool(node.get("become_user"))
        if "block" in node:
            for key in ("block", "rescue", "always"):
                yield from tasks(node.get(key, []), become_user)
        elif "name" in node:
            yield node, become_user


def root_tasks_on_job_paths() -> list[tuple[str, str]]:
    found = []
    for path in sorted(REPO.glob("roles/*/tasks/*.yml")):
        for task, become_user in tasks(yaml.safe_load(path.read_text()) or []):
            module = next((key for key in task if "." in key), "")
            body = yaml.safe_dump({key: value for key, value in task.items() if key != "name"})
            if module not in NO_FILE and not become_user and JOB_PATH.search(body):
                found.append((str(path.relative_to(REPO)), task["name"]))
    return found


def unit_templates() -> list[str]:
    return sorted(
        {str(p.relative_to(REPO)) for pattern in UNIT_TEMPLATES for p in REPO.glob(f"roles/*/templates/{pattern}")}
    )


ROWS = table_rows((REPO / "docs" / "root-actions.md").read_text())


def test_every_unit_template_has_a_row():
    named = " ".join(row[0] for row in ROWS)
    missing = [path for path in unit_templates() if f"`{path}`" not in named]
    assert not missing, "unit templates without a row in docs/root-actions.md:\n" + "\n".join(missing)


def test_every_root_task_on_a_job_path_has_a_row():
    missing = [
        f'{path} "{name}"'
        for path, name in root_tasks_on_job_paths()
        if not any(f"`{path}`" in row[0] and f'"{name}"' in row[0] for row in ROWS)
    ]
    assert not missing, "root tasks on a job's paths without a row in docs/root-actions.md:\n" + "\n".join(missing)


def test_every_row_says_who_runs_it():
    assert len(ROWS) > 20
    assert all(len(row) == 5 and row[2] for row in ROWS), [row for row in ROWS if len(row) != 5 or not row[2]]


def test_the_checks_see_what_they_must():
    # The torchrun role's units and its root tasks on a job's directories are found, and a task run as the
    # job's user is not one of them.
    templates = unit_templates()
    assert "roles/torchrun/templates/budgetgpu-job.service.j2" in templates
    assert "roles/gpu_health/templates/budgetgpu-gpu-health.timer.j2" in templates
    found = root_tasks_on_job_paths()
    assert ("roles/torchrun/tasks/install.yml", "Create the jobs' parent, record and state directories") in found
    assert ("roles/nccl_network/tasks/comm_test.yml", "Create the test's state directory") in found
    assert not [name for _path, name in found if "as the job's user" in name]
