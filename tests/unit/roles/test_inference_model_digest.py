"""roles/inference/files/model_digest.py: the digest that decides whether a model is copied to the nodes
again. A model directory or one GGUF file (engine llamacpp); a change of a file's size or time changes it,
a missing model digests to null. roles/inference/files/model_prune.py: the model files no service uses
any more go (issue 40), below a model root that root alone may write, following no link."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FILES = Path(__file__).resolve().parents[3] / "roles" / "inference" / "files"
DIGEST, PRUNE = FILES / "model_digest.py", FILES / "model_prune.py"
STAMP = ".budgetgpu-model"


def digest_run(models: dict[str, Path]) -> dict:
    argv = [sys.executable, "-I", str(DIGEST), json.dumps({k: str(v) for k, v in models.items()})]
    return json.loads(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)


def digests(models: dict[str, Path]) -> dict[str, str | None]:
    return digest_run(models)["digests"]


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


def test_the_digest_lists_the_files_as_the_copy_lays_them_out(tmp_path):
    model_dir = tmp_path / "minilm"
    (model_dir / "onnx").mkdir(parents=True)
    (model_dir / "config.json").write_text("{}")
    (model_dir / "onnx" / "model.onnx").write_bytes(b"x")
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    got = digest_run({"embed": model_dir, "llama": gguf, "gone": tmp_path / "nowhere"})
    assert got["files"] == {"embed": ["config.json", "onnx/model.onnx"], "llama": ["tiny.gguf"], "gone": []}


def prune(root: Path, keep: dict[str, list[str]], units: Path, check: bool = True) -> subprocess.CompletedProcess:
    args = {
        "root": str(root),
        "stamp": STAMP,
        "unit_dir": str(units),
        "unit_prefix": "budgetgpu-infer-",
        "keep": list(keep),
        "digests": {name: f"digest-{name}" for name in keep},
        "files": keep,
    }
    return subprocess.run(
        [sys.executable, "-I", "-c", PRUNE.read_text(), json.dumps(args)], capture_output=True, text=True, check=check
    )


def model(root: Path, name: str, *files: str, stamp: str | None = None) -> Path:
    top = root / name
    for path in files:
        (top / path).parent.mkdir(parents=True, exist_ok=True)
        (top / path).write_text(path)
    if stamp is not None:
        (top / STAMP).write_text(stamp + "\n")
    return top


def test_models_no_service_uses_any_more_go_and_the_rest_stay(tmp_path):
    root, units = tmp_path / "models", tmp_path / "units"
    units.mkdir()
    outside = tmp_path / "outside.bin"
    outside.write_text("not the role's")
    # llama: a new GGUF copied beside the old one, a leftover link; embed: a shard of an old checkpoint.
    model(root, "llama", "old.gguf", "new.gguf", stamp="digest-llama")
    (root / "llama" / "planted").symlink_to(outside)
    (root / "llama" / "dirlink").symlink_to(tmp_path)
    model(root, "embed", "config.json", "old/shard-1.bin", "model.safetensors", stamp="digest-embed")
    model(root, "gone", "weights.bin", stamp="digest-gone")  # a service that left this node
    model(root, "running", "weights.bin", stamp="x")  # left out of the inventory, its units still there
    (units / "budgetgpu-infer-running@.service").write_text("[Service]\n")
    model(root, "half", "weights.bin", stamp="digest-old")  # kept, but its copy is not complete: untouched
    model(root, "admins", "notes.txt")  # no stamp: not the role's
    done = prune(root, {"llama": ["new.gguf"], "embed": ["config.json", "model.safetensors"], "half": []}, units)
    removed = json.loads(done.stdout)["removed"]
    assert sorted(removed) == sorted(
        str(root / p)
        for p in ("llama/old.gguf", "llama/planted", "llama/dirlink", "embed/old/shard-1.bin", "embed/old", "gone")
    )
    assert sorted(p.name for p in root.iterdir()) == ["admins", "embed", "half", "llama", "running"]
    assert sorted(p.name for p in (root / "llama").iterdir()) == [STAMP, "new.gguf"]
    assert (root / "half" / "weights.bin").exists() and (root / "running" / "weights.bin").exists()
    # Links are removed, never followed.
    assert outside.read_text() == "not the role's" and (tmp_path / "units").is_dir()
    assert json.loads(prune(root, {"llama": ["new.gguf"]}, units).stdout)["removed"] == [
        str(root / "embed"),
        str(root / "half"),
    ]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another uid")
def test_nothing_is_removed_below_a_model_root_that_others_may_change(tmp_path):
    root, units = tmp_path / "models", tmp_path / "units"
    units.mkdir()
    model(root, "gone", "weights.bin", stamp="d")
    os.chown(root, 1000, 1000)
    done = prune(root, {}, units, check=False)
    assert done.returncode == 1 and (root / "gone" / "weights.bin").exists()
    assert f"inference_model_root {root}: {root} is uid 1000's" in done.stderr, done.stderr
    os.chown(root, 0, 0)
    os.chmod(root, 0o777)
    assert "mode drwxrwxrwx, expected root's and writable by root alone" in prune(root, {}, units, check=False).stderr
    os.chmod(root, 0o755)
    # A link as the model root (or on the way to it): refused, not followed.
    link = tmp_path / "link"
    link.symlink_to(root)
    assert "a link, or not a directory" in prune(link, {}, units, check=False).stderr
    assert (root / "gone").exists()
    prune(root, {}, units)
    assert not (root / "gone").exists()
