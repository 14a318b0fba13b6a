"""Print, as one JSON line, a digest of each model on the control node: a directory, or one file
(a GGUF model of engine llamacpp).

Usage: python3 model_digest.py JSON   (JSON: {NAME: PATH})

The digest covers every file's relative path, size and modification time (not its content:
model weights are gigabytes, read every run). A missing model digests to null (preflight
names it). The inference role copies a model to the nodes only when its digest differs from
the stamp the last copy left there.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys


def digest(top: str) -> str | None:
    top = os.path.realpath(top)
    if os.path.isfile(top):
        st = os.stat(top)
        return hashlib.sha256(f"{os.path.basename(top)}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()
    if not os.path.isdir(top):
        return None
    entries = []
    for root, dirs, files in os.walk(top, followlinks=True):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            st = os.stat(path)
            entries.append(f"{os.path.relpath(path, top)}\0{st.st_size}\0{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()


def main() -> None:
    dirs = json.loads(sys.argv[1])
    print(json.dumps({name: digest(path) for name, path in sorted(dirs.items())}, sort_keys=True))


if __name__ == "__main__":
    main()
