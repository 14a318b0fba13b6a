"""The training memory planner (plugins/plugin_utils/training_memory.py): held against every row the H200
measured (docs/benchmarks/device-check.md, "fsdp"), and on the guide's cases (issue 42, item 4)."""

from __future__ import annotations

import base64
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils import training_memory as tm
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.jobs import torchrun_job_normalize

GIB = 2**30
DOC = Path(__file__).resolve().parents[4] / "docs" / "benchmarks" / "device-check.md"
RTX3090 = ("NVIDIA GeForce RTX 3090", 24576, "8.6")
RTX4060TI = ("NVIDIA GeForce RTX 4060 Ti", 16376, "8.9")
# The guide's 7B full fine-tune (Llama-7B's shape), batch 1 x 2048 a rank.
LLAMA_7B = {"params": 6.74e9, "layers": 32, "width": 4096, "vocab": 32000, "seq_len": 2048, "batch_size": 1}


def measured_rows() -> list[dict]:
    """The fsdp table of the device check: model, params, variant, after step 1 and peak in GiB."""
    section = DOC.read_text().split("**fsdp**", 1)[1]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0].startswith("gpt2-"):
            rows.append({"model": cells[0], "params_m": int(cells[1].split()[0]), "variant": cells[2],
                         "states_gib": float(cells[4]), "peak_gib": float(cells[6])})  # fmt: skip
    return rows


# The benchmark ran at batch 4 x 1024 tokens, world size 1 (nothing sharded). plain-fp32 is no wrapper at all:
# a DDP rank's states without DDP's buckets, which the planner adds for ddp (the table does not measure them).
VARIANTS = {
    "fsdp-bf16": {"mixed_precision": "bf16", "activation_checkpointing": False},
    "fsdp-bf16-ckpt": {"mixed_precision": "bf16", "activation_checkpointing": True},
    "fsdp-fp32": {"mixed_precision": "none", "activation_checkpointing": False},
    "plain-fp32": {"mixed_precision": "none", "activation_checkpointing": False},
}


def test_the_table_holds_every_preset_and_variant_the_benchmark_measured():
    rows = measured_rows()
    assert len(rows) == 16, rows
    assert {(r["model"], r["variant"]) for r in rows} == {
        (m, v) for m in ("gpt2-124m", "gpt2-355m", "gpt2-774m", "gpt2-1.5b") for v in VARIANTS
    }
    for row in rows:  # the presets' parameter counts are the models the H200 built
        assert round(tm.PRESETS[row["model"]]["params"] / 1e6) == row["params_m"]


# The H200 trained Hugging Face's GPT2LMHeadModel (tests/benchmarks/fsdp_memory.py): the presets' shapes, planned
# as that implementation (the presets alone mean the example trainer's GPT-2).
HF = {"batch_size": 4, "implementation": "transformers"}


@pytest.mark.parametrize("row", measured_rows(), ids=lambda r: f"{r['model']}-{r['variant']}")
def test_the_planned_peak_is_within_15_percent_of_the_h200s_measured_peak(row):
    spec = tm.model_spec({"preset": row["model"], **HF})
    options = {"parallelism": "fsdp", "state_precision": "fp32", **VARIANTS[row["variant"]]}
    plan = tm.rank_plan(spec, options, shard=1)
    assert plan["peak"] / GIB == pytest.approx(row["peak_gib"], rel=0.15)
    # Weights, gradients and AdamW states: 16 bytes a parameter against the 16.0 to 16.2 measured.
    assert plan["states"] / GIB == pytest.approx(row["states_gib"], rel=0.05)


TRAINER = Path(__file__).resolve().parents[4] / "roles" / "torchrun" / "files" / "train_ddp.py"


def saved_bytes(block, tokens: int, width: int, autocast: bool) -> int:
    """The bytes of the distinct storages a forward of `block` saves for backward (views of one storage once)."""
    torch = pytest.importorskip("torch")
    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
    with hooks, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        block(torch.randn(1, tokens, width, requires_grad=True))
    return sum(storages.values())


