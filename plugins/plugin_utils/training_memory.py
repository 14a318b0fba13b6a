"""The training memory planner: what one rank of a training job holds on its GPU at its peak, against
each GPU of the job's nodes, and the ways out of a job that does not fit.

Controller-side and pure (jobs, hostvars and groups in, values out; no I/O). Preflight runs
``training_memory_check`` (filter ``training_memory_check``, roles/preflight/tasks/training_memory.yml);
``train.yml -e job_state=status`` prints ``training_memory_status`` (filter ``training_memory_status``).
docs/training-memory.md explains the formula, its calibration and the margin.

A job's ``model`` (a job key, JOB_DEFAULTS; ``{}`` plans nothing) describes what is trained:

    model: {preset: gpt2-1.5b, batch_size: 4}           # a preset gives params, layers, width, vocab, seq_len
    model: {params: 6.74e9, layers: 32, width: 4096, vocab: 32000, seq_len: 2048, batch_size: 1,
            optimizer: adamw, adapter: none, lora_rank: 8, implementation: transformers}

One rank's peak, in bytes (P parameters, of which T trained; S the shard group: ddp 1, fsdp every
rank of the job, hsdp the ranks of one node; N = batch_size x seq_len tokens; w width; L layers):

    states      (frozen P x 2 bytes, or 0.55 for 4-bit + T x state bytes x (2 + optimizer states)) / S
    DDP buckets T x state bytes (ddp: torch's flat gradient buckets beside .grad)
    activations L x alpha x N x w + 12.5 x N x vocab (logits, upcast for the loss); checkpointed:
                L x N x w x compute bytes + one block's alpha x N x w + the logits
    gathered    (S > 1) 2 blocks of 12 w^2 in the compute dtype + one in fp32 (the reduce) + the
                embeddings (vocab x w) in the compute dtype
    optimizer   T / S x state bytes (AdamW/SGD foreach: one copy of the rank's parameters)
    peak        states + DDP buckets + max(activations + gathered (+ autocast's copies), optimizer)

alpha is by the model's implementation: Hugging Face transformers' (the default) 58.4 bytes in a 2-byte compute
dtype and 116 in fp32, fitted to its GPT-2 on an H200 (docs/benchmarks/device-check.md, "fsdp";
tests/unit/plugins/plugin_utils/test_training_memory.py holds the planner within 15% of every row); the example
trainer's GPT-2 (the gpt2-* presets' implementation: example) 36.4 and 64.4, counted from the tensors its block
saves for backward (the same test counts them again from roles/torchrun/files/train_ddp.py). A GPU's usable memory
is its total (gpu_facts' memory_total_mib) less one CUDA context (inference.CUDA_CONTEXT_BYTES) and ALLOCATOR_SHARE
of the card.

A job over more than one node also gets link_verdict: whether its step over the inter-node link (model.link_gbit,
else the probes' slowest cluster interface) would be slower than one node's at the same global batch
(model.one_node_step_s): the bytes its collectives move per step (ddp: an all-reduce of the gradients, 2x their
bytes; fsdp: an all-gather of the parameters in forward and in backward and a reduce-scatter of the gradients,
about 3x; hsdp: ddp's all-reduce across nodes) over the link, added to the nodes' share of the compute.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.module_utils.gpt2 import GPT2_SIZES, gpt2_params
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.driver import parse_compute_capability
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.services import (
    CUDA_CONTEXT_BYTES,
    QUANT_MIN_CAPABILITY,
)
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.jobs import (
    BF16_MIN_CAPABILITY,
    PARALLELISMS,
    _slurped_json,
    job_backend,
    job_gpus,
    job_hosts,
    job_nproc,
)
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.nccl import nccl_line_rates
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.nodes import fact, node_gpus, node_info
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.preflight import _bad_sharding, _line, _problem

GIB = 2**30
# Published shapes: the guide's GPT-2 sizes (module_utils/gpt2.py, the table the example trainer's
# --gpt2-size builds from, so they are the example trainer's model) and the Llama sizes of the guide's FAQ. seq_len
# is the model's context; a job's model keys override any (implementation: transformers plans Hugging Face's GPT-2).
PRESETS: dict[str, dict[str, Any]] = {
    **{
        f"gpt2-{name}": {
            "params": gpt2_params(size),
            **{k: size[k] for k in ("layers", "width", "vocab", "seq_len")},
            "implementation": "example",
        }
        for name, size in GPT2_SIZES.items()
    },
    "llama-7b": {"params": 6_738_415_616, "layers": 32, "width": 4096, "vocab": 32000, "seq_len": 2048},
    "llama-13b": {"params": 13_015_864_320, "layers": 40, "width": 5120, "vocab": 32000, "seq_len": 2048},
}
SHAPE_KEYS = ("params", "layers", "width", "vocab", "seq_len", "batch_size")
MODEL_DEFAULTS: dict[str, Any] = {
    "optimizer": "adamw",
    "adapter": "none",
    "lora_rank": 8,
    "implementation": "transformers",
}
# What link_verdict reads, both optional: the inter-node link in Gbit/s (else the probes') and the seconds of a
# step at the job's global batch on one node (a one-node run's status; without it there is no verdict).
LINK_KEYS = ("link_gbit", "one_node_step_s")
MODEL_KEYS = ("preset", *SHAPE_KEYS, *MODEL_DEFAULTS, *LINK_KEYS)
# State tensors an optimizer keeps per trained parameter: Adam's two moments; SGD's momentum (none
# without momentum: counting it keeps the plan on the side of refusing).
OPTIMIZER_STATES = {"adamw": 2, "sgd": 1}
ADAPTERS = ("none", "lora", "qlora")
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
# Activations a transformer block keeps for backward, per token and per unit of width, by the model's
# implementation and the compute dtype's bytes (GPT-2 under fused attention: no seq^2 term), and the logits' bytes
# per token and vocabulary entry (Hugging Face upcasts them to fp32 for the loss). transformers': fitted to the
# H200 table (module docstring); its gelu_new is a chain of element-wise ops that each keep a tensor of 4 x width.
# example: train_ddp.Block's saved tensors (torch's fused tanh GELU, no dropout), fp32 and under bf16 autocast
# (LayerNorm and the residual stream stay fp32), counted by the unit test.
ALPHA = {"transformers": {2: 58.4, 4: 116.0}, "example": {2: 36.4, 4: 64.4}}
LOGITS_BYTES = 12.5
BLOCK_PARAMS_PER_WIDTH2 = 12  # attention 4 w^2 + MLP 8 w^2
GATHERED_BLOCKS = 2  # FSDP2 prefetches the next block while the current one computes
FROZEN_BYTES = {"lora": 2.0, "qlora": 0.55}  # a frozen base in bf16, or NF4 with its scales
ADAPTER_MATRICES = 4  # LoRA's A and B on two projections a layer: 4 x rank x width parameters
# What a GPU needs beyond the planned bytes: one CUDA context, and this share of the card for the
# caching allocator's reserve and fragmentation and NCCL's buffers (the table measures allocated bytes).
ALLOCATOR_SHARE = 0.10
MAX_WAYS_OUT = 4


def _gib(value: float) -> str:
    return f"{value / GIB:.1f} GiB"


def _number(value: Any) -> float | None:
    """A positive number, from YAML's int or float or a string such as "6.74e9" (YAML 1.1 reads that as text)."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) and number > 0 else None


