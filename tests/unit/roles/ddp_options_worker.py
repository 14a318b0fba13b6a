"""One rank of tests/unit/roles/test_torchrun_ddp_options.py (torchrun, 2 gloo ranks): for each
communication option, wrap a fresh copy of the trainer's model with budgetgpu_node.straggler.wrap_ddp
and train it with the trainer's train_step; then a run where rank 1 computes slower. Rank 0 writes
what it measured (each option's losses and window breakdown, what its DDP sent, the slow run's
finding) as JSON.

What DDP sent is recorded around torch's own functions, so that the tests see each option on the wire
rather than in the helper's settings: every dist.all_reduce the communication hooks issue (torch's
hooks call it by that name) and every gradient bucket DDP hands the job's hook (register_comm_hook is
wrapped: the hook the helper registers runs unchanged inside a recording one)."""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, sys.argv[1])  # roles/torchrun/files: the trainer
import train_ddp  # noqa: E402
from budgetgpu_node import sharding  # noqa: E402  (tests/unit/node_package.py: on PYTHONPATH)
from budgetgpu_node import straggler as helper  # noqa: E402

OPTIONS = {
    "none": helper.CommSettings(),
    "fp16": helper.CommSettings(gradient_compression="fp16"),
    # Rank 2, not the default 1: a rank that did not reach PowerSGD would go unseen.
    "powersgd": helper.CommSettings(gradient_compression="powersgd", powersgd_rank=2, powersgd_start_step=3),
    # Several buckets: on gloo, PowerSGD's chained all-reduces of one bucket raced the next bucket's.
    "powersgd_buckets": helper.CommSettings(gradient_compression="powersgd", powersgd_start_step=2, bucket_cap_mb=0.05),
    "bucket_cap_mb": helper.CommSettings(bucket_cap_mb=0.05),
    "accumulate_steps": helper.CommSettings(accumulate_steps=3),
}
STEPS = 12


class Wire:
    """This rank's traffic during one option's training, by step and micro-batch (the model's forward
    count within the step): all_reduces [step, micro, dtype, elements, bytes], buckets [step, micro,
    bucket index, elements]."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.step = self.micro = 0
        self.all_reduces: list[list] = []
        self.buckets: list[list] = []
        self.micro_batches: list[int] = []

    def begin_step(self, step: int) -> None:
        self.step, self.micro = step, -1
        self.micro_batches.append(0)

    def forward(self, *_unused: object) -> None:
        self.micro += 1
        self.micro_batches[-1] += 1

    def install(self) -> None:
        all_reduce = dist.all_reduce
        register = DistributedDataParallel.register_comm_hook

        def recorded_all_reduce(tensor, *args, **kwargs):  # noqa: ANN001, ANN202
            nbytes = tensor.numel() * tensor.element_size()
            self.all_reduces.append([self.step, self.micro, str(tensor.dtype), tensor.numel(), nbytes])
            return all_reduce(tensor, *args, **kwargs)

        def recorded_register(ddp, state, hook):  # noqa: ANN001, ANN202
            # No annotations: DDP checks a hook's annotations against its own types.
            def recording(state, bucket):  # noqa: ANN001, ANN202
                self.buckets.append([self.step, self.micro, bucket.index(), bucket.buffer().numel()])
                return hook(state, bucket)

            return register(ddp, state, recording)

        dist.all_reduce = recorded_all_reduce
        DistributedDataParallel.register_comm_hook = recorded_register


WIRE = Wire()


def train(base: torch.nn.Module, settings: helper.CommSettings, rank: int, slow_s: float = 0.0) -> dict:
    model = copy.deepcopy(base)
    if slow_s and rank == 1:
        model.register_forward_pre_hook(lambda *_unused: time.sleep(slow_s))
    model.register_forward_pre_hook(WIRE.forward)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    timer = helper.StepTimer(rank, 2, torch.device("cpu"), every=STEPS, local_rank=rank)
    ddp, timer = helper.wrap_ddp(model, "cpu", settings, timer=timer)
    wrapped = sharding.Wrapped(ddp, ddp, timer, sharding.ShardSettings(), _sync=ddp)
    args = train_ddp.parse_args(["--batch-size", "64", "--max-steps", str(STEPS), "--data-workers", "1"])
    data = iter(train_ddp.batches(args, rank, 0, settings.accumulate_steps))
    losses, line = [], None
    WIRE.reset()
    for step in range(STEPS):
        WIRE.begin_step(step)
        losses.append(float(train_ddp.train_step(wrapped, optimizer, data, train_ddp.Dist(world=2), 1.0)))
        line = timer.step_done() or line
    state = type(timer.comm_state).__name__
    # DDP averaged the same gradients on both ranks: their parameters are the same after training.
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    other = mine.clone()
    dist.broadcast(other, src=1)
    in_sync = float((mine - other).abs().max())
    return {
        "losses": losses,
        "line": line,
        "status": timer.window_status(),
        "comm_state": state,
        "in_sync": in_sync,
        "settings": dataclasses.asdict(settings),
        "min_compression_rate": getattr(timer.comm_state, "min_compression_rate", None),
        "all_reduces": WIRE.all_reduces,
        "buckets": WIRE.buckets,
        "micro_batches": WIRE.micro_batches,
    }


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    WIRE.install()
    base = train_ddp.make_model(384, 0, layers=1)  # steps long enough that a loaded machine shows little
    found = {name: train(base, settings, rank) for name, settings in OPTIONS.items()}
    found["slow rank 1"] = train(base, helper.CommSettings(), rank, slow_s=0.15)  # a loaded CI machine too
    found["model"] = {"shapes": [list(p.shape) for p in base.parameters()], "steps": STEPS}
    try:
        helper.wrap_ddp(copy.deepcopy(base), "cpu", helper.CommSettings(gradient_compression="bf16"))
        found["bf16"] = "accepted"
    except ValueError as err:
        found["bf16"] = str(err)
    if rank == 0:
        Path(sys.argv[2]).write_text(json.dumps(found))
    dist.barrier()
    return 0


if __name__ == "__main__":
    train_ddp.exit_process(main())  # as the trainer ends: its docstring says why
