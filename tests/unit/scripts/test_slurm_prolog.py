"""roles/slurm/files/budgetgpu-slurm-energy, Slurm's Prolog and Epilog (root, by slurmd): always exit 0 within
their deadline (a node package that does not import, a full disk, an NVML that hangs, an nft that fails), each
job's energy by its GPUs' device minors and UUIDs, the job user's checkpoint directory made by root before anyone
else, and the job's two ports given to its user (nft) and taken back."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
from ansible_collections.budgetgpu.cluster.tests.unit.file_modules import load_file_module
from ansible_collections.budgetgpu.cluster.tests.unit.node_package import NODE_PACKAGES

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "roles" / "slurm" / "files" / "budgetgpu-slurm-energy"
GPU_SIM = REPO / "roles" / "gpu_sim" / "files"
PROFILE = GPU_SIM / "profiles" / "rtx3090x4-risers.json"
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="root's directories and a directory given to a user")
JOB = {"SLURM_JOB_ID": "42", "SLURM_JOB_USER": "nobody", "SLURM_JOB_GPUS": "2"}
HANG = "import time\n\nclass NVMLError(Exception):\n    pass\n\ndef nvmlInit():\n    time.sleep(600)\n"


def node_python(folder: Path, *first: Path) -> str:
    """A node venv as role node_venv makes it (the node package through a .pth), with the folders `first`
    ahead of it: a pynvml or a budgetgpu_node of the test's own."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    site = Path(sysconfig.get_path("purelib", "venv", vars={"base": str(folder), "platbase": str(folder)}))
    (site / "budgetgpu-node.pth").write_text("".join(f"{path}\n" for path in [*first, NODE_PACKAGES]))
    return str(folder / "bin" / "python3")


def sim(tmp_path: Path, edit=None) -> Path:
    """gpu_sim's drop-in pynvml in a folder, answering from the 4 RTX 3090 profile (changed by edit)."""
    folder = tmp_path / "sim"
    folder.mkdir()
    shutil.copy(GPU_SIM / "pynvml.py", folder)
    profile = json.loads(PROFILE.read_text())
    if edit:
        edit([function["nvml"] for function in profile["pci"] if "nvml" in function])
    (tmp_path / "profile.json").write_text(json.dumps(profile))
    return folder


@pytest.fixture
def node(tmp_path, monkeypatch):
    """A node under tmp_path: root's /etc/budgetgpu/slurm-job.env naming a checkpoint root of root's (0755),
    the records' directory to be made. Returns the script loaded with its paths there."""
    for folder in ("etc/budgetgpu", "var/lib/budgetgpu/slurm-checkpoints"):
        (tmp_path / folder).mkdir(parents=True)
    for folder in [tmp_path, *tmp_path.rglob("*")]:
        folder.chmod(0o755)
    (tmp_path / "etc/budgetgpu/slurm-job.env").write_text(
        f"BUDGETGPU_RDZV_PORTS=29600-29999\nBUDGETGPU_CHECKPOINT_ROOT={tmp_path}/var/lib/budgetgpu/slurm-checkpoints\n"
    )
    monkeypatch.setenv("BUDGETGPU_SIM_PROFILE", str(tmp_path / "profile.json"))
    monkeypatch.setenv("BUDGETGPU_SIM_STATE", str(tmp_path / "sim-state.json"))
    script = load_file_module("budgetgpu_slurm_energy", SCRIPT)
    script.BASE = str(tmp_path)
    script.JOBS_DIR = str(tmp_path / "var/lib/budgetgpu/slurm-jobs")
    script.JOB_ENV_FILE = str(tmp_path / "etc/budgetgpu/slurm-job.env")
    return script


def record(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "var/lib/budgetgpu/slurm-jobs/42.json").read_text())


def constants(script) -> str:
    return json.dumps({key: getattr(script, key) for key in ("BASE", "JOBS_DIR", "JOB_ENV_FILE")})


# The program's main() with its paths set, as file_modules.load_file_module loads it (test_node_pythons' way).
RUN_MAIN = """
import importlib.machinery, importlib.util, json, os, sys
path, constants, argv = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]
loader = importlib.machinery.SourceFileLoader("program", path)
module = importlib.util.module_from_spec(importlib.util.spec_from_loader("program", loader))
loader.exec_module(module)
vars(module).update(constants)
code = module.main(argv)
sys.stdout.flush()
os._exit(code)
"""


