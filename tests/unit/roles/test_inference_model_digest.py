"""roles/inference/files/model_digest.py: the digest that decides whether a model is copied to the nodes
again. A model directory or one GGUF file (engine llamacpp); a change of a file's size or time changes it,
a missing model digests to null."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

DIGEST = Path(__file__).resolve().parents[3] / "roles" / "inference" / "files" / "model_digest.py"


def digests(models: dict[str, Path]) -> dict[str, str | None]:
    argv = [sys.executable, "-I", str(DIGEST), json.dumps({k: str(v) for k, v in models.items()})]
    return json.loads(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)


def test_a_directory_and_a_gguf_file_each_digest_to_what_they_hold(tmp_path):
    model_dir = tmp_path / "minilm"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    first = digests({"embed": model_dir, "llama": gguf, "gone": tmp_path / "nowhere.gguf"})
    assert first["gone"] is None and first["embed"] and first["llama"] and first["embed"] != first["llama"]
    assert digests({"llama": gguf}) == {"llama": first["llama"]}  # the same file, the same digest
    # A new file of the same size, written later: copied again.
    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert digests({"llama": gguf})["llama"] != first["llama"]
    # The file's name is part of it: the node's copy is named after it (llamacpp_model_path).
    renamed = gguf.rename(tmp_path / "other.gguf")
    os.utime(renamed, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert digests({"llama": renamed})["llama"] != first["llama"]
