"""Run a playbook on a fake host: local connection, this Python, no fact cache, no Docker.

The role and module tests use it: bad input refused before any change, a module run for real, in a
second or two.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The checkout finds itself through .collections/ansible_collections/budgetgpu/cluster; ansible-test
# runs on a copy that already lies at <root>/ansible_collections/budgetgpu/cluster.
COLLECTIONS = REPO.parents[2] if REPO.parents[1].name == "ansible_collections" else REPO / ".collections"

# Role node_venv counts as done in this run (its own once-a-run flag): the roles that depend on it
# (torchrun, python_env, gpu_health, gpu_power, slurm) and every include of torchrun's `jobs` entry point
# (role run_inputs, hence preflight and nccl_network) would otherwise install python3-packaging and
# /opt/budgetgpu/node on this machine, and the next test would see what the last one left. A test of
# node_venv itself gives node_venv_ready false and runs in check mode.
NO_NODE_VENV_INSTALL = {"node_venv_ready": True}


def run_playbook(
    tmp_path: Path,
    playbook: str,
    extra_vars: dict,
    *,
    host: str = "node7",
    options: tuple[str, ...] = (),
    inventory: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: int = 120,
) -> subprocess.CompletedProcess[str]:
    """ansible-playbook PLAYBOOK on `host` (or on an inventory file's local hosts) with extra_vars;
    options such as --check, --tags X, --limit X; env adds to the environment (a stdout callback).

    The host is this machine: a play writes only under tmp_path, or runs in check mode."""
    path = tmp_path / "play.yml"
    path.write_text(playbook)
    variables = {"ansible_python_interpreter": sys.executable, **NO_NODE_VENV_INSTALL, **extra_vars}
    # Not PYTHONPATH: under ansible-test units, module tests get one that holds only ansible's
    # module_utils, and ansible-playbook is the controller, which needs all of ansible.
    env = {
        **{name: value for name, value in os.environ.items() if name != "PYTHONPATH"},
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_COLLECTIONS_PATH": str(COLLECTIONS),
        "ANSIBLE_CACHE_PLUGIN": "memory",
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp"),
        # The "remote" is this machine: the modules' temporary files too stay under tmp_path (not ~/.ansible).
        "ANSIBLE_REMOTE_TEMP": str(tmp_path / "remote-tmp"),
        **(env or {}),
    }
    return subprocess.run(
        [
            str(Path(sys.executable).with_name("ansible-playbook")),
            *(("-i", str(inventory)) if inventory else ("-i", f"{host},", "-c", "local")),
            *(*options, "-e", json.dumps(variables), str(path)),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=timeout,
        check=False,
    )


def local_inventory(tmp_path: Path, host_vars: dict[str, dict]) -> Path:
    """An inventory file of fake local hosts, each with its own variables (inventory host vars, which
    role defaults yield to; play vars, vars_files and role vars win over them)."""
    inventory = tmp_path / "hosts.yml"
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    inventory.write_text(json.dumps({"all": {"hosts": {name: {**local, **v} for name, v in host_vars.items()}}}))
    return inventory


def run_batch(
    tmp_path: Path,
    playbook: str,
    host_vars: dict[str, dict],
    *,
    options: tuple[str, ...] = (),
    extra_vars: dict | None = None,
) -> dict:
    """One ansible-playbook run of PLAYBOOK on several fake local hosts, each with its own variables
    (inventory host vars; extra_vars, for every host, win over them and over NO_NODE_VENV_INSTALL): one
    run for many cases instead of one each (a run costs about 3 s of start-up). Returns the json
    callback's report: {"plays": [{"tasks": [{"task", "hosts"}]}], "stats"}."""
    result = run_playbook(
        tmp_path,
        playbook,
        extra_vars or {},
        inventory=local_inventory(tmp_path, host_vars),
        options=options,
        # Many cases in one run: more time than one case's 120 s on a loaded machine.
        timeout=300,
        # The json callback is ansible.posix's: ansible-test's copy of the tree has no .collections link to
        # it, the venv's site-packages has it.
        env={"ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.json", "ANSIBLE_COLLECTIONS_SCAN_SYS_PATH": "true"},
    )
    try:
        return json.loads(result.stdout)
    except json.JSONDecodeError as error:
        raise AssertionError(f"ansible-playbook wrote no json report ({error}): {output_of(result)}") from error


def host_results(report: dict, host: str) -> list[tuple[str, dict]]:
    """(task name, result) of every task that ran on `host`, in order, from run_batch's report."""
    return [
        (task["task"]["name"], task["hosts"][host])
        for play in report["plays"]
        for task in play["tasks"]
        if host in task["hosts"]
    ]


def texts_of(value: object) -> str:
    """Every string in a task result, joined, white space folded: for substring assertions."""
    if isinstance(value, dict):
        return " ".join(texts_of(item) for item in value.values())
    if isinstance(value, list):
        return " ".join(texts_of(item) for item in value)
    return " ".join(str(value).split()) if isinstance(value, str) else ""


def output_of(result: subprocess.CompletedProcess[str]) -> str:
    """stdout and stderr with white space folded, for substring assertions."""
    return " ".join((result.stdout + result.stderr).split())


# Appended to a preflight playbook: a node with a marker file ran a step after preflight refused.
AFTER_PREFLIGHT = """- name: A later step that must not run after a failed preflight
  hosts: gpu_nodes
  gather_facts: false
  tasks:
    - name: Write a file
      ansible.builtin.copy:
        content: written
        dest: "{{ marker_dir }}/{{ inventory_hostname }}"
        mode: "0644"
"""


JOB_UNIT_PLAYBOOK = """\
- name: Render a job unit as the torchrun role does
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
    - name: Render the unit
      ansible.builtin.template:
        src: "{{ test_repo }}/roles/torchrun/templates/budgetgpu-job.service.j2"
        dest: "{{ test_out }}"
        mode: "0644"
      vars:
        _torchrun_job: >-
          {{ [{'name': 'main', 'script': '/srv/train.py', 'nodes': 'all'}]
             | budgetgpu.cluster.torchrun_jobs_normalize | first
             | combine({'exec_start': '"/opt/budgetgpu/venv/bin/python3" "/opt/budgetgpu/bin/budgetgpu-torchrun"',
                         'device_allow': [] | budgetgpu.cluster.gpu_unit_device_allow(
                           range(test_job_gpus | default(0)))})
             | combine(test_job | default({})) }}
"""


# JOB_UNIT_PLAYBOOK for several fake hosts at once: each host's test_vars set over the role's defaults and vars, which
# include_vars loads above its inventory variables (set_fact wins over both).
JOB_UNITS_PLAYBOOK = JOB_UNIT_PLAYBOOK.replace(
    "    - name: Render the unit\n",
    """    - name: Set this host's variables over the role's
      ansible.builtin.set_fact:
        "{{ item.key }}": "{{ item.value }}"
      loop: "{{ test_vars | dict2items }}"
    - name: Render the unit
""",
)


def render_job_units(tmp_path: Path, variants: dict[str, dict]) -> dict[str, Path]:
    """render_job_unit for each variant's extra_vars, in one ansible-playbook run (a fake host each; a run costs
    about 2 s of start-up); return {variant: its unit file}."""
    units = {name: tmp_path / name / "budgetgpu-job-main.service" for name in variants}
    for unit in units.values():
        unit.parent.mkdir()
    hosts = {name: {"test_vars": {**extra, "test_out": str(units[name])}} for name, extra in variants.items()}
    report = run_batch(tmp_path, JOB_UNITS_PLAYBOOK, hosts, extra_vars={"test_repo": str(REPO)})
    failed = {
        host: stats for host, stats in report["stats"].items() if stats.get("failures") or stats.get("unreachable")
    }
    assert not failed, json.dumps([result for host in failed for result in host_results(report, host)])[-3000:]
    return units


def render_job_unit(tmp_path: Path, extra_vars: dict | None = None) -> Path:
    """Render roles/torchrun's budgetgpu-job.service.j2 for a job "main" with the role's defaults and
    vars (extra_vars override them; test_job_gpus: how many GPUs of the node the job's ranks hold, 0 unless
    given; test_job: keys of the plan's job to set, such as its image); return the unit file."""
    out = tmp_path / "budgetgpu-job-main.service"
    variables = {"test_repo": str(REPO), "test_out": str(out), **(extra_vars or {})}
    result = run_playbook(tmp_path, JOB_UNIT_PLAYBOOK, variables)
    assert result.returncode == 0, output_of(result)
    return out
