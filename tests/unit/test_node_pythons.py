"""Node code under the system Python of every release docs/platforms.md lists: 3.10 (Ubuntu 22.04),
3.11 (Debian 12), 3.12 (Ubuntu 24.04), 3.13 (Debian 13). The rest of the suite runs node code in .venv's
3.11 only, so a call newer than 3.10 (`datetime.UTC`) passed it and crashed every pass of the health watch
on Ubuntu 22.04.

For each release: a node venv as role node_venv makes it (that release's python, the pinned nvidia-ml-py
and prometheus-client, the node package through a .pth), every module of the package imported, every file
of node code compiled (tests/check_node_python.py's list), and each node program's paths that need no
GPU and no torch: a watch pass over gpu_sim's NVML, gpu-probe --json over a sysfs tree, gpu-smoke on saved
outputs, gpu-power, the job recorder, the RAPL reader, Slurm's prolog/epilog and health check, the
launcher holding a job, root's looks at a venv, the reachability probe. The trainer, the DDP helper's
torch paths, the inference worker and the NCCL/torch checks need torch, which the build machines have
for 3.11 only (.venv, where their own tests run them): under the other releases they are compiled here
and held to 3.10 by vermin (make lint).

Interpreters come from /usr/bin (a machine of that release) or pyenv's builds; one missing is skipped,
naming it, except where $CI is set: CI machines carry pyenv with all four, so there a missing one fails.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pytest
from ansible_collections.budgetgpu.cluster.plugins.module_utils import gpu_health, pcie
from ansible_collections.budgetgpu.cluster.tests.unit.file_modules import load_file_module
from ansible_collections.budgetgpu.cluster.tests.unit.node_package import NODE_PACKAGES
from ansible_collections.budgetgpu.cluster.tests.unit.roles.test_node_exporter_rapl import TOP, set_counter, values
from ansible_collections.budgetgpu.cluster.tests.unit.scripts.test_gpu_health_script import GPUS, XID_79, metrics
from ansible_collections.budgetgpu.cluster.tests.unit.scripts.test_gpu_probe_and_smoke import H200_CSV
from ansible_collections.budgetgpu.cluster.tests.unit.scripts.test_job_record import FINISHED

REPO = Path(__file__).resolve().parents[2]
CHECK = load_file_module("check_node_python", REPO / "tests" / "check_node_python.py")
PINS = REPO / "roles" / "node_venv" / "files" / "requirements.txt"
GPU_SIM = REPO / "roles" / "gpu_sim" / "files"
PROFILES = GPU_SIM / "profiles"
FILES = {
    role: REPO / "roles" / role / "files"
    for role in ("torchrun", "slurm", "node_exporter", "_trusted_venv", "gpu_health", "gpu_power", "probe")
}
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the program accepts only root-owned directories")

# A node program's main() with some of its constants set (the paths a root program fixes: slurmd's tools,
# the epilog's records), the program loaded as file_modules.load_file_module loads it here.
RUN_MAIN = """
import importlib.machinery, importlib.util, json, sys
path, constants, argv = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]
loader = importlib.machinery.SourceFileLoader("program", path)
module = importlib.util.module_from_spec(importlib.util.spec_from_loader("program", loader))
loader.exec_module(module)
vars(module).update(constants)
sys.exit(module.main(argv))
"""

IMPORT_ALL = """
import importlib, json, pkgutil, sys
from importlib import metadata
import budgetgpu_node
names = sorted(info.name for info in pkgutil.iter_modules(budgetgpu_node.__path__))
for name in names:
    importlib.import_module("budgetgpu_node." + name)
import prometheus_client, pynvml
for path in sys.argv[1:]:
    with open(path, encoding="utf-8") as handle:
        compile(handle.read(), path, "exec", dont_inherit=True)
