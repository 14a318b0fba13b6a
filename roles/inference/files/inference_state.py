"""Print, as one JSON line, what the inference role needs to know about a node, in one call.

Usage: python3 -I inference_state.py JSON TRUST_CHECK

JSON: {"venv": PATH, "wheelhouse": DIR, "requirements": [REQ...], "stamps": {NAME: FILE},
"marks": {UNIT: FILE}, "users": [NAME...]}. TRUST_CHECK: the source of python_env's venv_state.py, the one check of
whether root may touch a venv (the job venv passes the same). Run by root with the system python
(-I), never with the venv's own interpreter (a .pth file in the venv would run). Prints:
- trust: {exists, unsafe_above, unsafe_inside} of the venv (venv_state.py); root runs pip in it
  only when both reasons are null;
- missing: the requirements (exact name==version pins or bare names) that the venv's dist-info
  metadata does not show installed; read only from a venv root may trust (else every one);
- wheelhouse: whether DIR holds wheels (pip then installs from there only);
- stamps: each model's stamp file content (the digest of the copied model), or null;
- marks: the units whose restart-pending mark exists;
- users: each service user's {uid, gecos} in the passwd database, or null where it does not exist;
- uid_min: the node's first uid of ordinary users (UID_MIN of /etc/login.defs, else 1000): below it,
  the system's and other services' accounts.
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import re
import sys
from importlib import metadata


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed(venv: str) -> dict[str, str]:
    paths = glob.glob(os.path.join(venv, "lib", "python3*", "site-packages"))
    return {canonical(d.metadata["Name"] or ""): d.version for d in metadata.distributions(path=paths)}


def missing(venv: str, requirements: list[str]) -> list[str]:
    have = installed(venv)
    out = []
    for req in requirements:
        name, _unused, version = req.partition("==")
        name = re.split(r"[\[<>=!~; ]", name.strip(), maxsplit=1)[0]
        found = have.get(canonical(name))
        if found is None or (version and found != version.strip()):
            out.append(req)
    return out


def read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read().strip()
    except OSError:
        return None


def account(name: str) -> dict | None:
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        return None
    return {"uid": entry.pw_uid, "gecos": entry.pw_gecos}


def uid_min(login_defs: str = "/etc/login.defs") -> int:
    for line in (read(login_defs) or "").splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[0] == "UID_MIN" and fields[1].isdigit():
            return int(fields[1])
    return 1000


def trust(venv: str, check_source: str) -> dict:
    """What python_env's trust check says of the venv: exists, unsafe_above, unsafe_inside."""
    namespace: dict = {"__name__": "venv_state"}
    exec(compile(check_source, "venv_state.py", "exec"), namespace)  # noqa: S102 (the collection's own file)
    found = namespace["venv_state"](venv, [])
    return {key: found[key] for key in ("exists", "unsafe_above", "unsafe_inside")}


def main() -> None:
    args = json.loads(sys.argv[1])
    venv_trust = trust(args["venv"], sys.argv[2])
    trusted = venv_trust["unsafe_above"] is None and venv_trust["unsafe_inside"] is None
    requirements = args.get("requirements", [])
    print(
        json.dumps(
            {
                "trust": venv_trust,
                "missing": missing(args["venv"], requirements) if trusted else list(requirements),
                "wheelhouse": bool(glob.glob(os.path.join(args.get("wheelhouse", "/nonexistent"), "*.whl"))),
                "stamps": {name: read(path) for name, path in args.get("stamps", {}).items()},
                "marks": sorted(unit for unit, path in args.get("marks", {}).items() if os.path.exists(path)),
                "users": {name: account(name) for name in args.get("users", [])},
                "uid_min": uid_min(),
            },
            sort_keys=True,
        )
    )


if __name__ == "__main__":
    main()