@as_root
def test_the_prolog_records_each_gpu_by_minor_and_uuid_with_one_gpu_without_a_counter(node, tmp_path):
    """GPU 1 has no energy counter: a job on GPU 2 is billed for GPU 2 (the Prolog before took the job's GPUs
    by position among those with a counter, and billed GPU 3)."""

    def no_counter_on_gpu_1(gpus):
        gpus[1]["energy_mj"] = "ERR:NVMLError_NotSupported"

    node.PYTHON = node_python(tmp_path / "venv", sim(tmp_path, no_counter_on_gpu_1))
    assert node.main(["start"], JOB) == 0
    assert node.main(["end"], JOB) == 0
    uuids = [function["nvml"]["uuid"] for function in json.loads(PROFILE.read_text())["pci"] if "nvml" in function]
    found = record(tmp_path)
    assert (found["job"], found["user"], found["gpus"]) == ("42", "nobody", [2])
    assert list(found["joules"]) == [uuids[2]]
    jobs = tmp_path / "var/lib/budgetgpu/slurm-jobs"
    assert (jobs.stat().st_mode & 0o777, (jobs / "42.json").stat().st_mode & 0o777) == (0o755, 0o644)


@as_root
def test_the_prolog_takes_slurms_numbers_as_device_minors(node, tmp_path):
    def minors_reversed(gpus):
        for index, gpu in enumerate(gpus):
            gpu["minor_number"] = len(gpus) - 1 - index

    node.PYTHON = node_python(tmp_path / "venv", sim(tmp_path, minors_reversed))
    assert node.main(["start"], {**JOB, "SLURM_JOB_GPUS": "0"}) == 0
    last = [gpu["nvml"]["uuid"] for gpu in json.loads(PROFILE.read_text())["pci"] if "nvml" in gpu][-1]
    assert list(record(tmp_path)["counters"]) == [last]


@as_root
def test_the_prolog_makes_the_users_checkpoint_directory_as_root(node, tmp_path):
    node.PYTHON = node_python(tmp_path / "venv", sim(tmp_path))
    assert node.main(["start"], {**JOB, "SLURM_JOB_UID": "65534"}) == 0
    mine = tmp_path / "var/lib/budgetgpu/slurm-checkpoints/nobody"
    assert (mine.stat().st_uid, mine.stat().st_mode & 0o777) == (65534, 0o700)
    # slurmd's uid for the user differs from this node's: nothing is made for a user not known the same.
    assert node.main(["start"], {**JOB, "SLURM_JOB_USER": "daemon", "SLURM_JOB_UID": "4242"}) == 0
    assert not (mine.parent / "daemon").exists()