def model_bads(model: Any) -> list[tuple[str, Any, str, str]]:
    """(field, found, expected, hint) for each bad key of a job's model ([] for {}: nothing planned)."""
    if not isinstance(model, Mapping):
        return [("model", model, "a dict such as {preset: gpt2-1.5b, batch_size: 4}, or {} to plan nothing", "")]
    if not model:
        return []
    bads = [
        (f"model.{k}", model[k], f"one of {', '.join(MODEL_KEYS)}", "a typo?") for k in model if k not in MODEL_KEYS
    ]
    preset = model.get("preset")
    if preset is not None and preset not in PRESETS:
        # The shape it would have given is not missing on top: one problem, the preset.
        return [*bads, ("model.preset", preset, f"one of {', '.join(PRESETS)}", "or params, layers, width, vocab")]
    known = PRESETS.get(preset, {})
    for key in SHAPE_KEYS:
        value = model.get(key, known.get(key))
        whole = key != "params"
        if _number(value) is None or (whole and float(value) != int(float(value))):
            what = "a positive number" if key == "params" else "a whole number of 1 or more"
            hint = "the per-rank micro-batch" if key == "batch_size" else "needed unless the preset gives it"
            bads.append((f"model.{key}", value, what, hint))
    for key, choices in (
        ("optimizer", tuple(OPTIMIZER_STATES)),
        ("adapter", ADAPTERS),
        ("implementation", tuple(ALPHA)),
    ):
        if model.get(key, MODEL_DEFAULTS[key]) not in choices:
            bads.append((f"model.{key}", model.get(key), f"one of {', '.join(choices)}", ""))
    rank = model.get("lora_rank", MODEL_DEFAULTS["lora_rank"])
    if _number(rank) is None or float(rank) != int(float(rank)):
        bads.append(("model.lora_rank", rank, "a whole number of 1 or more (LoRA's r)", ""))
    for key in LINK_KEYS:
        if key in model and _number(model[key]) is None:
            bads.append((f"model.{key}", model[key], "a positive number", "or leave it out"))
    return bads


