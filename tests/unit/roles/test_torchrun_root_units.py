"""Nothing of a job's runs as root: the job's unit (which reads the job's environment, PATH, PYTHONPATH and
LD_PRELOAD included) has no root line, and root's part of a start and of a clean end runs in units of root's
own that read no environment of the job's.

systemd hands every Exec line of a unit, "+" ones too, the unit's Environment= and EnvironmentFile=: a "+",
"!" or "!!" line in the job's unit would run as root with the job's PATH (the recorder's interpreter, `touch`),
PYTHONPATH (a sitecustomize.py) or LD_PRELOAD. The templates are rendered with the role's defaults and vars
by ansible-playbook (local connection, no node).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils import jobs
from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import output_of, run_playbook

REPO = Path(__file__).resolve().parents[3]
TEMPLATES = REPO / "roles" / "torchrun" / "templates"
HOSTILE_ENV = {
    "PATH": "/var/lib/budgetgpu/jobs/main/bin:/usr/bin:/bin",
    "PYTHONPATH": "/var/lib/budgetgpu/jobs/main/py",
    "LD_PRELOAD": "/var/lib/budgetgpu/jobs/main/evil.so",
    "PYTHONHOME": "/var/lib/budgetgpu/jobs/main",
    "LD_LIBRARY_PATH": "/var/lib/budgetgpu/jobs/main/lib",
}
# An Exec line whose prefixes hold "+" (full privileges), "!" or "!!" (no User=): run as root.
ROOT_LINE = re.compile(r"^Exec\w+=[-@:|]*(\+|!)", re.MULTILINE)
PLAYBOOK = """\
- name: Render the torchrun role's units as the role does
  hosts: all
  gather_facts: false
  tasks:
    - name: Load the role's defaults and vars
      ansible.builtin.include_vars:
        file: "{{ item }}"
      loop:
        - "{{ test_repo }}/roles/node_venv/defaults/main.yml"
        - "{{ test_repo }}/roles/node_venv/vars/main.yml"
        - "{{ test_repo }}/roles/torchrun/defaults/main.yml"
        - "{{ test_repo }}/roles/torchrun/vars/main.yml"
    - name: Render the job's unit and env file, and root's units
      ansible.builtin.template:
        src: "{{ test_repo }}/roles/torchrun/templates/{{ item }}.j2"
        dest: "{{ test_out }}/{{ item }}"
        mode: "0644"
      loop: "{{ ['budgetgpu-job.service', 'job.env'] + _torchrun_record_units }}"
      vars:
        __torchrun_nccl_env: {stat: {}}
"""


@pytest.fixture(scope="module")
def units(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("units")
    job = jobs.torchrun_job_normalize(
        {"name": "main", "script": "/srv/train.py", "nodes": "all", "environment": HOSTILE_ENV}
    )
    job["exec_start"] = '"/opt/budgetgpu/venv/bin/python3" "/opt/budgetgpu/bin/budgetgpu-torchrun"'
    job["env"] = jobs.torchrun_environment(job, "node7", {})
    out = tmp / "out"
    out.mkdir()
    result = run_playbook(tmp, PLAYBOOK, {"test_repo": str(REPO), "test_out": str(out), "_torchrun_job": job})
    assert result.returncode == 0, output_of(result)
    return {path.name: path.read_text() for path in out.iterdir()}


def directives(unit: str, key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in unit.splitlines() if line.startswith(f"{key}=")]


def test_the_job_defines_its_environment_and_the_job_unit_has_no_root_line(units):
    env = units["job.env"]
    for name in HOSTILE_ENV:
        assert re.search(rf'^{name}="', env, re.MULTILINE), name  # the job's variables reach its unit
    unit = units["budgetgpu-job.service"]
    assert directives(unit, "User") == ["budgetgpu"]
    assert ROOT_LINE.findall(unit) == [], ROOT_LINE.findall(unit)
    assert [line for line in unit.splitlines() if line.startswith("Exec")] == [
        'ExecStart="/opt/budgetgpu/venv/bin/python3" "/opt/budgetgpu/bin/budgetgpu-torchrun"'
    ]


def test_the_check_sees_every_form_of_a_root_line():
    for line in (
        "ExecStartPre=+/bin/rm x",
        "ExecStartPre=-+/x",
        "ExecStopPost=!/bin/sh",
        "ExecStart=!!/x",
        "ExecStartPost=@-+/x",
    ):
        assert ROOT_LINE.search(line), line
    for line in ("ExecStart=/usr/bin/python3 -I x", "ExecStartPre=-/bin/true", "ExecStart=@/bin/sh sh"):
        assert not ROOT_LINE.search(line), line


def test_roots_units_are_named_by_the_job_unit_and_read_no_environment_of_the_jobs(units):
    unit = units["budgetgpu-job.service"]
    assert "budgetgpu-job-start@main.service" in directives(unit, "Wants")[0].split()
    assert "budgetgpu-job-start@main.service" in directives(unit, "After")[0].split()
    assert directives(unit, "OnSuccess") == ["budgetgpu-job-finish@main.service"]
    # What root trusts lies in root's directory, not in the job's.
    assert directives(unit, "ConditionPathExists") == ["!/var/lib/budgetgpu/job-records/main/completed"]
    for name, action in (("budgetgpu-job-start@.service", "start"), ("budgetgpu-job-finish@.service", "finish")):
        root = units[name]
        assert not directives(root, "User") and not directives(root, "EnvironmentFile"), name
        assert not directives(root, "Environment") and not directives(root, "PassEnvironment"), name
        assert directives(root, "ExecStart") == [
            f"/opt/budgetgpu/node/bin/python3 -I /opt/budgetgpu/node/bin/budgetgpu-job-record {action} "
            "/var/lib/budgetgpu/job-records/%i"
        ]
        assert directives(root, "ReadWritePaths") == ["-/var/lib/budgetgpu/job-records/%i"]
        assert directives(root, "ProtectSystem") == ["strict"]
    for path in TEMPLATES.glob("*.service.j2"):
        assert ROOT_LINE.findall(path.read_text()) == [], path.name
