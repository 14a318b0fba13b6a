"""Hold the code that runs on the nodes to the oldest system Python of a supported release.

Usage: python3 tests/check_node_python.py [--list]   (`make lint` runs it with .venv's python)

Node code runs under the node's own python3 (role node_venv makes its venv from it; root's looks run
it bare), and the oldest a supported release ships is Ubuntu 22.04's 3.10 (docs/platforms.md).
The controller is 3.11, so a 3.11-only call there (`datetime.UTC`) passes every test that runs it in
.venv and crashes on the node. vermin reads the files for the minimum version every module,
function, keyword and syntax they use needs, and fails on any above FLOOR. --list prints the files
instead; tests/unit/test_node_pythons.py runs them under each release's interpreter.

Exit status: 0 every file runs on FLOOR, 1 a file needs more (vermin names the file, line and call).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The system python3 of each release docs/platforms.md lists; node code runs under every one.
RELEASES = {"3.10": "Ubuntu 22.04", "3.11": "Debian 12", "3.12": "Ubuntu 24.04", "3.13": "Debian 13"}
FLOOR = min(RELEASES, key=lambda version: tuple(map(int, version.split("."))))
# Annotations are checked as if evaluated: `from __future__ import annotations` hides them from the
# interpreter, but a name they use must still import (typing.Self is 3.11). No tips: this is a gate.
VERMIN_OPTIONS = [
    f"--target={FLOOR}-",
    "--violations",
    "-q",
    "-vvv",
    "--eval-annotations",
    "--no-tips",
    "--no-config-file",
]


def _is_python(path: Path) -> bool:
    if path.suffix == ".py":
        return True
    if path.suffix or not path.is_file():
        return False
    with path.open("rb") as handle:
        first = handle.readline(200)
    return first.startswith(b"#!") and b"python" in first


def node_code() -> list[Path]:
    """The node package, the modules (Ansible runs them with the node's python3), every Python file a
    role ships in its files/ (the two its tasks run on the control node, model_digest.py and
    comm_plot.py, are held to the floor all the same: one rule for the folder), the node programs among
    them (gpu-health, gpu-power, gpu-probe, and gpu-smoke, run by hand on a GPU node)."""
    files = sorted(REPO.glob("plugins/module_utils/*.py")) + sorted(REPO.glob("plugins/modules/*.py"))
    return files + sorted(path for path in REPO.glob("roles/*/files/**/*") if _is_python(path))


def vermin() -> str:
    """The vermin of the interpreter running this (the venv's console script), else the PATH's."""
    beside = Path(sys.executable).with_name("vermin")
    found = str(beside) if beside.exists() else shutil.which("vermin")
    if not found:
        raise SystemExit("check_node_python: vermin is not installed: make venv (requirements-dev.txt)")
    return found


def check(paths: list[Path]) -> subprocess.CompletedProcess:
    """vermin's verdict on the files: returncode 1 and the offending lines on stdout when one needs more
    than FLOOR."""
    argv = [vermin(), *VERMIN_OPTIONS, *map(str, paths)]
    return subprocess.run(argv, capture_output=True, text=True, check=False)


def main(argv: list[str]) -> int:
    paths = node_code()
    if argv == ["--list"]:
        print("\n".join(str(path.relative_to(REPO)) for path in paths))
        return 0
    done = check(paths)
    if done.returncode != 0:
        print(done.stdout + done.stderr, end="", file=sys.stderr)
        print(f"check_node_python: node code must run on Python {FLOOR} ({RELEASES[FLOOR]}'s python3)", file=sys.stderr)
        return 1
    print(f"check_node_python: {len(paths)} files of node code run on Python {FLOOR}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
