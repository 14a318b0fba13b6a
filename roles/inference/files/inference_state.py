"""Print, as one JSON line, what the inference role needs to know about a node, in one call.

Usage: python3 -I inference_state.py JSON

JSON: {"wheelhouse": DIR, "stamps": {NAME: FILE}, "marks": {UNIT: FILE}, "users": [NAME...]}. Run by root
with the system python (-I). Whether root may trust the workers' venv and which of their pins it holds is
role _trusted_venv's look (the job venv's). Prints:
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
import sys


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


def main() -> None:
    args = json.loads(sys.argv[1])
    print(
        json.dumps(
            {
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
