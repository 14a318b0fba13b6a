"""How a job spreads its model over the ranks, from inside the job: DDP (every rank holds all of it), FSDP2
(parameters, gradients and optimizer states sharded over every rank) or HSDP (sharded within a node, replicated
across nodes), with the job's precisions and activation checkpointing; and the sharded checkpoints of FSDP/HSDP
(torch.distributed.checkpoint: each rank writes its own shards, and a checkpoint loads at another world size).

Part of the node package (role node_venv), on the job venv's path. The job model's keys (parallelism,
mixed_precision, state_precision, activation_checkpointing: plugin_utils/jobs.py) reach it through the unit's
environment (BUDGETGPU_PARALLELISM, ...). Preflight has refused what cannot run (fsdp on one rank, hsdp on one
node, bf16 below compute capability 8.0 or on gloo, fp16 under sharding). budgetgpu_node.training's Job wraps the
model through it and adds the job's checkpoints, resume, stop and status; the loop underneath:

    from budgetgpu_node.sharding import wrap_model

    wrapped = wrap_model(model, device)                 # after dist.init_process_group()
    optimizer = torch.optim.AdamW(wrapped.module.parameters())
    for step in range(steps):
        for fwd_bwd in wrapped.micro_batches():         # accumulate_steps; gradients synced on the last
            with fwd_bwd:
                wrapped.backward(loss_fn(wrapped.module(inputs), labels) / wrapped.timer.accumulate_steps)
        wrapped.step(optimizer, clip=1.0)

A job restarted on fewer ranks than it plans (a GPU out of service: the launcher left it out) keeps its global
batch: wrap_model raises accumulate_steps by planned/world where that divides, and says so in world_change.

Everything torch is imported where it is used: the settings are plain Python.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .straggler import CommSettings, StepTimer, every_steps_from_env, wrap_ddp

# The job model's values (plugin_utils/jobs.py PARALLELISMS, PRECISIONS, STATE_PRECISIONS; a unit test holds
# them equal).
PARALLELISMS = ("ddp", "fsdp", "hsdp")
SHARDED = ("fsdp", "hsdp")
PRECISIONS = ("none", "bf16", "fp16")
STATE_PRECISIONS = ("fp32", "bf16")
# Set by a node's launcher (roles/torchrun/files/budgetgpu-torchrun) when it starts the job: the ranks the unit
# asked of this node before quarantined GPUs were left out, and the launcher's words on what it left out.
PLANNED_LOCAL_ENV = "BUDGETGPU_PLANNED_LOCAL_WORLD_SIZE"
LEFT_OUT_ENV = "BUDGETGPU_LEFT_OUT"


def _flag(value: str | None) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class ShardSettings:
    """The job's parallelism, precisions and activation checkpointing (the unit's environment)."""

    parallelism: str = "ddp"
    mixed_precision: str = "none"
    state_precision: str = "fp32"
    activation_checkpointing: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ShardSettings:
        """Read BUDGETGPU_PARALLELISM and the others; an unknown value is refused (ValueError), never guessed."""
        env = os.environ if env is None else env
        settings = cls(
            parallelism=env.get("BUDGETGPU_PARALLELISM", cls.parallelism),
            mixed_precision=env.get("BUDGETGPU_MIXED_PRECISION", cls.mixed_precision),
            state_precision=env.get("BUDGETGPU_STATE_PRECISION", cls.state_precision),
            activation_checkpointing=_flag(env.get("BUDGETGPU_ACTIVATION_CHECKPOINTING")),
        )
        for name, choices in (
            ("parallelism", PARALLELISMS),
            ("mixed_precision", PRECISIONS),
            ("state_precision", STATE_PRECISIONS),
        ):
            if getattr(settings, name) not in choices:
                raise ValueError(f"BUDGETGPU_{name.upper()}={getattr(settings, name)!r}: expected one of {choices}")
        return settings

    @property
    def sharded(self) -> bool:
        return self.parallelism in SHARDED


def _dtype(name: str) -> Any:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(name)


def blocks_of(model: Any) -> list[Any]:
    """The model's repeated blocks, the units FSDP shards and checkpointing recomputes: the modules of its
    largest ModuleList (a transformer's layers), else the children of a Sequential that hold parameters."""
    from torch import nn

    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if lists:
        return list(max(lists, key=len))
    if isinstance(model, nn.Sequential):
        return [child for child in model if next(child.parameters(recurse=True), None) is not None]
    return []


def _checkpoint_blocks(model: Any, blocks: list[Any]) -> list[Any]:
    """Wrap each block so that backward recomputes its activations (its state_dict keys stay as they were)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    wrapped = {id(block): checkpoint_wrapper(block) for block in blocks}
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            if id(child) in wrapped:
                parent.register_module(name, wrapped[id(child)])
    return [wrapped[id(block)] for block in blocks]


def device_mesh(settings: ShardSettings, device: Any) -> Any:
    """FSDP's mesh: every rank (fsdp), or nodes x ranks of a node (hsdp: replicate, shard). Named explicitly:
    a default gloo group on a host with GPUs moved the model to CUDA (pytorch#132471)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if settings.parallelism == "fsdp":
        return init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % local:
        raise ValueError(f"hsdp: world size {world} is not a multiple of the ranks of a node ({local})")
    return init_device_mesh(device.type, (world // local, local), mesh_dim_names=("replicate", "shard"))


class _GradientSync:
    """DDP's no_sync() for an FSDP2 model: no reduce-scatter on the micro-batches before the last."""

    def __init__(self, module: Any) -> None:
        self.module = module

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)


class _Autocast:
    """Runs a DDP model's forward in the compute precision (FSDP2 casts its parameters itself)."""

    def __init__(self, module: Any, device_type: str, dtype: Any) -> None:
        self.module, self.device_type, self.dtype = module, device_type, dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.module(*args, **kwargs)


@dataclass
class Wrapped:
    """A model as the job spreads it: call `forward`, train through micro_batches(), backward() and step()."""

    module: Any  # the DDP or FSDP module: its parameters go to the optimizer
    forward: Any  # what a step calls (the module, under autocast where DDP trains in a lower precision)
    timer: StepTimer
    settings: ShardSettings
    mesh: Any = None
    scaler: Any = None  # fp16 under DDP: the loss scaler
    # Fewer ranks than the job plans (keep_global_batch): {planned_world, world_change}, for the job's status.
    world_change: dict[str, Any] = field(default_factory=dict)
    _sync: Any = field(default=None, repr=False)

    @property
    def model(self) -> Any:
        """The model itself, whose state_dict a DDP checkpoint holds (DDP's module; FSDP2 shards it in place)."""
        from torch.nn.parallel import DistributedDataParallel

        return self.module.module if isinstance(self.module, DistributedDataParallel) else self.module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def micro_batches(self) -> Iterator[contextlib.AbstractContextManager[None]]:
        return self.timer.micro_batches(self._sync)

    def backward(self, loss: Any) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer: Any, clip: float = 0.0) -> None:
        """Unscale (fp16), clip the gradients' norm (over every shard), step the optimizer."""
        import torch

        with self.timer.compute():
            if self.scaler is not None:
                self.scaler.unscale_(optimizer)
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(self.module.parameters(), clip)
            if self.scaler is not None:
                self.scaler.step(optimizer)
                self.scaler.update()
            else:
                optimizer.step()


def planned_world_size(device: Any) -> int:
    """The job's world size with every GPU in service: the sum over its nodes of the ranks each node's unit asked
    for (PLANNED_LOCAL_ENV; a node started without it runs what was asked, LOCAL_WORLD_SIZE). A collective."""
    import torch
    import torch.distributed as dist

    local = os.environ.get(PLANNED_LOCAL_ENV) or os.environ.get("LOCAL_WORLD_SIZE", "1")
    total = torch.tensor([int(local) if _local_rank() == 0 else 0], dtype=torch.int64, device=device)
    dist.all_reduce(total)
    return int(total.item())


def keep_global_batch(
    comm: CommSettings, planned: int, world: int, left_out: str = ""
) -> tuple[CommSettings, dict[str, Any]]:
    """Return (the communication settings a run at `world` ranks trains with, its status fields) for a job planned
    at `planned` ranks (a GPU out of service: the launcher started fewer). Where world divides planned, gradient
    accumulation rises by planned/world and the global batch stays; else it stays, and the status says the global
    batch changed. At full size: the settings as they are and no field."""
    if world >= planned:
        return comm, {}
    accumulate = comm.accumulate_steps
    why = f"{world} of the {planned} ranks planned: {left_out or 'GPUs out of service on another node'}"
    if planned % world == 0:
        comm = dataclasses.replace(comm, accumulate_steps=accumulate * planned // world)
        why += f"; accumulate_steps {accumulate} -> {comm.accumulate_steps} keeps the global batch"
    else:
        why += (
            f"; the global batch changed from {planned * accumulate} to {world * accumulate} micro-batches"
            f" ({planned} ranks do not divide by {world})"
        )
    return comm, {"planned_world": planned, "world_change": why}


def wrap_model(
    model: Any,
    device: Any = None,
    settings: ShardSettings | None = None,
    comm: CommSettings | None = None,
    timer: StepTimer | None = None,
    blocks: list[Any] | None = None,
) -> Wrapped:
    """Spread model as the job says (settings default to the unit's environment): DDP with the job's
    communication settings and step timer (straggler.wrap_ddp), or fully_shard on each block and then the
    root over the job's mesh, with MixedPrecisionPolicy (parameters gathered in the compute precision,
    gradients reduced in fp32). The model is moved to device, and to bf16 first with state_precision bf16.
    A job restarted on fewer ranks than it plans keeps its global batch where it can (keep_global_batch)."""
    import torch
    import torch.distributed as dist

    settings = settings or ShardSettings.from_env()
    comm = comm or CommSettings.from_env()
    device = torch.device(device) if device is not None else next(model.parameters()).device
    change: dict[str, Any] = {}
    if dist.is_initialized():
        planned, left_out = planned_world_size(device), os.environ.get(LEFT_OUT_ENV, "")
        comm, change = keep_global_batch(comm, planned, dist.get_world_size(), left_out)
    blocks = blocks_of(model) if blocks is None else blocks
    if settings.activation_checkpointing:
        blocks = _checkpoint_blocks(model, blocks)
    model.to(device=device, dtype=torch.bfloat16 if settings.state_precision == "bf16" else None)
    compute = _dtype(settings.mixed_precision)
    if not settings.sharded or not dist.is_initialized():
        ddp, timer = wrap_ddp(model, device, comm, timer=timer)
        scaler = torch.amp.GradScaler(device.type) if settings.mixed_precision == "fp16" else None
        forward = _Autocast(ddp, device.type, compute) if compute is not None else ddp
        return Wrapped(ddp, forward, timer, settings, scaler=scaler, world_change=change, _sync=ddp)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = device_mesh(settings, device)
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32 if compute is not None else None)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if timer is None:
        rank, world = dist.get_rank(), dist.get_world_size()
        timer = StepTimer(rank, world, device, every_steps_from_env())
    timer.accumulate_steps = comm.accumulate_steps
    return Wrapped(model, model, timer, settings, mesh=mesh, world_change=change, _sync=_GradientSync(model))


def local_shard_numel(module: Any) -> int:
    """The parameters this rank holds (its shards under FSDP, everything under DDP)."""
    total = 0
    for param in module.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        total += local.numel()
    return total


# --- sharded checkpoints (fsdp, hsdp) ----------------------------------------------------------------------------

SHARDED_SUFFIX = ".dcp"
METADATA = ".metadata"  # torch.distributed.checkpoint's file, written by the coordinator last


def sharded_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:08d}{SHARDED_SUFFIX}")


def sharded_steps(directory: str) -> list[int]:
    """The steps of the complete sharded checkpoints this node holds (renamed into place only when complete),
    oldest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    steps = []
    for name in names:
        stem = name[len("step-") : -len(SHARDED_SUFFIX)]
        complete = os.path.isfile(os.path.join(directory, name, METADATA))
        if name.startswith("step-") and name.endswith(SHARDED_SUFFIX) and stem.isdigit() and complete:
            steps.append(int(stem))
    return sorted(steps)


def _node_group(wrapped: Wrapped) -> Any:
    """The group one node's copy is saved and loaded with: hsdp holds a whole replica on every node (its
    shard dimension), so each node keeps a complete checkpoint of its own; fsdp's shards span the job."""
    if wrapped.settings.parallelism == "hsdp":
        return wrapped.mesh.get_group("shard")
    return None


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def _share_metadata(path: str, device: Any) -> None:
    """fsdp over several nodes: the coordinator (rank 0) wrote the metadata on its node only; every node's
    first rank writes the same bytes beside its own ranks' shards (plain tensors: no pickling)."""
    import torch
    import torch.distributed as dist

    size = torch.zeros(1, dtype=torch.int64, device=device)
    payload = None
    if dist.get_rank() == 0:
        with open(os.path.join(path, METADATA), "rb") as handle:
            payload = torch.frombuffer(bytearray(handle.read()), dtype=torch.uint8).to(device)
        size += payload.numel()
    dist.broadcast(size, src=0)
    if payload is None:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=0)
    target = os.path.join(path, METADATA)
    if _local_rank() == 0 and not os.path.exists(target):
        with open(target + ".tmp", "wb") as handle:
            handle.write(bytes(payload.cpu().tolist()))
        os.replace(target + ".tmp", target)


