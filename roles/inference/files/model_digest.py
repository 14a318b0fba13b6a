"""Print, as one JSON line, a digest of each model on the control node: a directory, or one file
(a GGUF model of engine llamacpp), and the files it holds.

Usage: python3 model_digest.py JSON   (JSON: {NAME: PATH})
Prints {"digests": {NAME: DIGEST}, "files": {NAME: [RELATIVE PATH...]}}.

The digest covers every file's relative path, size and modification time (not its content:
model weights are gigabytes, read every run). A missing model digests to null (preflight
names it) and lists no files. The inference role copies a model to the nodes only when its
digest differs from the stamp the last copy left there, and removes from a node's copy the
files the model no longer holds (files/model_prune.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys


def listing(top: str) -> list[tuple[str, os.stat_result]] | None:
    """Return (relative path, stat) of every file of the model, as the copy lays them out on a node."""
    top = os.path.realpath(top)
    if os.path.isfile(top):
        return [(os.path.basename(top), os.stat(top))]
    if not os.path.isdir(top):
        return None
    entries = []
    for root, dirs, files in os.walk(top, followlinks=True):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            entries.append((os.path.relpath(path, top), os.stat(path)))
    return entries


def digest(top: str) -> str | None:
    entries = listing(top)
    if entries is None:
        return None
    if os.path.isfile(os.path.realpath(top)):
        name, st = entries[0]
        return hashlib.sha256(f"{name}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()
    lines = [f"{path}\0{st.st_size}\0{st.st_mtime_ns}" for path, st in entries]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def main() -> None:
    dirs = json.loads(sys.argv[1])
    found = {name: (listing(path), digest(path)) for name, path in sorted(dirs.items())}
    print(
        json.dumps(
            {
                "digests": {name: value[1] for name, value in found.items()},
                "files": {name: [path for path, _st in value[0] or []] for name, value in found.items()},
            },
            sort_keys=True,
        )
    )


if __name__ == "__main__":
    main()