def model_spec(model: Mapping[str, Any]) -> dict[str, Any]:
    """The model with its preset and defaults applied, numbers as numbers (after model_bads found none)."""
    spec = {**MODEL_DEFAULTS, **PRESETS.get(model.get("preset"), {}), **model}
    for key in (*SHAPE_KEYS, "lora_rank"):
        spec[key] = float(spec[key]) if key == "params" else int(float(spec[key]))
    for key in LINK_KEYS:
        spec[key] = _number(spec.get(key))
    return spec


def rank_plan(spec: Mapping[str, Any], options: Mapping[str, Any], shard: int) -> dict[str, float]:
    """Return one rank's bytes by term (states, ddp_buckets, activations, gathered, autocast, optimizer)
    and its peak, for a model spec and the job's parallelism, precisions and checkpointing."""
    state, adapter = DTYPE_BYTES[options["state_precision"]], spec["adapter"]
    # A model held in bf16 (bf16 states, or a LoRA/QLoRA base) computes in bf16 whatever mixed_precision says.
    compute = 2 if options["mixed_precision"] != "none" or state == 2 or adapter != "none" else 4
    width, layers, tokens = spec["width"], spec["layers"], spec["batch_size"] * spec["seq_len"]
    trained = spec["params"] if adapter == "none" else ADAPTER_MATRICES * spec["lora_rank"] * width * layers
    frozen = 0.0 if adapter == "none" else spec["params"] * FROZEN_BYTES[adapter]
    per_trained = state * (2 + OPTIMIZER_STATES[spec["optimizer"]])
    block = ALPHA[spec["implementation"]][compute] * tokens * width
    logits = LOGITS_BYTES * tokens * spec["vocab"]
    if options["activation_checkpointing"]:
        activations = layers * tokens * width * compute + block + logits
    else:
        activations = layers * block + logits
    block_params = BLOCK_PARAMS_PER_WIDTH2 * width**2
    gathered = 0.0
    if shard > 1:
        gathered = block_params * (GATHERED_BLOCKS * compute + 4) + spec["vocab"] * width * compute
    ddp = options["parallelism"] == "ddp"
    # DDP under autocast keeps the bf16 copies of the trained weights it cast for forward until backward.
    autocast = trained * 2 if ddp and compute == 2 and state == 4 and adapter == "none" else 0.0
    plan = {
        "states": (frozen + trained * per_trained) / shard,
        "ddp_buckets": trained * state if ddp else 0.0,
        "activations": activations,
        "gathered": gathered,
        "autocast": autocast,
        "optimizer": trained / shard * state,
    }
    phase = plan["activations"] + plan["gathered"] + plan["autocast"]
    plan["peak"] = plan["states"] + plan["ddp_buckets"] + max(phase, plan["optimizer"])
    return plan


