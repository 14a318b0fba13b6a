"""Print, as one JSON line, what the inference role needs to know about a node, in one call.

Usage: python3 -I inference_state.py JSON

JSON: {"venv": PATH, "wheelhouse": DIR, "requirements": [REQ...], "stamps": {NAME: FILE},
"marks": {UNIT: FILE}}. Run by root with the system python (-I), never with the venv's own
interpreter (a .pth file in the venv would run). Prints:
- missing: the requirements (exact name==version pins or bare names) that the venv's dist-info
  metadata does not show installed;
- wheelhouse: whether DIR holds wheels (pip then installs from there only);
- stamps: each model's stamp file content (the digest of the copied model), or null;
- marks: the units whose restart-pending mark exists.
"""

from __future__ import annotations

import glob
import json
import os
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


def main() -> None:
    args = json.loads(sys.argv[1])
    print(
        json.dumps(
            {
                "missing": missing(args["venv"], args.get("requirements", [])),
                "wheelhouse": bool(glob.glob(os.path.join(args.get("wheelhouse", "/nonexistent"), "*.whl"))),
                "stamps": {name: read(path) for name, path in args.get("stamps", {}).items()},
                "marks": sorted(unit for unit, path in args.get("marks", {}).items() if os.path.exists(path)),
            },
            sort_keys=True,
        )
    )


if __name__ == "__main__":
    main()