@pytest.mark.parametrize(("compute", "autocast"), [(4, False), (2, True)], ids=["fp32", "bf16-autocast"])
def test_the_example_presets_alpha_is_what_the_example_trainers_block_saves_for_backward(compute, autocast):
    # The slope over the tokens: a block's weights (and autocast's casts of them) are saved too, per parameter
    # (the states' and autocast's terms), and drop out of the difference.
    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("train_ddp", TRAINER)
    trainer = importlib.util.module_from_spec(spec)
    sys.modules["train_ddp"] = trainer  # dataclasses look their module up there
    try:
        spec.loader.exec_module(trainer)
        width, block = 64, trainer.Block(64, 2)
        per_token = (saved_bytes(block, 256, width, autocast) - saved_bytes(block, 128, width, autocast)) / 128
    finally:
        sys.modules.pop("train_ddp", None)
    assert tm.PRESETS["gpt2-1.5b"]["implementation"] == "example"
    assert tm.ALPHA["example"][compute] == pytest.approx(per_token / width, rel=0.02)


def test_with_checkpointing_the_774m_and_1_5b_peaks_are_the_optimizer_step_not_the_activations():
    # The H200's 1.5B with checkpointing peaked at 29.49 GiB: 23.55 of states and the optimizer step's copy of
    # the parameters (4 bytes each, 5.8 GiB), above the 3.3 GiB of checkpointed activations.
    spec = tm.model_spec({"preset": "gpt2-1.5b", **HF})
    plan = tm.rank_plan(spec, {**VARIANTS["fsdp-bf16-ckpt"], "parallelism": "fsdp", "state_precision": "fp32"}, 1)
    assert plan["optimizer"] > plan["activations"]
    assert plan["peak"] == plan["states"] + plan["optimizer"]


def gpus(kind: tuple = RTX3090, count: int = 4) -> dict:
    name, mib, capability = kind
    return {
        "driver": {"state": "loaded", "version": "550.54.14"},
        "count": count,
        "gpus": [{"index": i, "name": name, "memory_total_mib": mib, "compute_capability": capability}
                 for i in range(count)],
    }  # fmt: skip


def cluster(*nodes: dict) -> tuple[dict, dict]:
    """hostvars and groups of nodes node1, node2... in group gpu_nodes, each with its gpu_facts."""
    hostvars = {f"node{i}": {"ansible_facts": {"budgetgpu_gpus": n}} for i, n in enumerate(nodes, 1)}
    return hostvars, {"gpu_nodes": list(hostvars)}


def job(**keys) -> dict:
    return torchrun_job_normalize({"name": "train", "script": "/srv/train.py", **keys})


def check(one_job: dict, *nodes: dict) -> dict:
    return tm.job_memory(one_job, *cluster(*(nodes or (gpus(),))))


# GPT-2 1.5B as the guide trains it on 4x3090: batch 4 x 1024 a rank, bf16 compute, activation checkpointing.
GPT2_XL = {
    "model": {"preset": "gpt2-1.5b", "batch_size": 4},
    "mixed_precision": "bf16",
    "activation_checkpointing": True,
}


def test_gpt2_1_5b_on_4x3090_is_refused_under_ddp_with_the_arithmetic_and_fsdp_as_a_way_out():
    result = check(job(**GPT2_XL))
    (problem,) = result["problems"]
    assert problem["host"] == "node1" and problem["job"] == "train"
    assert problem["field"] == "memory of GPU 0, 1, 2, 3 (NVIDIA GeForce RTX 3090, 24576 MiB)"
    # 16 bytes a parameter on every GPU before one activation, and DDP's buckets beside the gradients.
    assert "ddp over 4 ranks" in problem["found"] and "states 23.2 + DDP buckets 5.8" in problem["found"]
    assert problem["expected"].startswith("at most 21.1 GiB (24.0 GiB less 500 MiB CUDA context and 10%")
    assert "parallelism: fsdp (9.4 GiB a rank)" in problem["hint"]