def link_bytes(spec: Mapping[str, Any], options: Mapping[str, Any], layout: Mapping[str, int]) -> float:
    """The bytes a node sends over the inter-node link per optimizer step. A ring collective over R ranks sends
    (R - 1) / R of its tensor from each: DDP all-reduces the trained gradients once a step (twice that);
    FSDP all-gathers every parameter in forward and again in backward, each micro-batch, in the compute dtype (a
    frozen base in its own), and reduce-scatters the trained gradients (fp32 under mixed precision); HSDP shards
    within a node and all-reduces the gradients across nodes, as DDP does."""
    state, adapter, nodes = DTYPE_BYTES[options["state_precision"]], spec["adapter"], layout["nodes"]
    compute = 2 if options["mixed_precision"] != "none" or state == 2 or adapter != "none" else 4
    trained = (
        spec["params"] if adapter == "none" else ADAPTER_MATRICES * spec["lora_rank"] * spec["width"] * spec["layers"]
    )
    reduced = trained * (4 if options["mixed_precision"] != "none" else state)
    if options["parallelism"] == "fsdp":
        frozen = 0.0 if adapter == "none" else spec["params"] * FROZEN_BYTES[adapter]
        gathered = 2 * options.get("accumulate_steps", 1) * (frozen + trained * compute)
        return (gathered + reduced) * (layout["world"] - 1) / layout["world"]
    return 2 * reduced * (nodes - 1) / nodes


def link_verdict(
    spec: Mapping[str, Any], options: Mapping[str, Any], layout: Mapping[str, int], link_bit_s: float | None
) -> dict[str, Any] | None:
    """Whether the job's step over the link would be slower than one node's at the same global batch: the link's
    seconds (link_bytes at link_bit_s) added to the nodes' share of spec's one_node_step_s, not hidden behind it
    (on a slow link FSDP's next all-gather waits for the last). None for a job on one node or without both."""
    one_node = spec.get("one_node_step_s")
    if layout["nodes"] < 2 or not one_node or not link_bit_s:
        return None
    link_s = link_bytes(spec, options, layout) / (link_bit_s / 8)
    step_s = one_node / layout["nodes"] + link_s
    slower = step_s >= one_node
    verdict = (
        f"slower than one node ({step_s / one_node:.1f}x its step)" if slower else f"{one_node / step_s:.1f}x one node"
    )
    if slower and options["parallelism"] == "fsdp":  # HSDP keeps the all-gathers within a node
        hsdp_s = one_node / layout["nodes"] + link_bytes(spec, {**options, "parallelism": "hsdp"}, layout) / (
            link_bit_s / 8
        )
        verdict += f"; hsdp would take {hsdp_s:.2f} s" if hsdp_s < one_node else ""
    text = (
        f"{options['parallelism']} over {layout['nodes']} nodes at {link_bit_s / 1e9:g} Gbit/s: "
        f"{link_bytes(spec, options, layout) / 1e9:.2f} GB over the link a step ({link_s:.2f} s) + "
        f"{one_node / layout['nodes']:.2f} s of compute = {step_s:.2f} s a step against {one_node:g} s on one node: "
        f"{verdict}"
    )
    return {"link_s": link_s, "step_s": step_s, "one_node_step_s": one_node, "slower": slower, "text": text}


def probed_link_bit_s(hostvars: Mapping[str, Any], hosts: list[str]) -> float | None:
    """The slowest line rate of the hosts' cluster interfaces (the net probe's), in bit/s; None where one is
    virtual or unknown (a veth's nominal speed says nothing of the wire)."""
    chosen = [(fact(hostvars, host, "budgetgpu_net") or {}).get("cluster_interface") or {} for host in hosts]
    rates = nccl_line_rates(chosen)
    return min(rates) * 1e6 if rates and None not in rates else None


def usable_bytes(memory_mib: int) -> float:
    """A GPU's bytes a rank may plan to fill: its total less a CUDA context and ALLOCATOR_SHARE of it."""
    total = memory_mib * 2**20
    return total - CUDA_CONTEXT_BYTES - ALLOCATOR_SHARE * total


def _shard_group(parallelism: str, world: int, nproc: int) -> int:
    return {"ddp": 1, "fsdp": world, "hsdp": nproc}.get(parallelism, 1)


