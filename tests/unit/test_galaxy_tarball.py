"""The collection as a Galaxy user gets it: built, installed, and driven by name from elsewhere.

Builds the tarball with `ansible-galaxy collection build`, installs it with `ansible-galaxy
collection install` into a temporary collections path, and from a temporary directory outside
the checkout (no ansible.cfg: ANSIBLE_CONFIG names an empty file, HOME is temporary) checks every
playbook by its FQCN, and runs the installed nightly script as its cron entry would. Fails on a
developer-only file in the tarball (galaxy.yml's build_ignore), on the lab in it, and on a script in
it that users do not run.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PLAYBOOKS = sorted(path.stem for path in (REPO / "playbooks").glob("*.yml"))
# Never in the tarball: tests, lint, CI, the checkout's demo and its settings, changelog fragments.
DEVELOPER_PATHS = (
    "molecule/",
    "tests/",
    ".ci/",
    ".config/",
    ".collections/",
    ".venv/",
    ".cache/",
    ".whl/",
    "changelogs/fragments/",
    "inventory/demo/",
    "Makefile",
    "ansible.cfg",
    "site.yml",
    "pyproject.toml",
    "requirements-dev.txt",
    "CONTRIBUTING.md",
    ".yamllint",
    ".ansible-lint",
    ".gitignore",
    "scripts/build-node-image",
    "scripts/setup-host",
    "scripts/check-docs",
    "scripts/run-molecule",
    "scripts/demo-cluster",
)
# The lab: the benchmark programs and ci.md, the log of CI runs. In the checkout only; a copy of one
# of its files anywhere in the tarball fails as well.
LAB = REPO / "tests" / "benchmarks"
# scripts/ in the tarball: the control node's tools (nightly-reprovision: reprovision's cron entry;
# fill-wheelhouse, build-llama-server, inference-loadtest). No benchmark, no node program: those lie beside
# the roles that install them (roles/gpu_health/files/gpu-health, roles/probe/files/gpu-probe, ...).
USER_SCRIPTS = {
    "build-llama-server",
    "fill-wheelhouse",
    "inference-loadtest",
    "nightly-reprovision",
}


def tool(name: str) -> str:
    """An Ansible command: the one beside this Python (the venv), else PATH's."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if not found:
        pytest.skip(f"{name} is not installed beside {sys.executable} nor on PATH")
    return found