def test_gpt2_1_5b_on_4x3090_is_accepted_under_fsdp():
    result = check(job(**GPT2_XL, parallelism="fsdp"))
    assert result["problems"] == []
    assert result["plan"]["states"] == pytest.approx(1_557_611_200 * 16 / 4)
    assert "fits every GPU of the job" in result["line"] and "fsdp over 4 ranks" in result["line"]


FSDP_7B = {"model": LLAMA_7B, "parallelism": "fsdp"}


def test_a_7b_full_fine_tune_on_4x3090_fits_with_bf16_states_and_checkpointing_about_14_gb_of_states_a_gpu():
    result = check(job(**FSDP_7B, state_precision="bf16", activation_checkpointing=True))
    assert result["problems"] == [], result["problems"]
    assert 13e9 < result["plan"]["states"] < 14e9  # 6.74e9 x 8 bytes / 4


@pytest.mark.parametrize(
    "keys",
    [
        {"state_precision": "bf16"},  # without checkpointing: 14.6 GiB of activations at 2048 tokens
        {"activation_checkpointing": True, "mixed_precision": "bf16"},  # fp32 states: 25.1 GiB a GPU
        {},
    ],
    ids=["bf16-states-only", "checkpointing-only", "neither"],
)
def test_a_7b_full_fine_tune_on_4x3090_is_refused_without_either(keys):
    (problem,) = check(job(**FSDP_7B, **keys))["problems"]
    assert problem["field"].startswith("memory of GPU 0, 1, 2, 3")
    if not keys:
        assert "state_precision: bf16 + activation_checkpointing: true (16.0 GiB a rank)" in problem["hint"]


def test_a_7b_with_fp32_adamw_on_4x24gb_is_refused_whatever_the_activations():
    # Even at one token a rank: 6.74e9 x 16 bytes / 4 = 25.1 GiB of states against 21.1 usable.
    tiny_batch = {**LLAMA_7B, "seq_len": 1}
    (problem,) = check(job(model=tiny_batch, parallelism="fsdp", activation_checkpointing=True))["problems"]
    assert "adamw fp32 states" in problem["found"] and "states 25.1" in problem["found"]


def test_the_guides_faq_7b_lora_fits_16gb_and_13b_qlora_fits_24gb():
    lora = {**LLAMA_7B, "seq_len": 1024, "adapter": "lora", "lora_rank": 8}
    result = check(job(model=lora, nproc_per_node=1, activation_checkpointing=True), gpus(RTX4060TI, 1))
    assert result["problems"] == [] and "lora rank 8" in result["line"]
    qlora = {"preset": "llama-13b", "batch_size": 1, "adapter": "qlora"}
    result = check(job(model=qlora, nproc_per_node=1, activation_checkpointing=True), gpus(RTX3090, 1))
    assert result["problems"] == [] and "13.02e9 params qlora" in result["line"]


def test_a_7b_full_fine_tune_on_one_16gb_card_names_lora_and_qlora_and_only_ways_that_fit():
    full = {**LLAMA_7B, "seq_len": 1024}  # the FAQ's LoRA case below, as a full fine-tune
    (problem,) = check(job(model=full, nproc_per_node=1, activation_checkpointing=True), gpus(RTX4060TI, 1))["problems"]
    ways = problem["hint"].removeprefix("ways out: ").split("; ")
    assert any(w.startswith("model.adapter: lora (rank 8) (") for w in ways), ways
    assert any(w.startswith("model.adapter: qlora (rank 8) (") for w in ways), ways
    usable = tm.usable_bytes(RTX4060TI[1]) / GIB
    for way in ways:
        assert float(re.search(r"\(([\d.]+) GiB a rank\)$", way)[1]) <= usable, way
    # bf16 states alone leave 12.6 GiB of weights, gradients and states on one card: not offered.
    assert not any(w.startswith("state_precision: bf16 (") for w in ways), ways