def save_sharded(
    directory: str, step: int, wrapped: Wrapped, optimizer: Any, keep: int = 3, data: dict[str, int] | None = None
) -> str:
    """Every rank writes its shards of model and optimizer (and the step and data position, numbers) into
    step-<step>.dcp on its node; the directory is renamed into place once complete, then all but the newest `keep`
    are removed. Collective."""
    import shutil

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = sharded_path(directory, step)
    partial = final + ".partial"
    first = _local_rank() == 0
    if first:
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    model_state, optimizer_state = get_state_dict(wrapped.module, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "step": step, "data": dict(data or {})}
    dcp.save(state, checkpoint_id=partial, process_group=_node_group(wrapped))
    if wrapped.settings.parallelism == "fsdp" and dist.get_world_size() > int(os.environ.get("LOCAL_WORLD_SIZE", 1)):
        _share_metadata(partial, wrapped.timer.device)
    dist.barrier()

    def publish() -> None:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        for old in sharded_steps(directory)[:-keep]:
            shutil.rmtree(sharded_path(directory, old), ignore_errors=True)

    if dist.get_rank() == 0:
        publish()
    dist.barrier()
    if first and dist.get_rank() != 0 and os.path.isdir(partial):
        publish()
    dist.barrier()
    return final


def newest_common_step(directory: str, device: Any, keep: int = 3) -> int:
    """The newest step whose sharded checkpoint every node holds (0: none). Each node lists its own; one
    all_gather of a few numbers decides."""
    import torch
    import torch.distributed as dist

    width = keep + 2
    mine = sharded_steps(directory)[-width:] if _local_rank() == 0 else []
    # Ranks other than a node's first say nothing (-1: "any"), so only the nodes' own lists count.
    row = torch.full((width,), -1 if _local_rank() else 0, dtype=torch.int64, device=device)
    if mine:
        row[: len(mine)] = torch.tensor(mine, dtype=torch.int64)
    every = [torch.zeros_like(row) for _unused in range(dist.get_world_size())]
    dist.all_gather(every, row)
    lists = [set(r.tolist()) - {0} for r in every if -1 not in r.tolist()]
    common = set.intersection(*lists) if lists else set()
    return max(common, default=0)


def load_sharded(
    directory: str, wrapped: Wrapped, optimizer: Any, keep: int = 3, data: dict[str, int] | None = None
) -> int:
    """Load the newest checkpoint every node holds into model and optimizer (and into data the data position saved
    with it, keys as data has them), resharded to this run's world size; return its step (0: none). Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    step = newest_common_step(directory, wrapped.timer.device, keep)
    if step == 0:
        return 0
    model_state, optimizer_state = get_state_dict(wrapped.module, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "step": 0, "data": dict(data or {})}
    dcp.load(state, checkpoint_id=sharded_path(directory, step), process_group=_node_group(wrapped))
    set_state_dict(wrapped.module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if data is not None:
        data.update(state["data"])
    return int(state["step"])
