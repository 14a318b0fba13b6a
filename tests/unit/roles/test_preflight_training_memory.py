"""Role preflight's training memory check through ansible-playbook (fake nodes, as test_preflight_role.py): a job
whose planned peak does not fit its GPUs stops the run before anything is written, naming host, job, GPU, the
arithmetic and the ways out; a job that fits, and one without a model, are reported and pass."""

from __future__ import annotations

from ansible_collections.budgetgpu.cluster.tests.unit.roles.test_preflight_role import fake_node, playbook


def rtx3090_node(gpus: int = 4) -> dict:
    node = fake_node(gpus)
    for gpu in node["fake_gpus"]["gpus"]:
        gpu.update(memory_total_mib=24576, compute_capability="8.6")
    return node


def gpt2_xl(name: str, port: int, **keys) -> dict:
    model = {"preset": "gpt2-1.5b", "batch_size": 4}
    return {"name": name, "nproc_per_node": 4, "port": port, "user": "nobody", "model": model, **keys}


def test_a_job_that_does_not_fit_its_gpus_stops_preflight_and_the_others_are_reported(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('train')\n")
    common = {"script": str(script), "mixed_precision": "bf16", "activation_checkpointing": True}
    jobs = [
        gpt2_xl("ddp", 29500, **common),
        gpt2_xl("sharded", 29501, parallelism="fsdp", **common),
        {"name": "plain", "script": str(script), "nproc_per_node": 4, "port": 29502, "user": "nobody"},
    ]
    proc = playbook(tmp_path, jobs, {"fake1": rtx3090_node()})
    out = " ".join(proc.stdout.split())  # the YAML callback folds long lines
    assert proc.returncode != 0, out[-3000:]
    assert "preflight failed: nothing was changed on any node" in out
    assert "FAIL fake1: job ddp memory of GPU 0, 1, 2, 3 (NVIDIA GeForce RTX 3090, 24576 MiB): found 'needs peak" in out
    assert "ways out: parallelism: fsdp (9.4 GiB a rank)" in out
    assert "job sharded: peak 9.4 GiB a rank (fsdp over 4 ranks" in out and "fits every GPU of the job" in out
    assert "job plain: memory not planned: the job gives no model" in out
    assert "job sharded memory" not in out
    assert list((tmp_path / "written").iterdir()) == []