def test_more_gpus_are_offered_with_the_nodes_they_take():
    spec, options = tm.model_spec(LLAMA_7B), tm.job_options(job(parallelism="fsdp", activation_checkpointing=True))
    ways = tm.ways_out(spec, options, {"nodes": 1, "nproc": 4, "world": 4}, tm.usable_bytes(24576), (8, 6))
    # fp32 states over 8 ranks: 12.6 GiB of them a rank, and the checkpointed activations.
    assert "more GPUs: fsdp over 8 (2 nodes of 4) (18.0 GiB a rank)" in ways


def test_below_compute_capability_8_no_bf16_way_out_is_offered():
    turing = ("NVIDIA GeForce RTX 2080 Ti", 11264, "7.5")
    (problem,) = check(job(model={"preset": "gpt2-774m", "batch_size": 4}), gpus(turing, 1))["problems"]
    assert "bf16" not in problem["hint"] and "activation_checkpointing: true + model.adapter: lora" in problem["hint"]
    spec, options = tm.model_spec({"preset": "gpt2-774m", "batch_size": 4}), tm.job_options(job())
    assert [lever[0] for lever in tm._levers(spec, options, 1, 1, (7, 5))] == [
        "mixed_precision: fp16",
        "activation_checkpointing: true",
        "model.adapter: lora (rank 8)",
        "model.adapter: qlora (rank 8)",
    ]


def test_a_job_on_simulated_nodes_gloo_gets_no_bf16_and_no_qlora_way_out():
    hostvars, groups = cluster(gpus())
    hostvars["node1"]["budgetgpu_simulated"] = True
    (problem,) = tm.job_memory(job(model=LLAMA_7B, parallelism="fsdp"), hostvars, groups)["problems"]
    assert "bf16" not in problem["hint"] and "qlora" not in problem["hint"], problem["hint"]
    assert "model.adapter: lora (rank 8)" in problem["hint"]


def test_no_way_out_is_one_preflight_refuses_fp16_under_fsdp():
    # On 4 x RTX 2080 Ti, GPT-2 355M under ddp: fsdp alone is too little, fsdp with fp16 would just fit (9.4 GiB
    # a rank) but preflight refuses fp16 on the sharded path (no loss scaler), so fsdp comes with checkpointing.
    turing = ("NVIDIA GeForce RTX 2080 Ti", 11264, "7.5")
    (problem,) = check(job(model={"preset": "gpt2-355m", "batch_size": 4}), gpus(turing, 4))["problems"]
    ways = problem["hint"].removeprefix("ways out: ").split("; ")
    assert not any("parallelism: fsdp" in w and "fp16" in w for w in ways), ways
    assert any(w.startswith("parallelism: fsdp + activation_checkpointing: true (") for w in ways), ways


def test_hsdp_shards_within_a_node_and_fsdp_over_every_rank():
    two_by_two = (gpus(count=2), gpus(count=2))
    hsdp = check(job(**GPT2_XL, parallelism="hsdp"), *two_by_two)["plan"]
    fsdp = check(job(**GPT2_XL, parallelism="fsdp"), *two_by_two)["plan"]
    assert hsdp["states"] == pytest.approx(1_557_611_200 * 16 / 2)
    assert fsdp["states"] == pytest.approx(1_557_611_200 * 16 / 4)


def test_each_kind_of_gpu_is_checked_and_only_those_that_do_not_fit_are_named():
    keys = {"model": {"preset": "gpt2-1.5b", "batch_size": 3}, "mixed_precision": "bf16", "parallelism": "fsdp"}
    (problem,) = check(job(**keys), gpus(count=2), gpus(RTX4060TI, 2))["problems"]  # 16.0 GiB a rank
    assert problem["host"] == "node2" and "RTX 4060 Ti, 16376 MiB" in problem["field"]


