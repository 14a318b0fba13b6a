"""Remove the model files that no inference service of this node uses any more; print what went, as
one JSON line.

Usage: python3 -I model_prune.py JSON
JSON: {"root": MODEL_ROOT, "stamp": STAMP_NAME, "unit_dir": DIR, "unit_prefix": PREFIX,
       "keep": [NAME...], "digests": {NAME: DIGEST}, "files": {NAME: [RELATIVE PATH...]}}
Prints {"removed": [PATH...]}.

- A directory of MODEL_ROOT that holds the role's stamp (a model the role copied) and whose service
  is neither in "keep" (this run's services on the node) nor installed (its unit template
  DIR/PREFIX<NAME>@.service: a service left out of the inventory whose workers still run) goes whole.
- In the directory of a service of "keep" whose stamp equals its digest (its copy is complete), every
  file and link that is not in its files (the model as the control node holds it now) or the stamp
  goes: the old GGUF after a new one, the shards of an earlier checkpoint.

Root runs it. MODEL_ROOT and every directory above it must be root's and writable by no one else
(else nothing is removed: it exits 1 saying why); below it, nothing is followed: entries are opened
relative to their directory's descriptor without following links (os.fwalk, unlink with dir_fd).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys


def unsafe_path(path: str) -> str | None:
    """Why root may not remove entries below path: a link on the way, a directory on the way that is
    not root's, or that others may write (above path: unless sticky, where others cannot move root's
    entries); None when it is safe."""
    parts = [p for p in path.split("/") if p]
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    try:
        walked = "/"
        for depth, part in enumerate(parts, 1):
            walked = os.path.join(walked, part)
            try:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as error:
                return f"{walked}: {error.strerror} (a link, or not a directory)"
            os.close(fd)
            fd = nxt
            st = os.fstat(fd)
            shared = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
            if st.st_uid != 0 or (shared and (depth == len(parts) or not st.st_mode & stat.S_ISVTX)):
                mode = stat.filemode(st.st_mode)
                return f"{walked} is uid {st.st_uid}'s, mode {mode}, expected root's and writable by root alone"
        return None
    finally:
        os.close(fd)


def has_stamp(root_fd: int, name: str, stamp: str) -> bool:
    try:
        st = os.stat(os.path.join(name, stamp), dir_fd=root_fd, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode)


def read_stamp(root_fd: int, name: str, stamp: str) -> str | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root_fd)
    except OSError:
        return None
    try:
        file_fd = os.open(stamp, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=fd)
    except OSError:
        return None
    finally:
        os.close(fd)
    with os.fdopen(file_fd, encoding="utf-8") as handle:
        return handle.read(4096).strip()


def prune_stale(root: str, name: str, files: list[str], stamp: str) -> list[str]:
    """Remove what the model directory root/name holds besides files and the stamp; return the paths."""
    wanted = {os.path.normpath(f) for f in files} | {stamp}
    removed = []
    top = os.path.join(root, name)
    for dirpath, dirnames, filenames, dir_fd in os.fwalk(top, topdown=False, follow_symlinks=False):
        relative = os.path.relpath(dirpath, top)
        # fwalk lists a link to a directory among the directories (and does not enter it): a link either way.
        links = [d for d in dirnames if stat.S_ISLNK(os.stat(d, dir_fd=dir_fd, follow_symlinks=False).st_mode)]
        for entry in filenames + links:
            path = os.path.normpath(os.path.join(relative, entry))
            if path not in wanted:
                os.unlink(entry, dir_fd=dir_fd)
                removed.append(os.path.join(top, path))
        for entry in (d for d in dirnames if d not in links):
            path = os.path.normpath(os.path.join(relative, entry))
            if any(w.startswith(path + "/") for w in wanted):
                continue
            try:
                os.rmdir(entry, dir_fd=dir_fd)  # emptied above; a directory that still holds something stays
            except OSError:
                continue
            removed.append(os.path.join(top, path))
    return removed


def main() -> None:
    args = json.loads(sys.argv[1])
    root, stamp, keep = args["root"].rstrip("/") or "/", args["stamp"], set(args.get("keep", []))
    digests, files = args.get("digests", {}), args.get("files", {})
    if not os.path.lexists(root):
        print(json.dumps({"removed": []}))
        return
    refused = unsafe_path(root)
    if refused:
        sys.exit(
            f"inference_model_root {root}: {refused}; removed nothing (root removes files only below a directory "
            "that root alone may change): make it root's, mode 0755"
        )
    removed: list[str] = []
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for entry in sorted(os.listdir(root_fd)):
            st = os.stat(entry, dir_fd=root_fd, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode) or not has_stamp(root_fd, entry, stamp):
                continue
            installed = os.path.exists(os.path.join(args["unit_dir"], f"{args['unit_prefix']}{entry}@.service"))
            if entry not in keep and not installed:
                # shutil.rmtree on Linux works by descriptor and follows no link (avoids_symlink_attacks).
                shutil.rmtree(os.path.join(root, entry))
                removed.append(os.path.join(root, entry))
            elif entry in keep and digests.get(entry) and read_stamp(root_fd, entry, stamp) == digests[entry]:
                removed += prune_stale(root, entry, files.get(entry) or [], stamp)
    finally:
        os.close(root_fd)
    print(json.dumps({"removed": removed}))


if __name__ == "__main__":
    main()
