"""Print, as one JSON line, what root may know about a venv without running any of its code.

Usage: python3 -I venv_state.py VENV [REQUIREMENT...]

Run by root with the system python (-I: no PYTHONPATH, no user site, no working directory on
sys.path), never with the venv's own python: a .pth file or sitecustomize in the venv runs as
soon as its interpreter starts. Prints one JSON object:
- exists: the venv has its pyvenv.cfg.
- unsafe_above: the nearest folder above the venv that someone other than root may change
  (owner or write bits), with the reason; null when there is none.
- unsafe_inside: the same for the venv, everything in it, and the folders its .pth files add
  to sys.path.
- satisfied: for each requirement, the requirement when the venv's metadata shows it installed
  for certain (an exact name==version pin, or a bare name), else null. Read from the dist-info
  files only, and only when nobody but root can have written them.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
import sysconfig
from importlib import metadata
from pathlib import Path


def unsafe_reason(path: str) -> str | None:
    """Why someone other than root may change what `path` is or holds, or None."""
    st = os.lstat(path)
    if st.st_uid != 0:
        return f"{path} is owned by uid {st.st_uid}"
    if stat.S_ISLNK(st.st_mode):
        return None  # a link has no mode of its own; root owns it, so only root re-points it
    if st.st_mode & stat.S_IWOTH:
        return f"{path} is writable by every user (mode {stat.S_IMODE(st.st_mode):04o})"
    if st.st_mode & stat.S_IWGRP and st.st_gid != 0:
        return f"{path} is writable by group gid {st.st_gid} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def unsafe_above(venv: str) -> str | None:
    """The nearest existing folder above `venv` (after links) that is not root's alone."""
    for parent in Path(os.path.realpath(venv)).parents:
        if os.path.lexists(parent):
            reason = unsafe_reason(str(parent))
            if reason:
                return reason
    return None


def unsafe_inside(venv: str) -> str | None:
    """The first path in `venv` (itself included) that is not root's alone."""
    real = os.path.realpath(venv)
    if not os.path.lexists(real):
        return None
    for top, dirs, files in os.walk(real):
        for name in [".", *dirs, *files]:
            reason = unsafe_reason(os.path.normpath(os.path.join(top, name)))
            if reason:
                return reason
    return None


def unsafe_pth_path(venv: str) -> str | None:
    """The first folder a .pth file of the venv puts on sys.path that is not root's alone.

    A root-written .pth line such as /usr/local/lib/budgetgpu-sim/python (gpu_sim) is fine; one
    naming a folder the training user may write hands that user the venv's interpreter again.
    """
    for pth in sorted(Path(os.path.realpath(venv)).glob("lib/python3*/site-packages/*.pth")):
        for line in pth.read_text(errors="replace").splitlines():
            if not line.strip() or line.startswith(("#", "import ", "import\t")):
                continue
            folder = os.path.join(pth.parent, line.rstrip())
            if os.path.exists(folder):
                reason = unsafe_reason(folder) or unsafe_above(os.path.join(folder, "."))
                if reason:
                    return f"{pth} adds {folder}: {reason}"
    return None


def satisfied(spec: str, paths: list[str]) -> str | None:
    name, pin, version = spec.partition("==")
    if not paths or not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or (pin and not re.fullmatch(r"[^,;<>=!~ ]+", version)):
        return None
    found = next(iter(metadata.distributions(name=name, path=paths)), None)
    if found is None:
        return None
    return spec if not pin or found.version == version else None


def site_packages(venv: str) -> str:
    """The venv's site-packages, as this interpreter (the one that makes the venv) lays it out,
    known before the venv exists: a role puts its .pth there in the run that creates the venv."""
    scheme = "venv" if "venv" in sysconfig.get_scheme_names() else "posix_prefix"  # "venv": Python 3.11+
    return sysconfig.get_path("purelib", scheme, vars={"base": venv, "platbase": venv})


def venv_state(venv: str, specs: list[str]) -> dict:
    exists = os.path.isfile(os.path.join(venv, "pyvenv.cfg"))
    above = unsafe_above(venv)
    inside = unsafe_inside(venv) or (unsafe_pth_path(venv) if os.path.lexists(venv) else None)
    trusted = exists and above is None and inside is None
    paths = sorted(str(path) for path in Path(venv).glob("lib/python3*/site-packages")) if trusted else []
    return {
        "exists": exists,
        "unsafe_above": above,
        "unsafe_inside": inside,
        "satisfied": [satisfied(spec, paths) for spec in specs],
        "site_packages": site_packages(venv),
    }


if __name__ == "__main__":
    print(json.dumps(venv_state(sys.argv[1], sys.argv[2:]), sort_keys=True))