def test_a_node_package_that_does_not_import_exits_0(tmp_path):
    broken = tmp_path / "broken" / "budgetgpu_node"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('budgetgpu_node is half upgraded')\n")
    python = node_python(tmp_path / "venv", broken.parent)
    done = subprocess.run(
        [python, "-I", str(SCRIPT), "start"], env={**JOB}, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "ImportError: budgetgpu_node is half upgraded" in done.stderr


@as_root
def test_a_full_disk_exits_0_and_leaves_no_temporary_file(node, tmp_path):
    """Every write fails (a file-size limit of 0: EFBIG where a full disk says ENOSPC, SIGXFSZ ignored as
    slurmd's children inherit it): the Prolog logs it and exits 0; the Prolog before exited 1 (drain)."""
    python = node_python(tmp_path / "venv", sim(tmp_path))
    jobs = Path(node.JOBS_DIR)
    jobs.mkdir(mode=0o755)

    def no_room() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))

    done = subprocess.run(
        [python, "-I", "-c", RUN_MAIN, str(SCRIPT), constants(node), "start"],
        env={**JOB, "BUDGETGPU_SIM_PROFILE": str(tmp_path / "profile.json")},
        preexec_fn=no_room,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "File too large" in done.stderr
    assert list(jobs.iterdir()) == []


@as_root
def test_an_nvml_that_hangs_is_given_up_at_the_deadline(node, tmp_path):
    hung = tmp_path / "hung"
    hung.mkdir()
    (hung / "pynvml.py").write_text(HANG)
    node.PYTHON = node_python(tmp_path / "venv", hung)
    node.NVML_DEADLINE_S = 1
    started = time.monotonic()
    assert node.main(["start"], JOB) == 0
    assert time.monotonic() - started < 5
    # The job starts, with its record and without its energy.
    assert record(tmp_path)["counters"] == {}


def test_the_whole_program_ends_at_its_deadline(node, tmp_path):
    """Whatever else hangs (here NVML, with its own deadline above the program's): exit 0 at DEADLINE_S."""
    hung = tmp_path / "hung"
    hung.mkdir()
    (hung / "pynvml.py").write_text(HANG)
    python = node_python(tmp_path / "venv", hung)
    settings = {**json.loads(constants(node)), "NVML_DEADLINE_S": 60, "DEADLINE_S": 1, "PYTHON": python}
    started = time.monotonic()
    done = subprocess.run(
        [python, "-I", "-c", RUN_MAIN, str(SCRIPT), json.dumps(settings), "start"],
        env=JOB,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0 and "not done within 1 s: gave up" in done.stderr, done.stderr
    assert time.monotonic() - started < 10
    # The hung NVML reader went with it (it was left asleep before, with nobody left to kill it at its deadline).
    time.sleep(0.5)
    readers = [p for p in Path("/proc").glob("[0-9]*/cmdline") if _reads(p, str(tmp_path))]
    assert readers == [], readers


def _reads(cmdline: Path, folder: str) -> bool:
    """Whether the process of /proc/<pid>/cmdline runs from folder (gone meanwhile: no)."""
    try:
        return folder in cmdline.read_bytes().decode(errors="replace")
    except OSError:
        return False


def fake_nft(tmp_path: Path, body: str) -> str:
    """An nft that records its argv (a line each) and whether it saw the Prolog's environment, then runs body."""
    nft = tmp_path / "nft"
    record_argv = f'printf "%s\\n" "$@" > {tmp_path}/nft-argv\n'
    nft.write_text(f'#!/bin/bash\n{record_argv}echo "${{BUDGETGPU_SENTINEL-unset}}" > {tmp_path}/nft-env\n{body}')
    nft.chmod(0o755)
    return str(nft)


def test_job_ports_are_a_pair_of_the_range_chosen_by_the_job_id():
    from budgetgpu_node.slurm_energy import job_ports

    assert job_ports("42", "29600-29999") == (29684, 29685)
    # 200 pairs: job 242 takes job 42's; an odd last port is never one.
    assert job_ports("242", "29600-29999") == job_ports("42", "29600-29999")
    assert job_ports("1", "29600-29602") == (29600, 29601)
    with pytest.raises(ValueError, match="a range of 2 ports or more"):
        job_ports("1", "29600-29600")


def test_the_prolog_gives_the_jobs_two_ports_to_its_user_alone_and_the_epilog_leaves_them_minutes_more(
    node, tmp_path, monkeypatch, capsys
):
    """nft by its path with a fixed argv and no environment: the elements `uid . port` of the job's rendezvous
    and store ports (slurm_energy.job_ports), each with a timeout that bounds a lost Epilog; the Epilog gives them
    REQUEUE_GRACE (a requeued job started again at once gets no Prolog). Add, delete, add: the timeout is set
    whether or not the elements were there."""
    monkeypatch.setattr(node, "read_gpus", list)
    monkeypatch.setenv("BUDGETGPU_SENTINEL", "the Prolog's environment")
    node.NFT = fake_nft(tmp_path, "exit 0\n")
    job = {**JOB, "SLURM_JOB_UID": "65534"}
    owners = ["element", "inet", "budgetgpu_slurm_jobs", "owners"]
    for action, timeout in (("start", "30d"), ("end", "5m")):
        assert node.main([action], job) == 0
        timed = ["add", *owners, f"{{ 65534 . 29684 timeout {timeout}, 65534 . 29685 timeout {timeout} }}"]
        assert (tmp_path / "nft-argv").read_text().splitlines() == [
            *timed, ";", "delete", *owners, "{ 65534 . 29684, 65534 . 29685 }", ";", *timed
        ]  # fmt: skip
        assert (tmp_path / "nft-env").read_text() == "unset\n"
        assert f"job 42: 65534 . 29684, 65534 . 29685 in owners for {timeout}" in capsys.readouterr().err


def test_an_nft_that_fails_hangs_or_is_missing_is_logged_and_the_prolog_exits_0(node, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(node, "read_gpus", list)
    job = {**JOB, "SLURM_JOB_UID": "65534"}
    node.NFT = fake_nft(tmp_path, 'echo "Error: No such file or directory" >&2\nexit 1\n')
    assert node.main(["start"], job) == 0
    logged = capsys.readouterr().err
    assert "nft add element inet budgetgpu_slurm_jobs owners" in logged and "No such file or directory" in logged
    node.NFT = str(tmp_path / "no-nft")
    assert node.main(["end"], job) == 0
    assert f"cannot run {tmp_path}/no-nft" in capsys.readouterr().err
    node.NFT, node.NFT_DEADLINE_S = fake_nft(tmp_path, "exec sleep 60\n"), 0.2
    started = time.monotonic()
    assert node.main(["start"], job) == 0
    assert time.monotonic() - started < 10
    assert "no answer within 0.2 s" in capsys.readouterr().err
    # The record is written all the same: the job's bill does not wait on its ports.
    assert record(tmp_path)["job"] == "42"
