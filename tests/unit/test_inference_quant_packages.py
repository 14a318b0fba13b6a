"""What a service that loads in 8 or 4 bits gets in the workers' venv (inference_extra_requirements:
roles/inference/files/requirements-split.txt and requirements-quant.txt): the pinned wheels from the
wheelhouse that scripts/fill-wheelhouse fills, installed as the role installs them (no index), importable
beside the worker's own packages, and seen by transformers, whose bitsandbytes quantiser refuses to load a
model without them. Loading a model in 4 bits needs CUDA: not here (no GPU lent)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch (CPU) from .cache/wheelhouse is not installed in this venv")
pytest.importorskip("transformers", reason="the worker's packages are not installed in this venv")

REPO = Path(__file__).resolve().parents[2]
FILES = REPO / "roles" / "inference" / "files"
WHEELHOUSE = REPO / ".cache" / "wheelhouse"


def pins(*names: str) -> list[str]:
    lines = [line.split("#")[0].strip() for name in names for line in (FILES / name).read_text().splitlines()]
    return [line for line in lines if line]


def test_the_quantisation_packages_install_from_the_wheelhouse_and_transformers_sees_them(tmp_path):
    wanted = pins("requirements-split.txt", "requirements-quant.txt")
    assert [pin.split("==")[0] for pin in wanted] == ["accelerate", "psutil", "bitsandbytes"]
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--find-links", str(WHEELHOUSE),
         "--target", str(site), *wanted],
        check=True, timeout=300,
    )  # fmt: skip
    code = (
        "import json, bitsandbytes, accelerate\n"
        "from transformers.utils import is_accelerate_available, is_bitsandbytes_available\n"
        "print(json.dumps([bitsandbytes.__file__, bitsandbytes.__version__, accelerate.__version__,"
        " is_bitsandbytes_available(), is_accelerate_available()]))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    argv = [sys.executable, "-c", code]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    path, bnb, accelerate, bnb_seen, accelerate_seen = json.loads(done.stdout.splitlines()[-1])
    assert path.startswith(str(site))
    assert [f"bitsandbytes=={bnb}", f"accelerate=={accelerate}"] == [wanted[2], wanted[0]]
    assert bnb_seen and accelerate_seen
