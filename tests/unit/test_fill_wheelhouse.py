"""scripts/fill-wheelhouse --vllm (issue 39, item 7): vLLM and everything it pins (its CUDA torch) are
downloaded for the nodes' Python and platform into the wheelhouse, once per spec, beside the usual sets.
No network: a fake pip (PIP) records each call and leaves a wheel named by each pinned spec."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FAKE_PIP = f"""#!{sys.executable}
import json, os, pathlib, sys
args = sys.argv[1:]
with open(os.environ["FAKE_PIP_LOG"], "a") as log:
    log.write(json.dumps(args) + "\\n")
if "--target" in args:  # the NVML bindings' install
    target = pathlib.Path(args[args.index("--target") + 1])
    target.mkdir(parents=True)
    (target / "pynvml.py").write_text("")
if args[0] == "download":
    folder = pathlib.Path(args[args.index("-d") + 1])
    for spec in args:
        if "==" in spec and not spec.startswith("-"):
            name, version = spec.split("==")
            (folder / f"{{name}}-{{version}}-cp38-abi3-manylinux1_x86_64.whl").write_bytes(b"")
"""


@pytest.fixture
def fill(tmp_path):
    pip = tmp_path / "pip"
    pip.write_text(FAKE_PIP)
    pip.chmod(0o755)
    log = tmp_path / "pip.log"
    env = dict(
        os.environ, PIP=str(pip), FAKE_PIP_LOG=str(log), BUDGETGPU_NVML_BINDINGS_DIR=str(tmp_path / "nvml-bindings")
    )

    def run(*args: str) -> tuple[subprocess.CompletedProcess[str], list[list[str]]]:
        log.write_text("")
        done = subprocess.run(
            [str(REPO / "scripts/fill-wheelhouse"), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        calls = [json.loads(line) for line in log.read_text().splitlines()]
        return done, [call for call in calls if call[0] == "download"]

    return run


def test_vllm_comes_with_its_dependencies_for_the_nodes_python_and_platform_once(fill, tmp_path):
    wheelhouse = str(tmp_path / "wheels")
    # The command as preflight prints it, with a platform as well.
    args = ("--vllm", "vllm==0.11.0", "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64", wheelhouse)
    done, downloads = fill(*args)
    assert done.returncode == 0, done.stderr
    target = ["--only-binary=:all:", "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64"]
    # Every set for the nodes' Python; vLLM with its dependencies (no --no-deps): the vLLM venv installs
    # from the wheelhouse alone, the torch vLLM pins included.
    assert len(downloads) == 3 and all(" ".join(target) in " ".join(call) for call in downloads), downloads
    assert downloads[2] == ["download", "--quiet", *target, "-d", wheelhouse, "vllm==0.11.0"]
    assert "--no-deps" in downloads[1] and "--no-deps" not in downloads[0]
    assert (tmp_path / "wheels" / "vllm-0.11.0-cp38-abi3-manylinux1_x86_64.whl").exists()
    assert "downloading vllm==0.11.0 and its dependencies (the torch it pins) for Python 3.12" in done.stderr

    # Filled: nothing is downloaded again; another vLLM release is downloaded, and only it.
    done, downloads = fill(*args)
    assert done.returncode == 0 and downloads == [], done.stderr
    assert "is up to date" in done.stderr
    done, downloads = fill("--vllm", "vllm==0.11.1", "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64",
                           wheelhouse)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert downloads == [["download", "--quiet", *target, "-d", wheelhouse, "vllm==0.11.1"]]


def test_without_vllm_no_vllm_and_python_3_11_by_default(fill, tmp_path):
    wheelhouse = str(tmp_path / "wheels")
    done, downloads = fill(wheelhouse)
    assert done.returncode == 0, done.stderr
    assert len(downloads) == 2
    for call in downloads:
        assert "--only-binary=:all: --python-version 3.11 -d" in " ".join(call), call
        assert not any(arg.startswith("vllm") for arg in call)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--vllm"], "fill-wheelhouse: --vllm needs a value"),
        (["--vlm", "vllm"], "fill-wheelhouse: unknown option --vlm"),
    ],
)
def test_bad_options_are_refused_before_anything_is_downloaded(fill, args, expected):
    done, downloads = fill(*args)
    assert done.returncode == 2
    assert done.stderr.startswith(expected + "\nUsage: scripts/fill-wheelhouse [--vllm SPEC]"), done.stderr
    assert downloads == []