pins = {name: metadata.version(name) for name in ("nvidia-ml-py", "prometheus-client")}
print(json.dumps({"version": "%d.%d" % sys.version_info[:2], "modules": names, "pins": pins}))
"""


def pins() -> dict[str, str]:
    lines = (line.split("#")[0].strip() for line in PINS.read_text().splitlines())
    return dict(line.split("==") for line in lines if line)


def interpreter(version: str) -> str | None:
    """That release's python3: the system's where this machine is that release, else pyenv's build (the
    newest patch release)."""
    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    builds = sorted(
        pyenv.glob(f"{version}.*/bin/python{version}"),
        key=lambda path: [int(number) for number in re.findall(r"\d+", path.parts[-3])],
        reverse=True,
    )
    return next((str(path) for path in [Path(f"/usr/bin/python{version}"), *builds] if os.access(path, os.X_OK)), None)


def missing(why: str) -> NoReturn:
    if os.environ.get("CI"):
        pytest.fail(f"{why} (CI is set: the CI machines must have it)")
    pytest.skip(why)


@pytest.fixture(scope="session")
def node_wheels(tmp_path_factory) -> Path:
    """The node venv's pins, installed once into a folder every release's venv copies: both are pure
    Python (py3-none-any), so one install serves every interpreter. From the wheelhouse where
    scripts/fill-wheelhouse filled it, else PyPI."""
    target = tmp_path_factory.mktemp("node-wheels")
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile", "--only-binary=:all:"]
    wheelhouse = REPO / ".cache" / "wheelhouse"
    if wheelhouse.is_dir():
        pip += ["--find-links", str(wheelhouse)]
    argv = [*pip, "--target", str(target), "-r", str(PINS)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        missing(f"pip could not install the node venv's pins ({PINS.relative_to(REPO)}): {tail[0]}")
    return target


@dataclass(frozen=True)
class Node:
    version: str
    system: str  # the release's python3, which root's looks at a venv run
    venv: Path  # the node venv: the pins in its site-packages, the node package through a .pth
    sim: Path  # a folder holding gpu_sim's drop-in pynvml
    home: Path

    @property
    def python(self) -> str:
        return str(self.venv / "bin" / "python3")

    def run(self, *argv: str | Path, profile: str | None = None, env: dict | None = None):
        """The node venv's python on argv: -I as the units run it; with a gpu_sim profile, -s and the drop-in
        pynvml ahead of nvidia-ml-py on PYTHONPATH (the simulated node's NVML), its state in this test's folder."""
        environment = {"PATH": os.environ["PATH"], **(env or {})}
        flags = ["-I"]
        if profile:
            flags = ["-s"]
            environment |= {"PYTHONPATH": str(self.sim), "BUDGETGPU_SIM_PROFILE": str(PROFILES / f"{profile}.json")}
            environment.setdefault("BUDGETGPU_SIM_STATE", str(self.home / "sim-state.json"))
            environment.setdefault("BUDGETGPU_SIM_FAULTS", str(self.home / "no-faults.json"))
        argv = [self.python, *flags, *map(str, argv)]
        return subprocess.run(argv, capture_output=True, text=True, env=environment, timeout=120, check=False)

    def ok(self, *argv: str | Path, **kwargs) -> str:
        done = self.run(*argv, **kwargs)
        assert done.returncode == 0, f"Python {self.version}: {argv} exited {done.returncode}:\n{done.stderr}"
        return done.stdout


@pytest.fixture(scope="module", params=sorted(CHECK.RELEASES), ids=lambda v: f"py{v}")
def node(request, tmp_path_factory, node_wheels) -> Node:
    version = request.param
    system = interpreter(version)
    if system is None:
        missing(f"no Python {version} ({CHECK.RELEASES[version]}'s python3) here: pyenv install {version}")
    home = tmp_path_factory.mktemp(f"node-py{version}")
    subprocess.run([system, "-m", "venv", "--without-pip", str(home / "venv")], check=True, capture_output=True)
    site = next((home / "venv" / "lib").glob("python3*/site-packages"))
    shutil.copytree(node_wheels, site, dirs_exist_ok=True)
    # python_env's budgetgpu-node.pth gives the job venv the package the same way.
    (site / "budgetgpu-node.pth").write_text(f"{NODE_PACKAGES}\n")
    (home / "sim").mkdir()
    shutil.copy(GPU_SIM / "pynvml.py", home / "sim")
    return Node(version, system, home / "venv", home / "sim", home)


def test_every_module_imports_with_the_pins_and_every_node_file_compiles(node):
    found = json.loads(node.ok("-c", IMPORT_ALL, *CHECK.node_code()))
    assert found["version"] == node.version
    assert found["modules"] == sorted(path.stem for path in (REPO / "plugins" / "module_utils").glob("*.py"))
    assert found["pins"] == pins()


def watch_pass(node: Node, tmp_path: Path) -> tuple[Path, dict, str]:
    """A node of 4 RTX 3090 on risers (gpu_sim's sysfs, rendered by its renderer under this release)
    after two passes: GPU 2's fan stopped, then an Xid 79 in the kernel log; GPU 1 in the inventory's list.
    Returns (config file, config, the passes' output)."""
    root = tmp_path / "sys"
    assert node.ok(GPU_SIM / "render_sim.py", PROFILES / "rtx3090x4-risers.json", root).strip() == "rendered"
    (tmp_path / "kern.log").write_text("")
    faults = {GPUS[2]: {"fans": [{"speed": 0, "target": 80}], "temp": 88, "pcie_replay": 500}}
    (tmp_path / "faults.json").write_text(json.dumps(faults))
    config = {
        "host": "node1",
        "state_file": str(tmp_path / "state.json"),
        "sysfs_root": str(root),
        "kernel_log": str(tmp_path / "kern.log"),
        "quarantine": [GPUS[1]],
        "boot_links": gpu_health.boot_links(pcie.probe_pcie(str(root))),
        "metrics_file": str(tmp_path / "gpu.prom"),
    }
    path = tmp_path / "gpu-health.json"
    path.write_text(json.dumps(config))
    env = {"BUDGETGPU_SIM_FAULTS": str(tmp_path / "faults.json")}
    out = node.ok(FILES["gpu_health"] / "gpu-health", "--config", path, "pass", profile="rtx3090x4-risers", env=env)
    # The first pass starts the kernel log at its end; the second reads what came after.
    (tmp_path / "kern.log").write_text(XID_79)
    out += node.ok(FILES["gpu_health"] / "gpu-health", "--config", path, "pass", profile="rtx3090x4-risers", env=env)
    return path, config, out


def test_a_health_watch_pass_takes_the_gpu_out_and_answers_the_commands(node, tmp_path):
    path, config, out = watch_pass(node, tmp_path)
    assert any(line.startswith("<3>") and "Xid 79" in line for line in out.splitlines()), out
    assert "fan 0% (target 80%) at 88 C" in out
    found = metrics(Path(config["metrics_file"]))
    assert any(name.startswith("budgetgpu_gpu_") and GPUS[2] in name for name in found), sorted(found)
    fact = json.loads(node.ok(FILES["gpu_health"] / "gpu-health", "--config", path, "fact"))
    assert set(fact["quarantine"]) == {GPUS[1], GPUS[2]}
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", fact["updated"]), fact  # now_text(), in UTC
    assert node.run(FILES["gpu_health"] / "gpu-health", "--config", path, "check", GPUS[2]).returncode == 1
    assert node.run(FILES["gpu_health"] / "gpu-health", "--config", path, "check", GPUS[0]).returncode == 0
    released = node.ok(FILES["gpu_health"] / "gpu-health", "--config", path, "release", GPUS[2])
    assert released.startswith("node1: ") and "released" in released


def test_gpu_probe_json_over_a_sysfs_tree_and_gpu_smoke_on_the_saved_outputs(node, tmp_path, h200_sysfs):
    probe = node.ok(FILES["probe"] / "gpu-probe", "--json", "--sysfs-root", h200_sysfs, profile="h200")
    data = json.loads(probe)
    assert data["gpus"]["gpus"][0]["name"] == "NVIDIA H200"
    assert data["pcie"]["gpus"][0]["effective"]["width"] == 16
    (tmp_path / "probe.json").write_text(probe)
    report = node.ok(FILES["probe"] / "gpu-smoke", "--probe-json", tmp_path / "probe.json", "--smi-csv", H200_CSV)
    counts = re.search(r"(\d+) of (\d+) fields agree$", report.strip())
    assert counts and counts[1] == counts[2], report


def test_gpu_power_sets_a_cap_then_finds_it_set(node, tmp_path):
    config = tmp_path / "gpu-power.json"
    config.write_text(json.dumps({"node": "node1", "caps": {"04:00.0": 250}, "budget_watts": None}))
    out = node.ok(FILES["gpu_power"] / "gpu-power", "--config", config, profile="rtx3090x4-risers")
    assert out.strip().endswith("NVIDIA GeForce RTX 3090): power limit 350 W -> 250 W")
    again = node.ok(FILES["gpu_power"] / "gpu-power", "--config", config, "--json", profile="rtx3090x4-risers")
    assert json.loads(again)["changed"] is False


def test_the_job_recorder_starts_finishes_and_reads(node, tmp_path):
    records = tmp_path / "job-records" / "e2e"
    records.mkdir(parents=True, mode=0o755)
    recorder = FILES["torchrun"] / "budgetgpu-job-record"
    node.ok(recorder, "start", records, profile="rtx3090x4-risers")
    start = json.loads((records / "energy-start.json").read_text())
    assert sorted(start["gpus"]) == sorted(GPUS) and all(joules > 0 for joules in start["gpus"].values())
    node.ok(recorder, "finish", records, env=FINISHED)
    assert (records / "completed").exists()
    read = json.loads(node.ok(recorder, "read", records / "energy-start.json"))
    assert json.loads(base64.b64decode(read["content"])) == start


@as_root
def test_the_rapl_reader_counts_across_the_wrap(node, tmp_path):
    state, powercap = tmp_path / "rapl", tmp_path / "powercap"
    state.mkdir(mode=0o755)
    reader = [FILES["node_exporter"] / "budgetgpu-rapl", "--powercap-root", powercap, "--state-dir", state]
    set_counter(powercap, TOP - 4_000_000)
    node.ok(*reader)
    set_counter(powercap, 6_000_000)  # wrapped: 4 J before max_energy_range_uj, 6 J after
    node.ok(*reader)
    assert json.loads((state / "energy.json").read_text())["joules"] == pytest.approx(10)
    assert values(state / "rapl.prom")['budgetgpu_node_cpu_energy_joules_total{zone="package-0"}'] == pytest.approx(10)


def test_slurms_prolog_epilog_and_health_check(node, tmp_path):
    jobs = tmp_path / "slurm-jobs"
    job = {"SLURM_JOB_ID": "42", "SLURM_JOB_USER": "alice", "SLURM_JOB_GPUS": "0,2"}
    # The records under this test's folder, walked from there; no checkpoint root (no slurm-job.env there).
    paths = {"JOBS_DIR": str(jobs), "BASE": str(tmp_path), "JOB_ENV_FILE": str(tmp_path / "slurm-job.env")}
    energy = ["-c", RUN_MAIN, FILES["slurm"] / "budgetgpu-slurm-energy", json.dumps(paths)]
    node.ok(*energy, "start", profile="rtx3090x4-risers", env=job)
    node.ok(*energy, "end", profile="rtx3090x4-risers", env=job)
    record = json.loads((jobs / "42.json").read_text())
    assert (record["user"], record["gpus"], sorted(record["joules"])) == ("alice", [0, 2], sorted([GPUS[0], GPUS[2]]))
    # slurmd's tools: sinfo says the node is idle, scontrol writes down what it was asked.
    (tmp_path / "sinfo").write_text("#!/bin/sh\necho 'idle|none'\n")
    (tmp_path / "scontrol").write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "asked"}\n')
    for tool in ("sinfo", "scontrol"):
        (tmp_path / tool).chmod(0o755)
    _path, config, _out = watch_pass(node, tmp_path)
    tools = json.dumps({"SINFO": str(tmp_path / "sinfo"), "SCONTROL": str(tmp_path / "scontrol")})
    said = node.ok("-c", RUN_MAIN, FILES["slurm"] / "budgetgpu-slurm-health", tools, "health", config["state_file"])
    assert ": drain: " in said
    assert "State=DRAIN Reason=budgetgpu: GPU" in (tmp_path / "asked").read_text()


def test_the_launcher_holds_a_fixed_job_that_needs_a_gpu_taken_out(node, tmp_path):
    _path, config, _out = watch_pass(node, tmp_path)
    env = {"BUDGETGPU_GPUS": ",".join(GPUS), "BUDGETGPU_NPROC_FIXED": "1", "BUDGETGPU_JOB": "e2e"}
    env["BUDGETGPU_GPU_HEALTH_STATE"] = config["state_file"]
    # Held before torch is imported: the path every release's job venv takes on a quarantined GPU.
    done = node.run(FILES["torchrun"] / "budgetgpu-torchrun", "--nproc-per-node=4", "train.py", env=env)
    assert done.returncode == 75 and "job e2e held, not started" in done.stdout, done.stdout + done.stderr


def test_roots_looks_at_the_node_venv_with_the_system_python(node):
    # The venv lies under /tmp, which every user may write: root names it and reads no metadata there.
    wanted = [f"{name}=={version}" for name, version in pins().items()]
    look = [node.system, "-I", FILES["_trusted_venv"] / "venv_state.py", node.venv, *wanted]
    state = json.loads(subprocess.run(look, capture_output=True, text=True, check=True).stdout)
    assert state["exists"] and state["site_packages"].endswith(f"/lib/python{node.version}/site-packages")
    assert state["unsafe_above"].startswith("/tmp is writable by every user") and state["satisfied"] == [None, None]
    # The inference role's look at the rest of the node (its venv's is the one above, role _trusted_venv's).
    inference = REPO / "roles" / "inference" / "files" / "inference_state.py"
    args = {"wheelhouse": str(node.home), "users": ["root"]}
    look = [node.system, "-I", "-c", inference.read_text(), json.dumps(args)]
    found = json.loads(subprocess.run(look, capture_output=True, text=True, check=True).stdout)
    assert found["wheelhouse"] is False and found["users"]["root"]["uid"] == 0


def test_the_reachability_probe_reaches_its_own_listener(node):
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    argv = ["--listen", f"127.0.0.1:{port}:1", "--connect", f"self=127.0.0.1:{port}", "--timeout", "10"]
    report = json.loads(node.ok(REPO / "roles" / "nccl_network" / "files" / "reachability.py", *argv))
    assert report["ok"] and report["listening"][0]["accepted"] == 1, report


def test_the_static_check_fails_on_a_311_only_call(tmp_path):
    (tmp_path / "ok.py").write_text("import datetime\nprint(datetime.datetime.now(datetime.timezone.utc))\n")
    assert CHECK.check([tmp_path / "ok.py"]).returncode == 0
    (tmp_path / "new.py").write_text("import datetime\nprint(datetime.datetime.now(datetime.UTC))\n")
    done = CHECK.check([tmp_path / "ok.py", tmp_path / "new.py"])
    assert done.returncode == 1 and "L2: 'datetime.UTC' member requires !2, 3.11" in done.stdout, done.stdout


def test_the_static_check_covers_every_node_program():
    listed = {str(path.relative_to(REPO)) for path in CHECK.node_code()}
    assert {"roles/gpu_health/files/gpu-health", "roles/gpu_power/files/gpu-power"} <= listed
    assert {"roles/probe/files/gpu-probe", "roles/probe/files/gpu-smoke"} <= listed
    assert {"roles/torchrun/files/train_ddp.py", "plugins/module_utils/straggler.py"} <= listed
    assert {"roles/torchrun/files/budgetgpu-job-record", "roles/node_exporter/files/budgetgpu-rapl"} <= listed
    assert not any(name.startswith(("plugins/filter/", "plugins/plugin_utils/")) for name in listed)
