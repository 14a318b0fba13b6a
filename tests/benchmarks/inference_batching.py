"""Batching across requests in the built-in inference worker (issue 29, item 5): req/s and p50
latency at concurrency 1, 4 and 16, batching on and off, interleaved in one run.

    .venv/bin/python tests/benchmarks/inference_batching.py [--repeats 5] [--task embeddings|generation|both]
                                                            [--window-ms 2] [--json FILE]

It builds two models with random weights in a temporary folder (nothing is downloaded): a BERT of
hidden 256 and 4 layers with a WordPiece tokenizer trained here (embeddings), and a GPT-2 of the
same size with the tiny GPT-2's tokenizer (tests/fixtures/tiny_lm.py) and its end token as pad
token (generation). It loads each through the worker's own load_engine and sends requests through
the worker's whole ASGI app in-process (admission, the batcher, the thread pool; no sockets), C
clients at a time, each sending its next request when its answer comes. The worker runs as the
role runs it by default: concurrency 1, so a request runs alone unless batched; the queue is large
enough for 16. Every repeat runs each concurrency with batching on and off, in alternating order
(on, off, then off, on), so that drift of a noisy machine falls on both. It prints the median and
range over the repeats of each cell, and of the on/off ratios of each repeat (the two ran one after
the other): on a 2-core machine the absolute figures move run to run; the ratios hold.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "roles" / "inference" / "files" / "inference_worker.py"
TINY_LM = ROOT / "tests" / "fixtures" / "tiny_lm.py"
CONCURRENCY = (1, 4, 16)
TEXT = (
    "the cluster runs one worker per gpu behind a gateway while another node trains a model and "
    "tokens stream back to every client as they are generated cheap hardware is fine when the "
    "software is careful about memory queues timeouts retries health checks and batching of requests"
)
SEED = 29


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def sentences(count: int, words: tuple[int, int], seed: int) -> list[str]:
    rng, vocabulary = random.Random(seed), TEXT.split()
    return [" ".join(rng.choice(vocabulary) for _word in range(rng.randint(*words))) for _sentence in range(count)]


def build_bert(directory: Path) -> Path:
    """A BERT of hidden 256, 4 layers, 4 heads, random weights, and a WordPiece tokenizer."""
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    raw = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    raw.normalizer = normalizers.BertNormalizer(lowercase=True)
    raw.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    raw.train_from_iterator(
        sentences(200, (5, 30), SEED), trainers.WordPieceTrainer(vocab_size=400, special_tokens=specials)
    )
    cls, sep = raw.token_to_id("[CLS]"), raw.token_to_id("[SEP]")
    raw.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )
    config = BertConfig(
        vocab_size=len(tokenizer), hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=1024, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(SEED)
    BertModel(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def build_gpt2(directory: Path) -> Path:
    """A GPT-2 of hidden 256, 4 layers, random weights, the tiny GPT-2's tokenizer with a pad token."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = _load("tiny_lm", TINY_LM).build_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    eos = tokenizer.eos_token_id
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=256, n_embd=256, n_layer=4, n_head=4, bos_token_id=eos, eos_token_id=eos
    )
    torch.manual_seed(SEED)
    GPT2LMHeadModel(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


class Task:
    """One task's model, requests and worker config."""

    def __init__(self, w, name: str, model_dir: Path, requests: int) -> None:
        self.w, self.name, self.requests = w, name, requests
        generation = name == "generation"
        # What the role writes by default (concurrency 1, max_input_tokens 2048 but the model's 256
        # or 512 positions, max_new_tokens 256): kv_tokens is one slot's context.
        raw = {
            "name": name, "model_dir": str(model_dir), "task": name, "concurrency": 1, "queue": 32,
            "timeout_s": 300, "max_input_tokens": 2048, "max_new_tokens": 256, "kv_tokens": 2048 + 256,
        }  # fmt: skip
        self.config = w.parse_config(raw)
        self.engine = w.load_engine(self.config)
        self.path = "/v1/completions" if generation else "/v1/embeddings"
        if generation:
            self.bodies = [{"prompt": p, "max_tokens": 16, "temperature": 0} for p in sentences(64, (3, 12), SEED + 1)]
        else:
            self.bodies = [{"input": s} for s in sentences(64, (20, 40), SEED + 2)]

    def app(self, window_ms: float):
        from dataclasses import replace

        config = replace(self.config, batch_window_ms=window_ms)
        engine = self.w.Engine(config, self.engine.tokenizer, self.engine.model, self.engine.device)
        return self.w.build_app(config, "bench-0", engine)


async def run_cell(task: Task, window_ms: float, concurrency: int) -> dict[str, float]:
    """task.requests requests, `concurrency` clients at a time; req/s and p50 latency."""
    import httpx

    app = task.app(window_ms)
    latencies: list[float] = []
    sent = iter(range(task.requests))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://worker", timeout=300) as client:

        async def one_client() -> None:
            for n in sent:
                start = time.perf_counter()
                r = await client.post(task.path, json=task.bodies[n % len(task.bodies)])
                latencies.append(time.perf_counter() - start)
                if r.status_code != 200:
                    raise RuntimeError(f"{task.path}: {r.status_code} {r.text[:200]}")

        for body in task.bodies[:2]:  # this app's first requests (thread pool, allocator) untimed
            await client.post(task.path, json=body)
        start = time.perf_counter()
        await asyncio.gather(*(one_client() for _client in range(concurrency)))
        wall = time.perf_counter() - start
    app.state.executor.shutdown(wait=True)
    if app.state.batcher is not None:
        app.state.batcher.close()
    return {"rps": len(latencies) / wall, "p50_ms": statistics.median(latencies) * 1000}


async def run_task(task: Task, repeats: int, window_ms: float) -> dict:
    """Every cell once per repeat, on and off in alternating order: {(c, mode): [results]}."""
    cells: dict[tuple[int, str], list[dict[str, float]]] = {}
    for repeat in range(repeats):
        modes = ("on", "off") if repeat % 2 == 0 else ("off", "on")
        for concurrency in CONCURRENCY:
            for mode in modes:
                result = await run_cell(task, window_ms if mode == "on" else 0, concurrency)
                cells.setdefault((concurrency, mode), []).append(result)
                print(
                    f"  {task.name} repeat {repeat + 1}/{repeats} c={concurrency:<2} batching {mode:<3}: "
                    f"{result['rps']:7.1f} req/s, p50 {result['p50_ms']:7.1f} ms",
                    file=sys.stderr,
                    flush=True,
                )
    return cells


def _spread(values: list[float], digits: int) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def _paired(cells: dict, concurrency: int, key: str) -> list[float]:
    """On/off of each repeat: the two ran one after the other, so the machine's drift cancels."""
    on, off = cells[(concurrency, "on")], cells[(concurrency, "off")]
    return [a[key] / b[key] for a, b in zip(on, off, strict=True)]


def table(name: str, cells: dict) -> list[str]:
    """Markdown rows: per concurrency, req/s and p50 on and off, and the on/off ratios of each
    repeat, as median (range)."""
    lines = [
        f"{name}: median (range) over {len(cells[(1, 'on')])} repeats",
        "",
        "| concurrency | req/s on | req/s off | req/s on/off | p50 on (ms) | p50 off (ms) | p50 on/off |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in CONCURRENCY:
        on, off = cells[(c, "on")], cells[(c, "off")]
        lines.append(
            f"| {c} | {_spread([r['rps'] for r in on], 1)} | {_spread([r['rps'] for r in off], 1)} | "
            f"**{_spread(_paired(cells, c, 'rps'), 2)}** | {_spread([r['p50_ms'] for r in on], 1)} | "
            f"{_spread([r['p50_ms'] for r in off], 1)} | **{_spread(_paired(cells, c, 'p50_ms'), 2)}** |"
        )
    return lines


def verdict(cells: dict) -> list[str]:
    rps16 = statistics.median(_paired(cells, 16, "rps"))
    p50 = statistics.median(_paired(cells, 1, "p50_ms"))
    return [
        f"req/s at concurrency 16, on/off: {rps16:.2f}x (goal >= 2x): {'met' if rps16 >= 2 else 'NOT met'}",
        f"p50 at concurrency 1, on/off: {p50:.3f} (goal <= 1.10): {'met' if p50 <= 1.10 else 'NOT met'}",
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--task", choices=("embeddings", "generation", "both"), default="both")
    parser.add_argument("--window-ms", type=float, default=2.0, help="batch_window_ms with batching on")
    parser.add_argument("--embedding-requests", type=int, default=96, help="requests per embeddings cell")
    parser.add_argument("--generation-requests", type=int, default=32, help="requests per generation cell")
    parser.add_argument("--json", help="also write the raw figures here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    w = _load("inference_worker", WORKER)
    names = ("embeddings", "generation") if args.task == "both" else (args.task,)
    counts = {"embeddings": args.embedding_requests, "generation": args.generation_requests}
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, window {args.window_ms:g} ms", file=sys.stderr
    )
    raw, report = {}, []
    with tempfile.TemporaryDirectory(prefix="bench-batching-") as tmp:
        for name in names:
            build = build_bert if name == "embeddings" else build_gpt2
            task = Task(w, name, build(Path(tmp) / name), counts[name])
            cells = asyncio.run(run_task(task, args.repeats, args.window_ms))
            raw[name] = {f"c{c}-{mode}": results for (c, mode), results in cells.items()}
            report += [*table(f"{name} ({task.requests} requests per cell)", cells), "", *verdict(cells), ""]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"started {started}, ended {time.strftime('%H:%M:%S')}, load average at the end {load}")
    print("\n".join(report))
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