def run(argv: list[str], env: dict[str, str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(tarball, installed collection root, environment, working directory outside the checkout)."""
    base = tmp_path_factory.mktemp("galaxy")
    (base / "home").mkdir()
    (base / "elsewhere").mkdir()
    (base / "empty.cfg").write_text("")
    env = {key: value for key, value in os.environ.items() if not key.startswith("ANSIBLE_")}
    env.update(HOME=str(base / "home"), ANSIBLE_CONFIG=str(base / "empty.cfg"), ANSIBLE_NOCOLOR="1")
    build = run([tool("ansible-galaxy"), "collection", "build", "--output-path", str(base), str(REPO)], env, base)
    assert build.returncode == 0, build.stdout + build.stderr
    (tarball,) = base.glob("budgetgpu-cluster-*.tar.gz")
    install = [tool("ansible-galaxy"), "collection", "install", "--offline", "-p", str(base / "collections")]
    done = run([*install, str(tarball)], env, base)
    assert done.returncode == 0, done.stdout + done.stderr
    root = base / "collections" / "ansible_collections" / "budgetgpu" / "cluster"
    env.update(ANSIBLE_COLLECTIONS_PATH=str(base / "collections"), ANSIBLE_COLLECTIONS_SCAN_SYS_PATH="false")
    return tarball, root, env, base / "elsewhere"


def test_the_tarball_holds_no_developer_file(installed):
    tarball = installed[0]
    with tarfile.open(tarball) as archive:
        names = archive.getnames()
    found = [name for name in names if any(name == p.rstrip("/") or name.startswith(p) for p in DEVELOPER_PATHS)]
    found += [name for name in names if "__pycache__" in name or name.endswith(".pyc")]
    assert not found, f"developer files in {tarball.name}: {found}"


def test_the_tarball_holds_no_lab_and_only_the_scripts_users_run(installed):
    with tarfile.open(installed[0]) as archive:
        names = archive.getnames()
    lab_files = {path.name for path in LAB.iterdir()}
    assert {"ci.md", "scaling.py", "inference_batching.py"} <= lab_files, sorted(lab_files)
    lab = [name for name in names if name.startswith("tests/") or Path(name).name in lab_files]
    assert not lab, f"the lab in the tarball: {lab}"
    scripts = {name.removeprefix("scripts/") for name in names if name.startswith("scripts/")}
    assert scripts == USER_SCRIPTS, f"in the tarball or USER_SCRIPTS only: {sorted(scripts ^ USER_SCRIPTS)}"


def test_the_tarball_holds_what_galaxy_and_users_need(installed):
    with tarfile.open(installed[0]) as archive:
        names = set(archive.getnames())
    roles = sorted(path.name for path in (REPO / "roles").iterdir() if (path / "tasks").is_dir())
    wanted = {"LICENSE", "README.md", "CHANGELOG.rst", "changelogs/changelog.yaml", "meta/runtime.yml"}
    wanted |= {f"roles/{role}/README.md" for role in roles}
    wanted |= {f"playbooks/{name}.yml" for name in PLAYBOOKS}
    wanted |= {"scripts/nightly-reprovision", "inventory/example/hosts.yml"}
    # What users read of the figures: every page under docs/ (the lab's log is not one of them).
    wanted |= {str(path.relative_to(REPO)) for path in (REPO / "docs").rglob("*.md")}
    assert not wanted - names, f"missing from the tarball: {sorted(wanted - names)}"
    assert "site" in PLAYBOOKS and all("-" not in name for name in PLAYBOOKS), PLAYBOOKS


def every_playbook_by_name(installed, option: str) -> subprocess.CompletedProcess:
    """ansible-playbook <option> budgetgpu.cluster.<each playbook>, with the installed example inventory."""
    _tarball, root, env, elsewhere = installed
    names = [f"budgetgpu.cluster.{name}" for name in PLAYBOOKS]
    return run([tool("ansible-playbook"), "-i", str(root / "inventory" / "example"), option, *names], env, elsewhere)


def test_every_playbook_passes_a_syntax_check_by_its_name(installed):
    root = installed[1]
    done = every_playbook_by_name(installed, "--syntax-check")
    assert done.returncode == 0, done.stdout + done.stderr
    for name in PLAYBOOKS:
        assert f"playbook: {root}/playbooks/{name}.yml" in done.stdout, done.stdout


def test_every_playbook_lists_its_tasks_from_the_installed_roles(installed):
    done = every_playbook_by_name(installed, "--list-tasks")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    # The site playbook's step plays, and tasks of roles that only the installed collection holds here.
    for play in ("Check the control node", "Preflight the cluster", "Provision the GPU nodes", "Run the training jobs"):
        assert play in out, out
    assert "budgetgpu.cluster.probe : " in out or "probe : " in out, out
    assert "was not found" not in out, out


def tree(root: Path) -> list[str]:
    """The files under root, less Python's bytecode caches: Ansible's plugin loader imports the
    callback from the installed collection like any Python package (where PYTHONDONTWRITEBYTECODE is
    unset, as under ansible-test), and that is not the run writing its reports or logs there."""
    return sorted(str(path) for path in root.rglob("*") if "__pycache__" not in path.parts)


def test_the_installed_nightly_script_resolves_its_collection_without_a_checkout(installed, tmp_path):
    """As cron starts it: no ANSIBLE_CONFIG nor collections path, the installed collection not on
    Ansible's default path. The run reaches the site playbook's first check (an inventory without
    nodes), writes under ~/.local/state/budgetgpu/nightly, and nothing inside the collection."""
    _tarball, root, env, elsewhere = installed
    cron_env = {key: value for key, value in env.items() if not key.startswith("ANSIBLE_")}
    inventory = tmp_path / "empty-inventory.yml"
    inventory.write_text("all:\n  children:\n    gpu_nodes: {}\n")
    before = tree(root)
    argv = [sys.executable, str(root / "scripts" / "nightly-reprovision"), "--inventory", str(inventory)]
    argv += ["--ansible-playbook", tool("ansible-playbook"), "--strategy", "linear"]
    done = run(argv, cron_env, elsewhere)
    logs = Path(cron_env["HOME"]) / ".local" / "state" / "budgetgpu" / "nightly"
    log = (logs / "latest" / "ansible.log").read_text()
    assert done.returncode == 20, done.stdout + done.stderr
    assert "was not found" not in log, log
    assert "has no hosts in group gpu_nodes" in log, log
    assert f"ANSIBLE_COLLECTIONS_PATH {root.parents[2]}" in log, log
    after = tree(root)
    assert after == before, f"the run wrote into the installed collection: {sorted(set(after) - set(before))}"


CRON_COMMAND_PLAY = """
- name: Render the nightly entry of the installed collection
  hosts: localhost
  connection: local
  gather_facts: false
  tasks:
    - name: Check the inputs as the role does before it installs the entry
      ansible.builtin.include_role:
        name: budgetgpu.cluster.reprovision
        tasks_from: preflight.yml
        public: true
    # Outside the role role_path is undefined: its default for reprovision_checkout (which the
    # preflight above checked, finding the installed script) is given as it resolves there.
    - name: Write the command that cron would run
      ansible.builtin.copy:
        content: "{{ _reprovision_cron_command }}"
        dest: "{{ command_file }}"
        mode: "0644"
      vars:
        reprovision_checkout: "{{ installed_root }}"
"""


def test_the_installed_roles_cron_entry_names_its_script_playbook_and_settings(installed, tmp_path):
    """What role reprovision writes into cron from the installed collection: the installed script, the
    collection playbook, and the ansible-playbook and ansible.cfg of the run that installed it."""
    _tarball, root, env, elsewhere = installed
    play = tmp_path / "render.yml"
    play.write_text(CRON_COMMAND_PLAY)
    inventory = str(root / "inventory" / "example")
    command_file = tmp_path / "cron-command"
    done = run(
        [
            tool("ansible-playbook"),
            "-i",
            inventory,
            "-e",
            f"command_file={command_file} installed_root={root}",
            str(play),
        ],
        env,
        elsewhere,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    argv = shlex.split(command_file.read_text())
    assert argv[0].endswith(f"{root.resolve()}/scripts/nightly-reprovision"), argv
    assert argv[argv.index("--playbook") + 1] == "budgetgpu.cluster.site", argv
    assert argv[argv.index("--inventory") + 1] == inventory, argv
    assert argv[argv.index("--ansible-playbook") + 1] == str(Path(tool("ansible-playbook")).parent / "ansible-playbook")
    assert argv[argv.index("--ansible-config") + 1] == env["ANSIBLE_CONFIG"], argv


def test_the_installed_report_finds_its_dashboard_and_script_and_writes_outside_the_collection(installed, tmp_path):
    """budgetgpu.cluster.report from the installed collection, against the fake Prometheus of the report's
    own tests: the dashboard (roles/prometheus/files) and the script (playbooks/files) are found beside
    the installed playbook, the page goes under budgetgpu_state_dir, nothing into the collection."""
    from ansible_collections.budgetgpu.cluster.tests.unit.scripts.test_metrics_report import _Prometheus, _serve

    _tarball, root, env, elsewhere = installed
    before = tree(root)
    server = _serve(_Prometheus)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        argv = [tool("ansible-playbook"), "budgetgpu.cluster.report", "-e", f"report_prometheus_url={url}"]
        argv += ["-e", f"budgetgpu_state_dir={tmp_path} ansible_python_interpreter={sys.executable}"]
        done = run(argv, env, elsewhere)
    finally:
        server.shutdown()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "GPU temperature: 2 series" in done.stdout
    assert (tmp_path / "report" / "index.html").stat().st_size > 1000
    assert tree(root) == before