def plan_text(spec: Mapping[str, Any], options: Mapping[str, Any], plan: Mapping[str, float], world: int) -> str:
    """The arithmetic of a plan in GiB: 'peak 9.5 GiB a rank (fsdp over 8 ranks: states 5.8 + ...)'."""
    terms = (
        ("states", "states"),
        ("ddp_buckets", "DDP buckets"),
        ("activations", "activations"),
        ("gathered", "gathered blocks"),
        ("autocast", "autocast copies"),
    )
    # Terms below 0.05 GiB (a LoRA job's DDP buckets) would read 0.0.
    parts = [f"{label} {plan[key] / GIB:.1f}" for key, label in terms if plan[key] >= GIB / 20 or key == "states"]
    trained = "full" if spec["adapter"] == "none" else f"{spec['adapter']} rank {spec['lora_rank']}"
    checkpointing = ", activation checkpointing" if options["activation_checkpointing"] else ""
    how = (
        f"{options['parallelism']} over {world} rank{'s' if world != 1 else ''}, {spec['params'] / 1e9:.2f}e9 "
        f"params {trained}, {spec['optimizer']} {options['state_precision']} states, mixed_precision "
        f"{options['mixed_precision']}, batch {spec['batch_size']} x {spec['seq_len']}{checkpointing}"
    )
    step = f"; optimizer step {plan['optimizer'] / GIB:.1f}"
    return f"peak {_gib(plan['peak'])} a rank ({how}: {' + '.join(parts)}{step})"


def job_options(job: Mapping[str, Any]) -> dict[str, Any]:
    """The job keys a plan reads (the job model's values; preflight.py refuses unknown ones)."""
    return {
        "parallelism": job.get("parallelism") if job.get("parallelism") in PARALLELISMS else "ddp",
        "mixed_precision": job.get("mixed_precision") if job.get("mixed_precision") in ("bf16", "fp16") else "none",
        "state_precision": "bf16" if job.get("state_precision") == "bf16" else "fp32",
        "activation_checkpointing": job.get("activation_checkpointing") is True,
        "accumulate_steps": job.get("accumulate_steps") if isinstance(job.get("accumulate_steps"), int) else 1,
    }


def _levers(
    spec: Mapping[str, Any], options: Mapping[str, Any], nodes: int, world: int, capability: tuple[int, ...] | None
) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """The guide's ways out that the job does not take yet: (label, job options, model keys), in its order."""
    bf16 = capability is None or capability >= BF16_MIN_CAPABILITY
    parallelism = options["parallelism"]
    levers: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    if (parallelism == "ddp" and world > 1) or (parallelism == "hsdp" and nodes > 1):
        levers.append(("parallelism: fsdp", {"parallelism": "fsdp"}, {}))
    if options["state_precision"] == "fp32" and bf16:
        levers.append(("state_precision: bf16", {"state_precision": "bf16"}, {}))
    if options["mixed_precision"] == "none":
        dtype = "bf16" if bf16 else "fp16"
        levers.append((f"mixed_precision: {dtype}", {"mixed_precision": dtype}, {}))
    if not options["activation_checkpointing"]:
        levers.append(("activation_checkpointing: true", {"activation_checkpointing": True}, {}))
    if spec["adapter"] == "none":
        levers.append((f"model.adapter: lora (rank {spec['lora_rank']})", {}, {"adapter": "lora"}))
    if spec["adapter"] != "qlora" and (capability is None or capability >= QUANT_MIN_CAPABILITY):
        levers.append((f"model.adapter: qlora (rank {spec['lora_rank']})", {}, {"adapter": "qlora"}))
    return levers


def ways_out(
    spec: Mapping[str, Any], options: Mapping[str, Any], layout: Mapping[str, int], usable: float, capability: Any
) -> list[str]:
    """Each smallest set of the guide's levers that makes the job fit and that preflight accepts, with what
    it would need a rank, then more GPUs (fsdp over as many nodes like these as it takes), where that fits
    and fsdp alone does not. layout: {nodes, nproc, world}."""
    nodes, nproc, world = layout["nodes"], layout["nproc"], layout["world"]
    levers = _levers(spec, options, nodes, world, capability)
    found: dict[frozenset[int], str] = {}
    for size in range(1, len(levers) + 1):
        for combo in itertools.combinations(range(len(levers)), size):
            labels = [levers[i][0] for i in combo]
            if sum("model.adapter" in label for label in labels) > 1 or any(subset <= set(combo) for subset in found):
                continue
            new_options = {**options, **{k: v for i in combo for k, v in levers[i][1].items()}}
            if any(_bad_sharding(new_options)):  # preflight's own rule: no fp16 under fsdp or with bf16 states
                continue
            new_spec = {**spec, **{k: v for i in combo for k, v in levers[i][2].items()}}
            plan = rank_plan(new_spec, new_options, _shard_group(new_options["parallelism"], world, nproc))
            if plan["peak"] <= usable:
                found[frozenset(combo)] = f"{' + '.join(labels)} ({_gib(plan['peak'])} a rank)"
    ways = list(found.values())[:MAX_WAYS_OUT]
    if not any(text.startswith("parallelism: fsdp (") for text in ways) and nproc:
        fsdp = {**options, "parallelism": "fsdp"}
        for more in range(nodes + 1, 257):
            plan = rank_plan(spec, fsdp, more * nproc)
            if plan["peak"] <= usable:
                ways.append(
                    f"more GPUs: fsdp over {more * nproc} ({more} nodes of {nproc}) ({_gib(plan['peak'])} a rank)"
                )
                break
    return ways


