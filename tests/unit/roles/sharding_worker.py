"""Run by tests/unit/roles/test_sharding.py under torchrun (gloo, CPU): the trainer's model spread by
budgetgpu_node.sharding as BUDGETGPU_PARALLELISM says, three SGD steps, then a sharded checkpoint (mode save) or
the newest one loaded at this world size (mode load). Rank 0 writes what the test checks as JSON: each rank's
share of the parameters, the step loaded, and the whole model gathered from the shards (as a list of numbers)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, sys.argv[1])  # the trainer's folder: its model, as the example job builds it
import train_ddp  # noqa: E402
from budgetgpu_node import sharding  # noqa: E402  (tests/unit/node_package.py: on PYTHONPATH)
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: E402


def main(directory: str, mode: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = train_ddp.make_model(hidden=32, seed=3, layers=2)
    total = sum(p.numel() for p in model.parameters())
    wrapped = sharding.wrap_model(model, "cpu")
    optimizer = torch.optim.SGD(wrapped.module.parameters(), lr=0.05, momentum=0.9)
    step = 0
    if mode == "save":
        for step in range(1, 4):
            inputs, labels = train_ddp.synthetic_batch(3, step, rank, 16)
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(wrapped.forward(inputs), labels)
            wrapped.backward(loss)
            wrapped.step(optimizer, clip=1.0)
        sharding.save_sharded(directory, step, wrapped, optimizer)
    else:
        step = sharding.load_sharded(directory, wrapped, optimizer)
    local = torch.tensor([sharding.local_shard_numel(wrapped.module)], dtype=torch.int64)
    every = [torch.zeros_like(local) for _unused in range(world)]
    dist.all_gather(every, local)
    full = get_model_state_dict(wrapped.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        weights = torch.cat([full[key].reshape(-1).float() for key in sorted(full)]).tolist()
        found = {"world": world, "total": total, "local": [int(t.item()) for t in every], "step": step}
        Path(out).write_text(json.dumps({**found, "weights": weights}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[2:5])
    train_ddp.exit_process(0)  # as the trainer ends: its docstring says why