@pytest.mark.parametrize(
    ("model", "field", "words"),
    [
        ({"preset": "gpt2-1.5b", "batch_size": 4, "batchsize": 4}, "model.batchsize", "one of preset, params"),
        ({"preset": "gpt-5", "batch_size": 4}, "model.preset", "one of gpt2-124m"),
        ({"preset": "gpt2-1.5b"}, "model.batch_size", "a whole number of 1 or more"),
        ({**LLAMA_7B, "layers": 0}, "model.layers", "a whole number"),
        ({**LLAMA_7B, "width": True}, "model.width", "a whole number"),
        ({**LLAMA_7B, "seq_len": 10.5}, "model.seq_len", "a whole number"),
        ({**LLAMA_7B, "params": "many"}, "model.params", "a positive number"),
        ({**LLAMA_7B, "optimizer": "adam"}, "model.optimizer", "one of adamw, sgd"),
        ({**LLAMA_7B, "adapter": "dora"}, "model.adapter", "one of none, lora, qlora"),
        ({**LLAMA_7B, "implementation": "hf"}, "model.implementation", "one of transformers, example"),
        ({**LLAMA_7B, "lora_rank": 0}, "model.lora_rank", "LoRA's r"),
        ([LLAMA_7B], "model", "a dict such as"),
    ],
)
def test_a_bad_model_key_is_a_problem_naming_job_and_key_and_nothing_is_planned(model, field, words):
    result = check(job(model=model))
    assert result["plan"] is None
    assert [(p["host"], p["job"], p["field"]) for p in result["problems"]] == [("node1", "train", field)]
    assert words in result["problems"][0]["expected"]


def test_params_as_yaml_reads_them_and_explicit_keys_override_the_preset():
    # YAML 1.1 reads 6.74e9 as text, and extra vars give text: both plan as the number.
    assert tm.model_bads({**LLAMA_7B, "params": "6.74e9"}) == []
    assert tm.model_spec({**LLAMA_7B, "params": "6.74e9"})["params"] == 6.74e9
    assert tm.model_spec({"preset": "gpt2-1.5b", "batch_size": 2, "seq_len": 512})["seq_len"] == 512


def test_a_job_without_model_or_without_gpu_facts_is_not_planned_and_says_so():
    result = check(job())
    assert result["problems"] == [] and "memory not planned: the job gives no model" in result["line"]
    hostvars = {"node1": {"ansible_facts": {}}}
    result = tm.job_memory(job(**GPT2_XL), hostvars, {"gpu_nodes": ["node1"]})
    assert result["problems"] == [] and "no GPU memory in gpu_facts of node1" in result["line"]
    result = check(job(**GPT2_XL, nproc_per_node=8))  # the cluster check names nproc_per_node
    assert result["problems"] == [] and "node1 has 4 GPUs with memory in gpu_facts, the job runs 8" in result["line"]


def test_the_check_reports_a_line_a_job_then_each_problem_in_preflights_form_and_skips_absent_jobs():
    jobs = [job(**GPT2_XL), {**job(**GPT2_XL, name="gone"), "state": "absent"}, job(name="plain", port=29501)]
    result = tm.training_memory_check(jobs, *cluster(gpus()))
    assert [p["job"] for p in result["problems"]] == ["train"]
    assert result["report"][0].startswith("job train: peak 35.1 GiB a rank (ddp over 4 ranks")
    assert result["report"][1].startswith("job plain: memory not planned")
    assert result["report"][2].startswith("FAIL node1: job train memory of GPU 0, 1, 2, 3 (NVIDIA GeForce RTX 3090")
    assert not any("gone" in line for line in result["report"])


