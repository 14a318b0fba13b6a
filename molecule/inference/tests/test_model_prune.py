"""Model files no service uses any more are removed (issue 40 item 7): prepare.yml left on inference-node2 the
model of a service the inventory no longer has and a file the embed model no longer holds; the converge's prune
(roles/inference/files/model_prune.py) removed both and kept every file of the models the services use."""

from __future__ import annotations

from test_inference import OTHER, REPO, sh

ROOT = "/var/lib/budgetgpu/models"
MODELS = REPO / ".cache" / "molecule-inference"


def test_model_files_no_service_uses_are_removed_and_the_used_ones_kept() -> None:
    found = set(sh(OTHER, f"cd {ROOT} && find . -mindepth 1 | sort").split())
    assert "./retired" not in found and "./retired/model.safetensors" not in found, sorted(found)
    assert "./embed/old-shard.safetensors" not in found, sorted(found)
    embed = MODELS / "all-MiniLM-L6-v2"
    used = {f"./embed/{path.relative_to(embed)}" for path in embed.rglob("*") if path.is_file()}
    used |= {"./embed/.budgetgpu-model", "./llama/tiny-lm.gguf", "./generate/config.json"}
    assert used <= found, sorted(used - found)