def _layout(
    job: Mapping[str, Any], hostvars: Mapping[str, Any], groups: Mapping[str, list[str]]
) -> tuple[dict[str, int] | None, list[tuple[str, dict[str, Any]]], str]:
    """Return ({nodes, nproc, world, gloo: 1 where a node trains on gloo} or None, [(host, GPU facts)] of the
    GPUs the ranks use (jobs.job_gpus), why there is no plan)."""
    hosts, gpus, nprocs, gloo = job_hosts(job, groups), [], [], 0
    for host in hosts:
        node = node_info(hostvars, host)
        nproc, gloo = job_nproc(job, node), gloo or int(job_backend(job, node) != "nccl")
        held = job_gpus(job, node)
        used = [
            g
            for g in node_gpus(hostvars, host) or []
            if g.get("index") in held and isinstance(g.get("memory_total_mib"), int)
        ]
        if not used:
            return None, [], f"no GPU memory in gpu_facts of {host} (run the probe; is the driver loaded?)"
        if len(used) < nproc:  # the cluster check names nproc_per_node
            return None, [], f"{host} has {len(used)} GPUs with memory in gpu_facts, the job runs {nproc} processes"
        nprocs.append(nproc)
        gpus += [(host, g) for g in used]
    if not hosts:
        return None, [], f"no host in group {job.get('nodes')}"
    # hsdp shards within a node: the node with the fewest ranks holds the most a rank.
    return {"nodes": len(hosts), "nproc": min(nprocs), "world": sum(nprocs), "gloo": gloo}, gpus, ""


def _gpu_kinds(gpus: list[tuple[str, dict[str, Any]]]) -> dict[tuple[str, int], dict[str, list[Any]]]:
    """The job's GPUs by (model, MiB): {hosts, indices, capabilities}."""
    kinds: dict[tuple[str, int], dict[str, list[Any]]] = {}
    for host, gpu in gpus:
        kind = kinds.setdefault((str(gpu.get("name") or "unknown model"), gpu["memory_total_mib"]), {})
        for key, value in (
            ("hosts", host),
            ("indices", gpu.get("index")),
            ("capabilities", gpu.get("compute_capability")),
        ):
            if value not in kind.setdefault(key, []):
                kind[key].append(value)
    return kinds