def test_the_status_line_puts_the_measured_peak_beside_the_plan():
    one = job(**GPT2_XL, parallelism="fsdp")
    hostvars, groups = cluster(gpus())
    measured = {"step": 10, "peak_memory_bytes": 9 * GIB}
    assert tm.training_memory_status(one, hostvars, groups, measured) == [
        "memory: planned 9.4 GiB a rank, measured 9.0 GiB (-4% against the plan)"
    ]
    # As the reader hands it over (slurp's form), and with the peak in each rank's entry.
    by_rank = {"ranks": [{"rank": 0, "peak_memory_bytes": 8 * GIB}, {"rank": 1, "peak_memory_bytes": 10 * GIB}]}
    slurped = {"content": base64.b64encode(json.dumps(by_rank).encode()).decode()}
    assert "measured 10.0 GiB (+7% against the plan)" in tm.training_memory_status(one, hostvars, groups, slurped)[0]
    assert "measured: not in rank 0's status" in tm.training_memory_status(one, hostvars, groups, {"step": 1})[0]
    assert "measured: no status on this node" in tm.training_memory_status(one, hostvars, groups, None)[0]
    assert tm.training_memory_status(job(), hostvars, groups, None)[0].startswith(
        "memory: not planned: the job gives no model"
    )


def planner_rows() -> list[dict]:
    """The second run's table (docs/benchmarks/device-check.md, "planner"): every variant, bf16 states included,
    which the planner was not fitted to."""
    section = DOC.read_text().split("**planner**", 1)[1]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[0].startswith("gpt2-"):
            rows.append({"model": cells[0], "variant": cells[1], "states_gib": float(cells[2]),
                         "bytes_per_param": float(cells[3]), "peak_gib": float(cells[4])})  # fmt: skip
    return rows


BF16_STATES = {"mixed_precision": "bf16", "state_precision": "bf16", "activation_checkpointing": False}


@pytest.mark.parametrize("row", planner_rows(), ids=lambda r: f"{r['model']}-{r['variant']}")
def test_the_planned_peak_holds_on_the_second_run_bf16_states_included(row):
    options = (
        BF16_STATES if row["variant"] == "fsdp-bf16-states" else {"state_precision": "fp32", **VARIANTS[row["variant"]]}
    )
    plan = tm.rank_plan(tm.model_spec({"preset": row["model"], **HF}), {"parallelism": "fsdp", **options}, 1)
    assert plan["peak"] / GIB == pytest.approx(row["peak_gib"], rel=0.15)
    assert plan["states"] / GIB == pytest.approx(row["states_gib"], rel=0.05)


def test_the_second_run_measured_8_bytes_a_parameter_with_bf16_states():
    rows = [r for r in planner_rows() if r["variant"] == "fsdp-bf16-states"]
    assert len(rows) == 4 and all(8.0 <= r["bytes_per_param"] <= 8.2 for r in rows), rows


# LlamaFactory#5014 (the case): Llama-3 8B LoRA under DeepSpeed ZeRO-3 over two nodes of 8 GPUs on 10GbE,
# 90 s a step against 4 s on one node; without ZeRO-3 (DDP of the adapters) the two nodes trained as expected.
LLAMA3_8B_LORA = {"params": 8.03e9, "layers": 32, "width": 4096, "vocab": 128256, "seq_len": 1024, "batch_size": 1,
                  "adapter": "lora", "one_node_step_s": 4}  # fmt: skip
TWO_NODES_OF_8 = {"nodes": 2, "nproc": 8, "world": 16}


def options(parallelism: str, **keys) -> dict:
    return {"parallelism": parallelism, "mixed_precision": "bf16", "state_precision": "fp32",
            "activation_checkpointing": True, "accumulate_steps": 1, **keys}  # fmt: skip


