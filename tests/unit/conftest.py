"""Shared fixtures for the unit tests.

Tests import helpers by package (`ansible_collections.budgetgpu.cluster.tests.unit.fake_host`),
never as top-level modules found through pytest's rootdir: ansible-test units imports every test
file as part of the collection's package, so only package imports work under both it and pytest."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from ansible_collections.budgetgpu.cluster.tests.unit.file_modules import load_file_module
from ansible_collections.budgetgpu.cluster.tests.unit.node_package import NODE_PACKAGES

REPO = Path(__file__).resolve().parents[2]

# Where a role run on the machine itself would leave something (roles/*/tasks, defaults, vars): the unit
# tests run roles on a local connection, as root, so each must write only under its tmp_path (or run in a
# check mode that writes nothing). A test that changed one of these made the next run pass or fail with
# what it left behind (issue 39: /opt/budgetgpu/node decided which refusal a python_env test saw).
MACHINE_PATHS = (
    "/opt/budgetgpu",
    "/etc/budgetgpu",
    "/var/lib/budgetgpu*",
    "/var/cache/budgetgpu",
    "/var/log/budgetgpu",
    "/usr/local/lib/budgetgpu*",
    "/usr/local/bin",
    "/etc/systemd/system",
    "/etc/ansible",
    "/etc/apt/sources.list.d",
    "/etc/apt/preferences.d",
    "/etc/apt/keyrings",
    "/etc/docker",
    "/etc/profile.d",
    "/etc/modprobe.d",
    "/etc/modules-load.d",
    "/etc/cron.d",
    "/etc/slurm",
    "/etc/prometheus",
)
DPKG_STATUS = Path("/var/lib/dpkg/status")


def machine_files() -> dict[str, tuple[int, ...]]:
    """Every file, folder and link under MACHINE_PATHS: (mode, owner, size, mtime) of files and links,
    (mode, owner) of folders (their entries are listed themselves)."""
    found = {}
    for top in sorted(path for pattern in MACHINE_PATHS for path in glob.glob(pattern)):
        for folder, folders, files in os.walk(top):
            for path in [folder] + [os.path.join(folder, name) for name in folders + files]:
                with contextlib.suppress(FileNotFoundError):
                    info = os.lstat(path)
                    is_folder = os.path.isdir(path) and not os.path.islink(path)
                    found[path] = (
                        (info.st_mode, info.st_uid)
                        if is_folder
                        else (info.st_mode, info.st_uid, info.st_size, info.st_mtime_ns)
                    )
    return found


_dpkg_cache: dict[tuple[int, int], frozenset[str]] = {}


def installed_packages() -> frozenset[str]:
    """name=version of every package dpkg lists as installed (read again only when its status file changed)."""
    if not DPKG_STATUS.exists():
        return frozenset()
    info = DPKG_STATUS.stat()
    key = (info.st_mtime_ns, info.st_size)
    if key not in _dpkg_cache:
        packages = set()
        for stanza in DPKG_STATUS.read_text(errors="replace").split("\n\n"):
            fields = dict(line.split(": ", 1) for line in stanza.splitlines() if ": " in line and line[0] != " ")
            if fields.get("Status") == "install ok installed":
                packages.add(f"{fields.get('Package')}={fields.get('Version')}")
        _dpkg_cache.clear()
        _dpkg_cache[key] = frozenset(packages)
    return _dpkg_cache[key]


def machine_changes(before: tuple[dict, frozenset], after: tuple[dict, frozenset]) -> list[str]:
    """What changed between two (machine_files(), installed_packages()) snapshots, one line a change."""
    (files_before, packages_before), (files_after, packages_after) = before, after
    return (
        [f"created {path}" for path in sorted(files_after.keys() - files_before.keys())]
        + [f"removed {path}" for path in sorted(files_before.keys() - files_after.keys())]
        + [
            f"changed {path}"
            for path in sorted(files_before.keys() & files_after.keys())
            if files_before[path] != files_after[path]
        ]
        + [f"installed package {name}" for name in sorted(packages_after - packages_before)]
        + [f"removed package {name}" for name in sorted(packages_before - packages_after)]
    )


@pytest.fixture(autouse=True)
def _machine_unchanged(request):
    """Fail a test that changed the machine it runs on (MACHINE_PATHS, dpkg's installed packages)."""
    before = (machine_files(), installed_packages())
    yield
    changes = machine_changes(before, (machine_files(), installed_packages()))
    if changes:
        pytest.fail(
            f"{request.node.nodeid} changed the machine outside its temporary folders (or, under pytest -n, a "
            f"test of another worker did, or someone else on this machine): {'; '.join(changes[:20])}"
            f"{f' and {len(changes) - 20} more' if len(changes) > 20 else ''}: run the role on a root under "
            "tmp_path or in check mode",
            pytrace=False,
        )


@pytest.fixture(scope="session", autouse=True)
def _apt_cache_kept(tmp_path_factory):
    """apt's package cache kept for the session, where the machine's apt configuration keeps none.

    Docker's Debian images (the build machines among them) set Dir::Cache::pkgcache "" (apt.conf.d/docker-clean):
    then every apt.Cache() parses all the archive's lists again, about 0.8 s of CPU, and the roles' apt and
    package_facts tasks open one per fake host (python_env's refusal test: 20 s of its 40). The same configuration
    plus a last part that puts the cache under the session's temporary folder; the first open makes it (apt writes
    it to a temporary file and renames it), every later one maps it. Not made here: ansible-test runs each test in
    a fork of its own, each a session, and making it in each cost 110 s of CI for the tests that open none. APT_CONFIG
    is read before the parts, so it only names the parts folder."""
    parts = Path("/etc/apt/apt.conf.d")
    if not parts.is_dir() or not shutil.which("apt-cache"):
        yield
        return
    folder = tmp_path_factory.mktemp("apt")
    (folder / "parts").mkdir()
    for part in parts.iterdir():
        (folder / "parts" / part.name).symlink_to(part)
    (folder / "parts" / "zz-budgetgpu-unit-tests").write_text(
        f'Dir::Cache::pkgcache "{folder}/pkgcache.bin";\nDir::Cache::srcpkgcache "{folder}/srcpkgcache.bin";\n'
    )
    (folder / "apt.conf").write_text(f'Dir::Etc::parts "{folder}/parts";\n')
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("APT_CONFIG", str(folder / "apt.conf"))
        yield


@pytest.fixture(scope="session")
def node_python(tmp_path_factory) -> str:
    """A node venv as role node_venv makes it, for scripts run with -I as root's units run them: the node
    package through a .pth; this venv's libraries stand in for the pinned wheels."""
    venv = tmp_path_factory.mktemp("node-venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(sysconfig.get_path("purelib", "venv", vars={"base": str(venv), "platbase": str(venv)}))
    (site / "budgetgpu-node.pth").write_text(f"{NODE_PACKAGES}\n{sysconfig.get_path('purelib')}\n")
    return str(venv / "bin" / "python3")


@pytest.fixture
def repo_root() -> Path:
    return REPO


GPU_SIM_FILES = REPO / "roles" / "gpu_sim" / "files"
PCIE_FIXTURES = REPO / "tests" / "fixtures" / "pcie"
H200 = REPO / "tests" / "fixtures" / "h200-node"


@pytest.fixture
def render_sim():
    """The gpu_sim role's renderer: render_sim.render_sysfs(profile, root)."""
    return load_file_module("render_sim", GPU_SIM_FILES / "render_sim.py")


@pytest.fixture
def sim_tree(render_sim, tmp_path):
    """Render a gpu_sim profile name or a tests/fixtures/pcie tree name; return the sysfs root."""

    def render(name: str) -> str:
        path = GPU_SIM_FILES / "profiles" / f"{name}.json"
        if not path.exists():
            path = PCIE_FIXTURES / f"{name}.json"
        root = tmp_path / f"sys-{name}"
        render_sim.render_sysfs(render_sim.load_profile(str(path)), str(root))
        return str(root)

    return render


@pytest.fixture
def h200_sysfs(tmp_path) -> str:
    """The captured H200 tree with bus/pci/devices links as links.txt shows them (absolute targets)."""
    from urllib.parse import unquote

    root = tmp_path / "h200-sys"
    shutil.copytree(H200 / "sysfs" / "sys", root)
    # The checkout stores "pci0000:00" as "pci0000%3A00": a collection may not hold file names with
    # ":" (ansible-test sanity no-illegal-filenames). The tree gets sysfs's names back here.
    for folder in sorted(root.rglob("*%*"), key=lambda path: len(path.parts), reverse=True):
        folder.rename(folder.with_name(unquote(folder.name)))
    bus = root / "bus" / "pci" / "devices"
    bus.mkdir(parents=True)
    for line in (H200 / "sysfs" / "links.txt").read_text().splitlines():
        link, target = (part.strip() for part in line.split("->"))
        (bus / Path(link).name).symlink_to(target)
    # The other functions of that node, as `ls -l` showed them (relative; not captured, so dangling).
    for line in (H200 / "sysfs" / "pci-devices-ls.txt").read_text().splitlines():
        if " -> " in line:
            name, target = line.split()[-3], line.split()[-1]
            if not (bus / name).is_symlink():
                (bus / name).symlink_to(target)
    return str(root)


@pytest.fixture
def fake_pynvml(monkeypatch, tmp_path_factory):
    """gpu_sim's pynvml drop-in, answering from the named profile (a fresh module per test)."""

    # Limits set and the simulated boot time go to the test's own state file, not /run.
    state = tmp_path_factory.mktemp("sim") / "state.json"

    def load(profile: str | None):
        path = GPU_SIM_FILES / "profiles" / f"{profile}.json" if profile else Path("/nonexistent/profile.json")
        monkeypatch.setenv("BUDGETGPU_SIM_PROFILE", str(path))
        monkeypatch.setenv("BUDGETGPU_SIM_STATE", str(state))
        return load_file_module("pynvml_sim", GPU_SIM_FILES / "pynvml.py")

    return load


@pytest.fixture
def no_numpy_path(tmp_path) -> str:
    """A PYTHONPATH that hides numpy (training venvs need not have it, and torch's object collectives,
    all_gather_object and broadcast_object_list, fail without it) and holds the node package."""
    package = tmp_path / "no_numpy" / "numpy"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ModuleNotFoundError('numpy hidden by the test', name='numpy')\n")
    return f"{package.parent}:{NODE_PACKAGES}"


# ansible-core patches sys.intern when a module under test builds an AnsibleModule; torch's
# dynamo, imported lazily by the first DDP step, then refuses the patched builtin
# ("substitute_in_graph expects a function"). Importing it first, before any test runs, keeps
# the training-script tests independent of the order tests run in.
with contextlib.suppress(ImportError):
    import torch._dynamo  # noqa: F401  # pylint: disable=unused-import