def job_memory(job: Mapping[str, Any], hostvars: Mapping[str, Any], groups: Mapping[str, list[str]]) -> dict[str, Any]:
    """Return {problems, line, plan, why} of one job: its model's bad keys, else one problem for each kind of
    GPU the planned peak of a rank does not fit (host, job, GPU, the arithmetic, the ways out that fit), and
    the job's summary line; plan is None when nothing is planned, and why says why."""
    name, model = job.get("name"), job.get("model")
    where = ",".join(job_hosts(job, groups)) or "all"
    bads = model_bads(model if model is not None else {})
    if bads:
        problems = [_problem(where, name, *bad) for bad in bads]
        return {"problems": problems, "line": "", "plan": None, "why": f"a bad {bads[0][0]} (preflight names it)"}
    layout, gpus, why = _layout(job, hostvars, groups)
    if not model:
        why = "the job gives no model (model: {preset: gpt2-1.5b, batch_size: 4}, or params, layers, width...)"
    if not model or layout is None:
        return {"problems": [], "line": f"job {name}: memory not planned: {why}", "plan": None, "why": why}
    spec, options = model_spec(model), job_options(job)
    plan = rank_plan(spec, options, _shard_group(options["parallelism"], layout["world"], layout["nproc"]))
    text, problems = plan_text(spec, options, plan, layout["world"]), []
    for (model_name, mib), kind in sorted(_gpu_kinds(gpus).items(), key=lambda item: item[0][1]):
        usable = usable_bytes(mib)
        if plan["peak"] <= usable:
            continue
        capabilities = [c for c in map(parse_compute_capability, kind["capabilities"]) if c is not None]
        # A gloo job (simulated nodes: CPU) gets neither bf16 (preflight refuses it on gloo) nor QLoRA (CUDA only).
        capability = (0, 0) if layout["gloo"] else min(capabilities) if capabilities else None
        ways = ways_out(spec, options, layout, usable, capability)
        hint = (
            "ways out: " + "; ".join(ways) if ways else "nothing the guide names fits: a smaller batch_size or seq_len"
        )
        gpu = f"GPU {', '.join(str(i) for i in kind['indices'])} ({model_name}, {mib} MiB)"
        expected = (
            f"at most {_gib(usable)} ({mib / 1024:.1f} GiB less {CUDA_CONTEXT_BYTES / 2**20:.0f} MiB CUDA context "
            f"and {ALLOCATOR_SHARE:.0%} for the allocator)"
        )
        problems.append(_problem(",".join(kind["hosts"]), name, f"memory of {gpu}", f"needs {text}", expected, hint))
    verdict = f"does not fit {len(problems)} kind(s) of GPU" if problems else "fits every GPU of the job"
    smallest = min(gpu["memory_total_mib"] for _host, gpu in gpus)
    link_bit_s = spec["link_gbit"] * 1e9 if spec["link_gbit"] else probed_link_bit_s(hostvars, job_hosts(job, groups))
    link = link_verdict(spec, options, layout, link_bit_s)
    return {
        "problems": problems,
        "line": f"job {name}: {text}; {verdict} (the smallest: {_gib(usable_bytes(smallest))} usable)"
        + (f"; link: {link['text']}" if link else ""),
        "plan": plan,
        "link": link,
        "why": "",
    }


def training_memory_check(
    jobs: list[Mapping[str, Any]], hostvars: Mapping[str, Any], groups: Mapping[str, list[str]]
) -> dict[str, Any]:
    """Return {problems, report} for every job that is not absent: preflight's problem dicts (host, job,
    field, found, expected, hint) and the report (one line a job, then a FAIL line for each problem)."""
    problems, lines = [], []
    for job in jobs or []:
        if job.get("state") == "absent":
            continue
        result = job_memory(job, hostvars, groups)
        problems += result["problems"]
        lines += [result["line"]] if result["line"] else []
    return {"problems": problems, "report": lines + [_line("FAIL", p) for p in problems]}


def training_memory_status(
    job: Mapping[str, Any], hostvars: Mapping[str, Any], groups: Mapping[str, list[str]], status: Any = None
) -> list[str]:
    """Return the line train.yml -e job_state=status prints: the planned peak a rank beside the measured one
    (rank 0's status.json, parsed or as a slurp result: peak_memory_bytes, or the largest of its ranks' where
    they carry it)."""
    plan = job_memory(job, hostvars, groups)
    if plan["plan"] is None:
        return [f"memory: not planned: {plan['why']}"]
    line = f"memory: planned {_gib(plan['plan']['peak'])} a rank"
    link = [f"link: {plan['link']['text']}"] if plan["link"] else []
    if isinstance(status, Mapping) and "content" in status:
        status = _slurped_json(status)
    if not isinstance(status, Mapping):
        return [line + ", measured: no status on this node (rank 0 writes it on the job's master)", *link]
    peaks = [r.get("peak_memory_bytes") for r in status.get("ranks") or [] if isinstance(r, Mapping)]
    peaks = [p for p in [status.get("peak_memory_bytes"), *peaks] if _number(p) is not None]
    if not peaks:
        return [line + ", measured: not in rank 0's status (its trainer writes no peak_memory_bytes)", *link]
    measured = max(peaks)
    return [line + f", measured {_gib(measured)} ({measured / plan['plan']['peak'] - 1:+.0%} against the plan)", *link]