def test_fsdp_over_10gbe_is_slower_than_one_node_in_the_guides_zero3_case_and_ddp_is_not():
    spec = tm.model_spec(LLAMA3_8B_LORA)
    fsdp = tm.link_verdict(spec, options("fsdp"), TWO_NODES_OF_8, 10e9)
    # The frozen bf16 base gathered in forward and in backward: 2 x 8.03e9 x 2 bytes x 15/16 over 1.25 GB/s.
    assert fsdp["link_s"] == pytest.approx(2 * 8.03e9 * 2 * 15 / 16 / 1.25e9, rel=0.01)
    assert fsdp["slower"] and fsdp["step_s"] > 6 * 4
    assert "slower than one node" in fsdp["text"] and "hsdp would take 2.01 s" in fsdp["text"]
    ddp = tm.link_verdict(spec, options("ddp"), TWO_NODES_OF_8, 10e9)
    assert not ddp["slower"] and ddp["text"].endswith("2.0x one node")


def test_the_link_bytes_are_3x_the_parameters_for_fsdp_and_2x_the_gradients_for_ddp_and_hsdp():
    spec = tm.model_spec({"preset": "gpt2-124m", "batch_size": 4})
    params, layout = spec["params"], {"nodes": 4, "nproc": 1, "world": 4}
    fp32 = {"mixed_precision": "none"}
    assert tm.link_bytes(spec, options("fsdp", **fp32), layout) == pytest.approx(3 * params * 4 * 3 / 4)
    assert tm.link_bytes(spec, options("ddp", **fp32), layout) == pytest.approx(2 * params * 4 * 3 / 4)
    # FSDP gathers again for every micro-batch; HSDP crosses the link only to all-reduce across nodes.
    assert tm.link_bytes(spec, options("fsdp", **fp32, accumulate_steps=2), layout) == pytest.approx(
        5 * params * 4 * 3 / 4
    )
    two_nodes = {"nodes": 2, "nproc": 2, "world": 4}
    assert tm.link_bytes(spec, options("hsdp", **fp32), two_nodes) == pytest.approx(2 * params * 4 / 2)


def test_the_check_line_gives_the_link_verdict_from_the_probes_line_rate_or_the_jobs_and_none_on_one_node():
    hostvars, groups = cluster(gpus(), gpus())
    for host in hostvars:
        interface = {"name": "enp1s0", "kind": "physical", "speed_mbps": 10000}
        hostvars[host]["ansible_facts"]["budgetgpu_net"] = {"cluster_interface": interface}
    fsdp = job(model={**LLAMA3_8B_LORA, "batch_size": 1}, parallelism="fsdp", mixed_precision="bf16")
    line = tm.job_memory(fsdp, hostvars, groups)["line"]
    assert "; link: fsdp over 2 nodes at 10 Gbit/s: " in line and "slower than one node" in line
    fast = job(model={**LLAMA3_8B_LORA, "link_gbit": 400}, parallelism="fsdp", mixed_precision="bf16")
    assert "at 400 Gbit/s" in tm.job_memory(fast, hostvars, groups)["line"]
    assert tm.training_memory_status(fsdp, hostvars, groups, None)[1].startswith("link: fsdp over 2 nodes")
    # A veth's nominal speed is no wire's; one node has no link; no one-node step, no verdict.
    hostvars["node2"]["ansible_facts"]["budgetgpu_net"]["cluster_interface"]["kind"] = "veth"
    assert tm.job_memory(fsdp, hostvars, groups)["link"] is None
    assert tm.job_memory(fsdp, *cluster(gpus()))["link"] is None
    no_step = {k: v for k, v in LLAMA3_8B_LORA.items() if k != "one_node_step_s"}
    assert tm.job_memory(job(model={**no_step, "link_gbit": 10}, parallelism="fsdp"), hostvars, groups)["link"] is None
    bad = tm.job_memory(job(model={**LLAMA3_8B_LORA, "link_gbit": "fast"}), hostvars, groups)["problems"]
    assert [p["field"] for p in bad] == ["model.link_gbit"]
