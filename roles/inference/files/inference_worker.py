#!/usr/bin/env python3
"""budgetgpu's built-in inference worker: one process per GPU (or per gpus_per_worker GPUs) with an
OpenAI-compatible API.

    python inference_worker.py --config FILE.json --port N --host ADDR --worker-id ID

The config (JSON) holds name, model_dir, task (embeddings | generation), dtype, quantization,
max_new_tokens, max_input_tokens, concurrency, queue, timeout_s, max_body_bytes and the batching
across requests: batch_window_ms (0: off), batch_max and kv_tokens (Batcher). The model loads once, from
the local directory only, onto cuda:0 (the unit pins the GPU with CUDA_VISIBLE_DEVICES), split in
layer order over every GPU the unit gives it (device_map, through accelerate), or onto the CPU on a
simulated node. At most `concurrency` requests run and `queue` wait; beyond that a
request gets 503 with Retry-After at once. A request past timeout_s gets 504 and its work stops.

Inputs are bounded before they cost anything: the body per endpoint (max_body_bytes, 413 before
parsing), the number of embedding inputs (OpenAI's 2048), the number and length of stop strings,
chat roles and content parts, text that is not Unicode (a lone surrogate); the tokenizer runs only
after admission, in the model's thread pool (a batched generation's prompt: in the batcher's
tokenizer thread), never on the event loop that answers /health. Every
refusal is an OpenAI error object naming the limit.

Concurrent requests share passes of the model (batch_window_ms > 0): embedding inputs of several
requests go through one tokenizer call and one forward pass, and whole (not streamed) generation
requests with the same sampling settings, to a model with a pad token, through one left-padded
generate, as many as the KV cache that preflight counted holds (kv_tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import logging
import os
import struct
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

# No hub access at run time: the model directory was copied from the control node.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from fastapi import FastAPI, Request  # noqa: E402  (the environment above must come first)
from fastapi.exceptions import RequestValidationError  # noqa: E402
from fastapi.responses import JSONResponse, Response, StreamingResponse  # noqa: E402
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest  # noqa: E402
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # noqa: E402
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

# No `_created` series: the dashboard and alert rules use none, and each doubles a counter's lines.
disable_created_metrics()

LOG = logging.getLogger("budgetgpu.inference_worker")
METRICS = "budgetgpu_inference"
TASKS = ("embeddings", "generation")
DTYPES = ("float32", "float16", "bfloat16")
QUANTIZATIONS = ("none", "8bit", "4bit")
# Inputs (embeddings) or sequences (generation) per pass of the model, where the config gives none:
# activations grow with it times the longest input.
BATCH_MAX = 32
# OpenAI's limits: embedding inputs per request, stop strings per request; and how long a stop
# string may be (stop strings are matched at every generated token).
MAX_EMBEDDING_INPUTS = 2048
MAX_STOP = 4
MAX_STOP_CHARS = 64
# Chat roles the templates know ("developer" is OpenAI's newer name for "system").
CHAT_ROLES = ("system", "developer", "user", "assistant")
# The body limit where the config gives none (the role always writes max_body_bytes).
DEFAULT_BODY_BYTES = 8 * 2**20
ENDPOINTS = (
    "/v1/models",
    "/v1/embeddings",
    "/v1/completions",
    "/v1/chat/completions",
    "/health",
    "/metrics",
)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# How long a pass may wait for more requests after a pass that served several (Batcher), by default.
BATCH_WINDOW_MS = 2.0
MAX_BATCH_WINDOW_MS = 1000.0


class ConfigError(Exception):
    """The config file or the node cannot run this worker (exit code 2)."""


class WorkCancelled(Exception):
    """The request's work stopped because it ran past its deadline or its client left."""


class ApiError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self, status: int, message: str, kind: str, code: str | None = None, headers=None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


# ---------------------------------------------------------------- configuration


@dataclass(frozen=True)
class WorkerConfig:
    name: str
    model_dir: str
    task: str
    dtype: str = "float16"
    quantization: str = "none"
    max_new_tokens: int = 256
    max_input_tokens: int = 2048
    concurrency: int = 1
    queue: int = 8
    timeout_s: float = 120.0
    # Largest request body in bytes per path ("other": every other path); the role writes the
    # figures of plugins/plugin_utils/inference/gateway.py inference_body_limits, which NGINX enforces too.
    max_body_bytes: dict[str, int] = field(default_factory=dict)
    # Batching across requests (Batcher): 0 ms turns it off; batch_max bounds the inputs or sequences
    # of one pass; kv_tokens is the KV cache preflight counted for each of the `concurrency` slots
    # (plugins/plugin_utils/inference/memory.py inference_context_tokens), which bounds a batched generate:
    # 0 (not given) batches no generation.
    batch_window_ms: float = BATCH_WINDOW_MS
    batch_max: int = BATCH_MAX
    kv_tokens: int = 0

    def body_limit(self, path: str) -> int:
        return int(self.max_body_bytes.get(path) or self.max_body_bytes.get("other") or DEFAULT_BODY_BYTES)


_MINIMUMS = {"max_new_tokens": 1, "max_input_tokens": 1, "concurrency": 1, "queue": 0, "batch_max": 1, "kv_tokens": 0}
_CHOICES = {"task": TASKS, "dtype": DTYPES, "quantization": QUANTIZATIONS}


def load_config(path: str) -> WorkerConfig:
    """The worker's config from a JSON file; ConfigError names the file and the field."""
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config {path} is not JSON: {exc}") from None
    return parse_config(raw, path)


def parse_config(raw: Any, source: str = "config") -> WorkerConfig:
    """Check every field; keys the worker does not use (a role may write more) are ignored."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object, found {type(raw).__name__}")
    for key in ("name", "model_dir", "task"):
        if not isinstance(raw.get(key), str) or not raw[key]:
            raise ConfigError(f"{source}: {key} is missing or not a string")
    for key, choices in _CHOICES.items():
        if key in raw and raw[key] not in choices:
            raise ConfigError(f"{source}: {key} is {raw[key]!r}, expected one of {', '.join(choices)}")
    for key, least in _MINIMUMS.items():
        value = raw.get(key, least)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"{source}: {key} is {value!r}, expected an integer >= {least}")
    timeout = raw.get("timeout_s", 120)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
        raise ConfigError(f"{source}: timeout_s is {timeout!r}, expected a number of seconds > 0")
    window = raw.get("batch_window_ms", BATCH_WINDOW_MS)
    if isinstance(window, bool) or not isinstance(window, int | float) or not 0 <= window <= MAX_BATCH_WINDOW_MS:
        raise ConfigError(
            f"{source}: batch_window_ms is {window!r}, expected milliseconds from 0 (no batching) "
            f"to {MAX_BATCH_WINDOW_MS:g}"
        )
    limits = raw.get("max_body_bytes", {})
    if not isinstance(limits, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in limits.values()
    ):
        raise ConfigError(f"{source}: max_body_bytes is {limits!r}, expected a mapping path -> bytes > 0")
    model_dir = Path(raw["model_dir"])
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"{source}: model_dir {model_dir} has no config.json: copy the model directory there")
    known = {k: raw[k] for k in WorkerConfig.__dataclass_fields__ if k in raw}
    return WorkerConfig(**{**known, "timeout_s": float(timeout), "batch_window_ms": float(window)})


def check_device(config: WorkerConfig, cuda: bool) -> None:
    """8bit/4bit run through bitsandbytes on CUDA only: refuse them on a CPU node."""
    if config.quantization != "none" and not cuda:
        raise ConfigError(
            f"{config.name}: quantization {config.quantization} needs a CUDA GPU (bitsandbytes) "
            "and this node has none: set quantization: none"
        )


def placement(config: WorkerConfig, gpus: int) -> dict[str, Any]:
    """from_pretrained's placement for the GPUs the unit gives the worker (CUDA_VISIBLE_DEVICES): none
    on the CPU (moved after the load), one GPU (quantised weights load onto it), or the model split over
    all of them in layer order (device_map, which needs accelerate: gpus_per_worker 2 or 4)."""
    if gpus > 1:
        try:
            import accelerate  # noqa: F401  (transformers imports it for device_map)
        except ImportError:
            raise ConfigError(
                f"{config.name}: the unit gives this worker {gpus} GPUs and the venv has no accelerate, which "
                "splitting a model needs: run playbooks/inference.yml (it installs requirements-split.txt)"
            ) from None
        return {"device_map": "auto"}
    if config.quantization != "none":
        return {"device_map": {"": 0}}
    return {}


# ---------------------------------------------------------------- the model


@dataclass
class GenerationParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)

    def sampling(self) -> tuple[float, ...]:
        """What must be equal for requests to share one generate call: greedy, or the same settings."""
        return (0.0,) if self.temperature <= 0 else (self.temperature, self.top_p)

    def generate_kwargs(self) -> dict[str, Any]:
        if self.temperature > 0:
            return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p}
        return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}


@dataclass
class GenerationRow:
    """A tokenised generation request waiting to share a generate call (GenerationBatcher)."""

    ids: list[int]
    params: GenerationParams


@dataclass
class GenerationResult:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    seconds: float


class Cancel:
    """A request's stop signal, read by the generation loop between tokens: set, or past the deadline."""

    def __init__(self, deadline: float) -> None:
        self.event = threading.Event()
        self.deadline = deadline

    def set(self) -> None:
        self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set() or time.monotonic() >= self.deadline

    def remaining(self) -> float:
        return max(self.deadline - time.monotonic(), 0.0)


def _stopping_criteria(cancel: Cancel):
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class CancelCriteria(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), cancel.is_set(), dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([CancelCriteria()])


def _row_stops(tokenizer, width: int, rows: list[tuple[GenerationParams, Cancel]], eos: set[int]):
    """Stopping criteria for each row of a batched generate on its own: its max_new_tokens, its stop
    strings, an end token, its cancel signal. `done_at[i]` is how many new tokens row i kept."""
    import torch
    from transformers import StoppingCriteria

    class RowStops(StoppingCriteria):
        done_at = [0] * len(rows)

        def __call__(self, input_ids, scores, **kwargs):
            new = input_ids.shape[1] - width
            for i, (params, cancel) in enumerate(rows):
                if not self.done_at[i] and (
                    new >= params.max_new_tokens
                    or cancel.is_set()
                    or int(input_ids[i, -1]) in eos
                    or _has_stop(tokenizer, input_ids[i, width:], params.stop)
                ):
                    self.done_at[i] = new
            return torch.tensor([bool(done) for done in self.done_at], device=input_ids.device)

    return RowStops()


def _has_stop(tokenizer, new_ids, stop: list[str]) -> bool:
    # The text decoded whole each step: a stop string may span tokens (a row has at most 4, of 64
    # characters, and max_new_tokens steps).
    if not stop:
        return False
    text = tokenizer.decode(new_ids.tolist(), skip_special_tokens=True)
    return any(s in text for s in stop)


class Engine:
    """A loaded tokenizer and model on one device; the blocking calls run in worker threads."""

    def __init__(self, config: WorkerConfig, tokenizer, model, device: str) -> None:
        self.config, self.tokenizer, self.model, self.device = config, tokenizer, model, device
        self.load_seconds = 0.0
        self.memory_bytes = 0

    @property
    def positions(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    def input_limit(self) -> tuple[int, str]:
        """The most input tokens a request may send, and where that limit comes from."""
        limit, source = self.config.max_input_tokens, "max_input_tokens"
        room = self.positions if self.config.task == "embeddings" else (self.positions or 0) - 1
        if self.positions and room < limit:
            limit, source = room, f"the model's {self.positions} positions"
        return limit, source

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text)["input_ids"])

    def count_tokens_each(self, texts: list[str]) -> list[int]:
        return [len(ids) for ids in self.tokenizer(texts)["input_ids"]]

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=self.config.task == "embeddings")["input_ids"])

    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def embed(self, texts: list[str], cancel: Cancel) -> tuple[list[list[float]], int]:
        """One request's vectors, batch_max inputs per forward pass (batching across requests off)."""
        vectors: list[list[float]] = []
        tokens = 0
        limit, size = self.input_limit()[0], self.config.batch_max
        for start in range(0, len(texts), size):
            if cancel.is_set():
                raise WorkCancelled("embedding stopped")
            batch = self.tokenizer(
                texts[start : start + size], padding=True, truncation=True, max_length=limit, return_tensors="pt"
            )
            vectors += self._vectors(batch)
            tokens += int(batch["attention_mask"].sum())
        return vectors, tokens

    def embed_groups(self, groups: list[tuple[int, list[str]]]) -> list[tuple[list[list[float]], int] | Exception]:
        """The inputs of several requests in one tokenizer call and one forward pass. Each group (a
        request's inputs from its index `start` on) gets its own vectors and token count, or its
        own refusal: an input too long fails its request only."""
        encoded = self.tokenizer([text for _start, texts in groups for text in texts])
        lengths = [len(ids) for ids in encoded["input_ids"]]
        outcomes: list[Any] = []
        kept: list[int] = []
        first = 0
        for start, texts in groups:
            rows = range(first, first + len(texts))
            first += len(texts)
            try:
                for i, row in enumerate(rows):
                    _too_long(self, lengths[row], f"input {start + i}")
            except ApiError as exc:
                outcomes.append(exc)
                continue
            outcomes.append(rows)
            kept += rows
        # Padded to the longest kept input only: a refused input costs the others nothing.
        kept_rows = {key: [values[r] for r in kept] for key, values in encoded.items()}
        vectors = self._vectors(self.tokenizer.pad(kept_rows, return_tensors="pt")) if kept else []
        where = {row: n for n, row in enumerate(kept)}
        return [
            o if isinstance(o, Exception) else ([vectors[where[r]] for r in o], sum(lengths[r] for r in o))
            for o in outcomes
        ]

    def _vectors(self, batch) -> list[list[float]]:
        """Mean-pooled, L2-normalised sentence vectors (the sentence-transformers recipe)."""
        import torch

        batch = batch.to(self.device)
        with torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled.float(), p=2, dim=1).cpu().tolist()

    def generate(self, ids: list[int], params: GenerationParams, cancel: Cancel, streamer=None) -> GenerationResult:
        """Run generate() until max_new_tokens, an end token, a stop string or the cancel signal."""
        import torch

        start = time.monotonic()
        inputs = torch.tensor([ids], device=self.device)
        kwargs: dict[str, Any] = {
            "attention_mask": torch.ones_like(inputs),
            "max_new_tokens": params.max_new_tokens,
            "stopping_criteria": _stopping_criteria(cancel),
            "pad_token_id": self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
            "streamer": streamer,
            **params.generate_kwargs(),
        }
        if params.stop:
            kwargs.update(stop_strings=params.stop, tokenizer=self.tokenizer)
        with torch.inference_mode():
            output = self.model.generate(inputs, **kwargs)
        if cancel.is_set():
            raise WorkCancelled("generation stopped")
        return self._result(output[0, len(ids) :].tolist(), len(ids), params, time.monotonic() - start)

    def generate_batch(self, rows: list[GenerationRow], cancels: list[Cancel]) -> list[GenerationResult | Exception]:
        """Several requests in one generate call, left-padded with the pad token (so that every row's
        new tokens start together); each row stops on its own and gets its own new tokens only."""
        import torch
        from transformers import StoppingCriteriaList

        start = time.monotonic()
        width = max(len(row.ids) for row in rows)
        pad = self.tokenizer.pad_token_id
        inputs = torch.tensor([[pad] * (width - len(row.ids)) + row.ids for row in rows], device=self.device)
        mask = torch.tensor([[0] * (width - len(row.ids)) + [1] * len(row.ids) for row in rows], device=self.device)
        stops = _row_stops(
            self.tokenizer, width, [(row.params, c) for row, c in zip(rows, cancels, strict=True)], self.eos_ids()
        )
        with torch.inference_mode():
            output = self.model.generate(
                inputs,
                attention_mask=mask,
                max_new_tokens=max(row.params.max_new_tokens for row in rows),
                stopping_criteria=StoppingCriteriaList([stops]),
                pad_token_id=pad,
                **rows[0].params.generate_kwargs(),
            )
        seconds = time.monotonic() - start
        results: list[GenerationResult | Exception] = []
        for i, (row, cancel) in enumerate(zip(rows, cancels, strict=True)):
            new = output[i, width:].tolist()[: stops.done_at[i] or None]
            results.append(
                WorkCancelled("generation stopped")
                if cancel.is_set()
                else self._result(new, len(row.ids), row.params, seconds)
            )
        return results

    def eos_ids(self) -> set[int]:
        found = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        ids = set(found if isinstance(found, list) else [found]) | {self.tokenizer.eos_token_id}
        return {i for i in ids if i is not None}

    def _result(self, new: list[int], prompt: int, params: GenerationParams, seconds: float) -> GenerationResult:
        """The answer from a row's new tokens: cut before the first stop string, and why it ended."""
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        finish = "length" if len(new) >= params.max_new_tokens else "stop"
        for stop in params.stop:
            if stop in text:
                text, finish = text[: text.index(stop)], "stop"
        return GenerationResult(text, prompt, len(new), finish, seconds)


def _torch_dtype(config: WorkerConfig, device: str):
    import torch

    if device == "cpu":
        return torch.float32
    return getattr(torch, config.dtype)


def _quantization_config(config: WorkerConfig, dtype):
    from transformers import BitsAndBytesConfig

    if config.quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_type="nf4")


def load_engine(config: WorkerConfig) -> Engine:
    """Load the tokenizer and model once, from the local directory only, and say what it cost."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line in the journal, not a progress bar per load
    start = time.monotonic()
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    check_device(config, device != "cpu")
    dtype = _torch_dtype(config, device)
    where = placement(config, torch.cuda.device_count() if device != "cpu" else 0)
    kwargs: dict[str, Any] = {"dtype": dtype, "local_files_only": True, **where}
    if config.quantization != "none":
        kwargs["quantization_config"] = _quantization_config(config, dtype)
    tokenizer = AutoTokenizer.from_pretrained(config.model_dir, local_files_only=True)
    model_class = AutoModel if config.task == "embeddings" else AutoModelForCausalLM
    model = model_class.from_pretrained(config.model_dir, **kwargs)
    if not where:
        model = model.to(device)
    model.eval()
    engine = Engine(config, tokenizer, model, device)
    _warm_up(engine)
    engine.load_seconds = time.monotonic() - start
    LOG.info(_load_line(engine, dtype))
    return engine


def _warm_up(engine: Engine) -> None:
    """One small pass at load, so that the first request does not pay for lazy initialisation."""
    cancel = Cancel(time.monotonic() + 300)
    if engine.config.task == "embeddings":
        engine.embed(["warm up"], cancel)
    else:
        ids = engine.encode("warm up") or [engine.tokenizer.eos_token_id or 0]
        engine.generate(ids, GenerationParams(max_new_tokens=1, temperature=0.0), cancel)


def _load_line(engine: Engine, dtype) -> str:
    import torch

    config = engine.config
    what = f"{config.name}: loaded {config.task} model {config.model_dir} in {engine.load_seconds:.2f} s"
    if engine.device == "cpu":
        engine.memory_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        note = "" if config.dtype == "float32" else f" (asked {config.dtype}: CPU runs float32)"
        return f"{what} on CPU, {engine.memory_bytes / 2**20:.1f} MiB of parameters, float32{note}"
    gpus = torch.cuda.device_count()
    engine.memory_bytes = sum(torch.cuda.memory_allocated(i) for i in range(gpus))
    quant = "" if config.quantization == "none" else f", {config.quantization} quantised"
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(gpus))
    devices = "cuda:0" if gpus == 1 else f"cuda:0-{gpus - 1}"
    allocated = f"{engine.memory_bytes / 2**20:.1f} MiB of GPU memory allocated"
    return f"{what} on {devices} ({names}), {allocated}, {dtype}{quant}"


# ---------------------------------------------------------------- admission and metrics


class Admission:
    """At most `concurrency` requests run and `queue` wait; a slot frees when its work really ends."""

    def __init__(self, concurrency: int, queue: int) -> None:
        self.concurrency, self.queue = concurrency, queue
        self.running = 0
        self.waiting = 0
        self._slots: asyncio.Semaphore | None = None

    def _semaphore(self) -> asyncio.Semaphore:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.concurrency)
        return self._slots

    def admit(self) -> bool:
        if self.running + self.waiting >= self.concurrency + self.queue:
            return False
        self.waiting += 1
        return True

    async def acquire(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._semaphore().acquire(), timeout)
        finally:
            self.waiting -= 1
        self.running += 1

    def release(self) -> None:
        self.running -= 1
        self._semaphore().release()

    # A batched request holds no slot of its own: each pass of the model holds one (Batcher).
    async def slot(self) -> None:
        await self._semaphore().acquire()

    def free_slot(self) -> None:
        self._semaphore().release()

    def begin(self) -> None:
        """An admitted request's work begins: a pass of the model took it."""
        self.waiting -= 1
        self.running += 1

    def leave(self, began: bool) -> None:
        if began:
            self.running -= 1
        else:
            self.waiting -= 1


class Metrics:
    """The worker's series, written by prometheus_client: requests and their latency counted as
    they end, the rest read from the worker's state at each scrape (StateCollector)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            f"{METRICS}_requests", "Requests answered, by endpoint and HTTP status.", ["endpoint", "status"],
            registry=self.registry,
        )  # fmt: skip
        self.latency = Histogram(
            f"{METRICS}_request_duration_seconds", "Time from request to the end of the answer.", ["endpoint"],
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.batch_size = Histogram(
            f"{METRICS}_batch_size", "Requests served together by one pass of the model (batch_window_ms > 0).",
            buckets=BATCH_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.generation_seconds = 0.0
        self.tokens_per_second = 0.0
        self.rejected = 0
        self.timeouts = 0

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)

    def observe_generation(self, result: GenerationResult) -> None:
        self.generated_tokens += result.completion_tokens
        self.prompt_tokens += result.prompt_tokens
        self.generation_seconds += result.seconds
        if result.seconds > 0:
            self.tokens_per_second = result.completion_tokens / result.seconds

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StateCollector:
    """The series of a worker's state: its queue, its model, its token counts."""

    def __init__(self, worker: WorkerState) -> None:
        self.worker = worker

    def collect(self):
        worker, metrics, engine = self.worker, self.worker.metrics, self.worker.engine
        gauges = (
            ("queue_depth", "Requests waiting for a slot.", worker.admission.waiting),
            ("in_flight", "Requests whose model work is running.", worker.admission.running),
            ("tokens_per_second", "Generation speed of the last finished request.", metrics.tokens_per_second),
            ("model_loaded", "1 once the model is loaded.", int(engine is not None)),
            ("model_load_seconds", "How long loading the model took.", getattr(engine, "load_seconds", 0)),
            ("model_memory_bytes", "GPU memory allocated (CPU: parameter bytes).", getattr(engine, "memory_bytes", 0)),
        )
        counters = (
            ("rejected", "Requests refused with 503 because the queue was full.", metrics.rejected),
            ("timeouts", "Requests cancelled past timeout_s.", metrics.timeouts),
            ("generated_tokens", "Tokens generated.", metrics.generated_tokens),
            ("prompt_tokens", "Prompt tokens of generation requests.", metrics.prompt_tokens),
            ("generation_seconds", "Seconds spent generating.", metrics.generation_seconds),
        )
        for name, text, value in gauges:
            yield GaugeMetricFamily(f"{METRICS}_{name}", text, value=value)
        for name, text, value in counters:
            yield CounterMetricFamily(f"{METRICS}_{name}", text, value=value)


# ---------------------------------------------------------------- batching across requests


@dataclass(eq=False)
class Job:
    """An admitted request's items (embedding inputs, or one GenerationRow) and their results."""

    items: list
    cancel: Cancel
    future: asyncio.Future
    results: list = field(default_factory=list)
    tokens: int = 0
    taken: int = 0  # items handed to passes
    done: int = 0  # items with a result
    began: bool = False  # a pass took some of it (Admission.begin)
    left: bool = False  # answered, failed or dropped (Admission.leave)


@dataclass
class Part:
    """The items of one job that one pass runs, from index `start` of the job's items."""

    job: Job
    start: int
    items: list


def _retrieve(future: asyncio.Future) -> None:
    # A request that timed out no longer awaits its future: retrieved here so it does not warn.
    if not future.cancelled():
        future.exception()


class Batcher:
    """Gathers the work of concurrent requests into shared passes of the model. A pass starts as
    soon as one of the worker's `concurrency` slots is free, so a lone request waits for nothing;
    requests that come while every slot is busy queue, and the next pass takes them together (up
    to batch_max items). After a pass that served several requests, the next also waits, until
    batch_window_ms after that pass ended or until as many requests queue, for those requests'
    clients to send their next: otherwise clients in a loop split into a big and a small pass."""

    def __init__(self, state: WorkerState) -> None:
        self.state = state
        self.max_items = state.config.batch_max
        self.window = state.config.batch_window_ms / 1000
        self.jobs: deque[Job] = deque()
        self.driver: asyncio.Task | None = None
        self.arrived: asyncio.Event | None = None
        self.last_served, self.ended_at = 0, 0.0

    def submit(self, items: list, cancel: Cancel) -> asyncio.Future:
        """Queue an admitted request's items; the future gets (their results in order, tokens)."""
        loop = asyncio.get_running_loop()
        job = Job(items, cancel, loop.create_future(), [None] * len(items))
        job.future.add_done_callback(_retrieve)
        self.jobs.append(job)
        self._arrival().set()
        if self.driver is None:
            self.driver = loop.create_task(self._drive())
        return job.future

    def take(self) -> list[Part]:
        """The parts of the next pass, removed from the queue (each kind of batcher its own way)."""
        raise NotImplementedError

    def run(self, parts: list[Part]) -> list[Any]:
        """The pass, in the model's thread pool: per part (its results, tokens) or an exception."""
        raise NotImplementedError

    def close(self) -> None:
        """Nothing to release here; GenerationBatcher has its tokenizer's thread."""

    def _arrival(self) -> asyncio.Event:
        if self.arrived is None:
            self.arrived = asyncio.Event()
        return self.arrived

    async def _drive(self) -> None:
        admission = self.state.admission
        try:
            while self.jobs:
                await admission.slot()
                parts = await self._gather()
                if parts:
                    self._start(parts)
                else:
                    admission.free_slot()
        finally:
            self.driver = None

    async def _gather(self) -> list[Part]:
        want, self.last_served = self.last_served, 0
        deadline = self.ended_at + self.window
        while want > 1 and len(self.jobs) < want and self._queued() < self.max_items:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._arrival().clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrival().wait(), left)
        return self.take()

    def _queued(self) -> int:
        return sum(len(job.items) - job.taken for job in self.jobs)

    def _start(self, parts: list[Part]) -> None:
        jobs = list(dict.fromkeys(part.job for part in parts))
        for job in jobs:
            if not job.began:
                job.began = True
                self.state.admission.begin()
        self.state.metrics.batch_size.observe(len(jobs))
        try:
            future = asyncio.get_running_loop().run_in_executor(self.state.executor, self.run, parts)
        except RuntimeError as exc:  # the executor is shut down: the server is stopping
            self._settled(parts, len(jobs), [exc] * len(parts))
            return
        future.add_done_callback(lambda done: self._settled(parts, len(jobs), _outcomes(done, len(parts))))

    def _settled(self, parts: list[Part], served: int, outcomes: list[Any]) -> None:
        self.last_served, self.ended_at = served, time.monotonic()
        self.state.admission.free_slot()
        for part, outcome in zip(parts, outcomes, strict=True):
            job = part.job
            if job.left:
                continue
            if isinstance(outcome, BaseException):
                self._end(job, outcome)
                continue
            values, tokens = outcome
            job.results[part.start : part.start + len(values)] = values
            job.tokens += tokens
            job.done += len(values)
            if job.done == len(job.items):
                self._end(job, (job.results, job.tokens))

    def _end(self, job: Job, outcome: Any) -> None:
        """Answer a job once (results or an exception) and give its admission back."""
        if job.left:
            return
        job.left = True
        self.state.admission.leave(job.began)
        if job.future.done():
            return
        if isinstance(outcome, BaseException):
            job.future.set_exception(outcome)
        else:
            job.future.set_result(outcome)

    def _stopped(self, job: Job) -> bool:
        """A job whose request left (past its deadline, or failed): dropped, never run."""
        if job.left or job.cancel.is_set():
            self._end(job, WorkCancelled("stopped before its pass"))
            return True
        return False


def _outcomes(future: asyncio.Future, parts: int) -> list[Any]:
    if future.cancelled():
        return [WorkCancelled("the worker is stopping")] * parts
    if future.exception() is not None:
        return [future.exception()] * parts
    return future.result()


class EmbeddingBatcher(Batcher):
    """Embedding inputs of several requests in one forward pass; a request of more than batch_max
    inputs spreads over passes in order, and shares its last one with the requests behind it."""

    def take(self) -> list[Part]:
        parts: list[Part] = []
        room = self.max_items
        while self.jobs and room:
            job = self.jobs[0]
            if self._stopped(job):
                self.jobs.popleft()
                continue
            count = min(room, len(job.items) - job.taken)
            parts.append(Part(job, job.taken, job.items[job.taken : job.taken + count]))
            job.taken += count
            room -= count
            if job.taken == len(job.items):
                self.jobs.popleft()
        return parts

    def run(self, parts: list[Part]) -> list[Any]:
        return self.state.engine.embed_groups([(part.start, part.items) for part in parts])


class GenerationBatcher(Batcher):
    """Whole generation requests with the same sampling settings in one generate call, as many as
    fit the KV cache of one slot (kv_tokens) and the model's positions, at most batch_max."""

    def __init__(self, state: WorkerState) -> None:
        super().__init__(state)
        # Prompts are tokenised here, not in the model's pool: a pass holds that pool for a whole
        # generate, and the next pass needs the prompts that came meanwhile ready.
        self.tokenizer = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")

    def close(self) -> None:
        self.tokenizer.shutdown(wait=False, cancel_futures=True)

    def take(self) -> list[Part]:
        """The first request and those behind it that may join it; the others keep their place."""
        rows: list[GenerationRow] = []
        parts: list[Part] = []
        waiting: deque[Job] = deque()
        for job in self.jobs:
            if self._stopped(job):
                continue
            row = job.items[0]
            if not rows or self._joins(rows, row):
                rows.append(row)
                parts.append(Part(job, 0, [row]))
            else:
                waiting.append(job)
        self.jobs = waiting
        return parts

    def _joins(self, rows: list[GenerationRow], row: GenerationRow) -> bool:
        """Whether a row may join the pass: the same sampling, at most batch_max rows, the rows'
        KV cache within one slot's kv_tokens, the padded rows within the model's positions."""
        if len(rows) >= self.max_items or row.params.sampling() != rows[0].params.sampling():
            return False
        count, length = len(rows) + 1, _padded_length([*rows, row])
        positions = getattr(self.state.engine, "positions", None) or length
        return count * length <= self.state.config.kv_tokens and length <= positions

    def run(self, parts: list[Part]) -> list[Any]:
        engine = self.state.engine
        if len(parts) == 1:  # alone: the unbatched call, so that a lone request costs what it did
            row = parts[0].items[0]
            return [([engine.generate(row.ids, row.params, parts[0].job.cancel)], 0)]
        results = engine.generate_batch([p.items[0] for p in parts], [p.job.cancel for p in parts])
        return [r if isinstance(r, Exception) else ([r], 0) for r in results]


def _padded_length(rows: list[GenerationRow]) -> int:
    """The tokens each row of one generate holds at its end: left padding makes every row as long as
    the longest prompt, and generate runs to the largest max_new_tokens. Rows x this is their KV
    cache, held against one slot's kv_tokens: what preflight counted for one request."""
    return max(len(row.ids) for row in rows) + max(row.params.max_new_tokens for row in rows)


def make_batcher(state: WorkerState) -> Batcher | None:
    """The worker's batcher, or None where each request runs its own passes."""
    config = state.config
    if config.batch_window_ms <= 0:
        return None
    if config.task == "embeddings":
        return EmbeddingBatcher(state)
    return GenerationBatcher(state) if config.kv_tokens > 0 else None


# ---------------------------------------------------------------- requests


class EmbeddingRequest(BaseModel):
    input: str | list[str]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"


class GenerationRequest(BaseModel):
    """The sampling fields that /v1/completions and /v1/chat/completions share."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=1)


class CompletionRequest(GenerationRequest):
    prompt: str | list[str]


class TextPart(BaseModel):
    """A part of a chat message's content: text only (these models read no images or audio)."""

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def template_role(self) -> str:
        return "system" if self.role == "developer" else self.role


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


@dataclass
class WorkerState:
    config: WorkerConfig
    worker_id: str
    engine: Engine | None = None
    load_error: str | None = None
    on_load_failure: Callable[[], None] | None = None
    admission: Admission = field(init=False)
    metrics: Metrics = field(default_factory=Metrics)
    executor: ThreadPoolExecutor = field(init=False)
    batcher: Batcher | None = field(init=False)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.admission = Admission(self.config.concurrency, self.config.queue)
        self.executor = ThreadPoolExecutor(self.config.concurrency, thread_name_prefix="model")
        self.batcher = make_batcher(self)
        self.metrics.registry.register(StateCollector(self))

    def require_engine(self, task: str, model: str | None) -> Engine:
        if self.engine is None:
            state = f"failed to load: {self.load_error}" if self.load_error else "still loading"
            raise ApiError(
                503, f"model {self.config.name} is {state}", "service_unavailable", headers={"Retry-After": "1"}
            )
        if model is not None and model != self.config.name:
            raise ApiError(
                404,
                f"model {model!r} does not exist here: this worker serves {self.config.name!r}",
                "invalid_request_error",
                "model_not_found",
            )
        if self.config.task != task:
            raise ApiError(
                400,
                f"model {self.config.name} serves {self.config.task}, not {task}",
                "invalid_request_error",
                "wrong_task",
            )
        return self.engine


def _refuse(message: str, code: str, param: str | None = None, status: int = 400) -> ApiError:
    return ApiError(status, message, "invalid_request_error", code, param=param)


def _check_text(text: str, param: str) -> None:
    """A lone surrogate (JSON "\\ud800") is no text: the tokenizer cannot encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _refuse(
            f"{param} holds a lone surrogate (U+{ord(text[exc.start]):04X} at {exc.start}), which is not Unicode text: "
            "send UTF-8",
            "invalid_text",
            param,
        ) from None


def check_embedding_request(req: EmbeddingRequest) -> list[str]:
    """The inputs of an embeddings request, or a refusal naming the limit; no tokenizer yet."""
    texts = [req.input] if isinstance(req.input, str) else list(req.input)
    if not texts:
        raise _refuse("input is empty", "empty_input", "input")
    if len(texts) > MAX_EMBEDDING_INPUTS:
        raise _refuse(
            f"input has {len(texts)} items; at most {MAX_EMBEDDING_INPUTS} per request (OpenAI's limit)",
            "too_many_inputs",
            "input",
        )
    for i, text in enumerate(texts):
        _check_text(text, f"input[{i}]")
    return texts


def check_stop(stop: str | list[str] | None) -> list[str]:
    """The request's stop strings, or a refusal: at most MAX_STOP, each 1 to MAX_STOP_CHARS long."""
    strings = [stop] if isinstance(stop, str) else list(stop or [])
    if len(strings) > MAX_STOP:
        raise _refuse(f"stop has {len(strings)} strings; at most {MAX_STOP} (OpenAI's limit)", "too_many_stop", "stop")
    for i, text in enumerate(strings):
        if not 1 <= len(text) <= MAX_STOP_CHARS:
            raise _refuse(
                f"stop[{i}] has {len(text)} characters; expected 1 to {MAX_STOP_CHARS}", "stop_too_long", "stop"
            )
        _check_text(text, f"stop[{i}]")
    return strings


def check_generation_request(req: GenerationRequest, chat: bool) -> list[str]:
    """The request's stop strings once its prompt or messages and stop strings pass; no tokenizer yet."""
    if chat:
        for i, message in enumerate(req.messages):
            _check_text(message.text(), f"messages[{i}].content")
    else:
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        if len(prompts) != 1:
            raise _refuse("send one prompt per request", "one_prompt", "prompt")
        _check_text(prompts[0], "prompt")
    return check_stop(req.stop)


def _too_long(engine: Engine, count: int, what: str) -> None:
    limit, source = engine.input_limit()
    if count > limit:
        raise ApiError(
            400,
            f"{what} has {count} tokens; this model takes at most {limit} ({source})",
            "invalid_request_error",
            "context_length_exceeded",
        )


def _admit(state: WorkerState) -> Cancel:
    """The request's deadline once admitted, or 503 at once when `queue` requests already wait."""
    admission = state.admission
    if not admission.admit():
        state.metrics.rejected += 1
        message = (
            f"worker {state.worker_id} is full: {admission.running} running, {admission.waiting} waiting "
            f"(concurrency {admission.concurrency}, queue {admission.queue}): retry shortly"
        )
        raise ApiError(503, message, "overloaded_error", "queue_full", headers={"Retry-After": "1"})
    return Cancel(time.monotonic() + state.config.timeout_s)


async def _enter(state: WorkerState) -> Cancel:
    """A slot for the request, or 503 at once when `queue` requests already wait."""
    cancel = _admit(state)
    try:
        await state.admission.acquire(cancel.remaining())
    except TimeoutError:
        state.metrics.timeouts += 1
        raise _timeout_error(state, "waiting in the queue") from None
    return cancel


def _timeout_error(state: WorkerState, where: str) -> ApiError:
    return ApiError(
        504,
        f"request ran past timeout_s={state.config.timeout_s:g} s {where} and was cancelled",
        "timeout_error",
        "timeout",
    )


async def _run(state: WorkerState, work: Callable[[Cancel], Any]) -> tuple[asyncio.Future, Cancel]:
    """Start the request's model work in the worker's thread pool; its slot frees when the work ends."""
    cancel = await _enter(state)
    loop = asyncio.get_running_loop()
    try:
        future = loop.run_in_executor(state.executor, work, cancel)
    except BaseException:
        state.admission.release()
        raise

    def done(fut: asyncio.Future) -> None:
        state.admission.release()
        if not fut.cancelled():
            fut.exception()  # retrieved here so an abandoned failure does not warn

    future.add_done_callback(done)
    return future, cancel


def _batched(state: WorkerState, batcher: Batcher, items: list) -> tuple[asyncio.Future, Cancel]:
    """Admit the request and queue its items for the batcher's shared passes."""
    cancel = _admit(state)
    return batcher.submit(items, cancel), cancel


async def _finish(state: WorkerState, future: asyncio.Future, cancel: Cancel) -> Any:
    """The work's result, or 504 (and the work told to stop) once the deadline passes."""
    try:
        return await asyncio.wait_for(asyncio.shield(future), cancel.remaining())
    except (TimeoutError, WorkCancelled):
        cancel.set()
        state.metrics.timeouts += 1
        raise _timeout_error(state, "running") from None
    except asyncio.CancelledError:
        cancel.set()
        raise


def _usage(prompt: int, completion: int | None = None) -> dict[str, int]:
    if completion is None:
        return {"prompt_tokens": prompt, "total_tokens": prompt}
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _encode_vector(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


# ---------------------------------------------------------------- generation answers


@dataclass
class Reply:
    """How one generation request answers: completion or chat, whole or streamed."""

    chat: bool
    model: str
    stream: bool = False
    include_usage: bool = False
    rid: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        return {"id": prefix + self.rid, "object": kind, "created": self.created, "model": self.model}

    def whole(self, result: GenerationResult) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text}}
        else:
            choice = {"index": 0, "text": result.text, "logprobs": None}
        choice["finish_reason"] = result.finish_reason
        usage = _usage(result.prompt_tokens, result.completion_tokens)
        return {**self._head(False), "choices": [choice], "usage": usage}

    def chunk(self, text: str | None = None, finish: str | None = None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**self._head(True), "choices": [choice]}

    def usage_chunk(self, result: GenerationResult) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": _usage(result.prompt_tokens, result.completion_tokens)}


def _sse(body: dict[str, Any] | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


def _streamer(engine: Engine, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
    """A transformers streamer that hands each piece of decoded text to the event loop."""
    from transformers import TextStreamer

    class LoopStreamer(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            if text:
                _put(loop, queue, text)

    return LoopStreamer(engine.tokenizer, skip_prompt=True, skip_special_tokens=True)


_END = object()


def _put(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, item: Any) -> None:
    # RuntimeError: the loop is gone because the server is stopping.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(queue.put_nowait, item)


async def _generate(
    state: WorkerState,
    engine: Engine,
    prepare: Callable[[], list[int]],
    req: GenerationRequest,
    stop: list[str],
    reply: Reply,
):
    """Tokenise (prepare) and generate in one admitted slot of the thread pool. A stream's answer
    begins only once the prompt is tokenised and checked, so that a prompt too long is a 400."""

    def params(ids: list[int]) -> GenerationParams:
        return _params(state, engine, req, len(ids), stop)

    if not reply.stream:
        result = await _generate_whole(state, engine, prepare, params)
        state.metrics.observe_generation(result)
        return JSONResponse(reply.whole(result))
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    ready: asyncio.Future = loop.create_future()
    streamer = _streamer(engine, loop, queue)

    def work(cancel: Cancel) -> GenerationResult:
        try:
            ids = prepare()
            _put_result(loop, ready, ids)
            return engine.generate(ids, params(ids), cancel, streamer)
        finally:
            _put(loop, queue, _END)

    future, cancel = await _run(state, work)
    await asyncio.wait((ready, future), timeout=cancel.remaining(), return_when=asyncio.FIRST_COMPLETED)
    if not ready.done():
        if not future.done():
            cancel.set()
            state.metrics.timeouts += 1
            raise _timeout_error(state, "waiting for the tokenizer")
        future.result()  # the tokenizer's refusal (ApiError) or failure
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(
        _events(state, reply, future, cancel, queue), media_type="text/event-stream", headers=headers
    )


async def _generate_whole(
    state: WorkerState, engine: Engine, prepare: Callable[[], list[int]], params: Callable[[list[int]], Any]
) -> GenerationResult:
    """A whole answer: in a generate call shared with other requests where the batcher can (the
    model has a pad token for the left padding), else in the request's own."""
    batcher = state.batcher
    if batcher is None or engine.tokenizer.pad_token_id is None:

        def whole(cancel: Cancel) -> GenerationResult:
            ids = prepare()
            return engine.generate(ids, params(ids), cancel)

        future, cancel = await _run(state, whole)
        return await _finish(state, future, cancel)
    cancel = _admit(state)
    try:
        tokenized = asyncio.get_running_loop().run_in_executor(batcher.tokenizer, prepare)
        ids = await asyncio.wait_for(tokenized, cancel.remaining())
    except BaseException as exc:
        state.admission.leave(began=False)
        if isinstance(exc, TimeoutError):
            state.metrics.timeouts += 1
            raise _timeout_error(state, "waiting for the tokenizer") from None
        raise
    future = batcher.submit([GenerationRow(ids, params(ids))], cancel)
    return (await _finish(state, future, cancel))[0][0]


def _put_result(loop: asyncio.AbstractEventLoop, future: asyncio.Future, value: Any) -> None:
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(lambda: future.done() or future.set_result(value))


async def _events(state: WorkerState, reply: Reply, future: asyncio.Future, cancel: Cancel, queue: asyncio.Queue):
    """SSE chunks as the text comes; an error event and the end when the deadline passes."""
    try:
        if reply.chat:
            yield _sse(reply.chunk(role=True))
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), cancel.remaining())
            except TimeoutError:
                item = None
            if item is _END:
                break
            if item is None or cancel.is_set():
                state.metrics.timeouts += 1
                yield _sse(_timeout_error(state, "streaming").response().body.decode())
                return
            yield _sse(reply.chunk(text=item))
        async for tail in _stream_tail(state, reply, future):
            yield tail
    finally:
        cancel.set()


async def _stream_tail(state: WorkerState, reply: Reply, future: asyncio.Future) -> AsyncIterator[str]:
    try:
        result = await future
    except WorkCancelled:
        state.metrics.timeouts += 1
        yield _sse(_timeout_error(state, "streaming").response().body.decode())
        return
    except Exception as exc:  # the stream has begun: the error goes in an event
        LOG.exception("generation failed")
        yield _sse(
            {"error": {"message": f"generation failed: {exc}", "type": "server_error", "param": None, "code": None}}
        )
        return
    state.metrics.observe_generation(result)
    yield _sse(reply.chunk(finish=result.finish_reason))
    if reply.include_usage:
        yield _sse(reply.usage_chunk(result))
    yield _sse("[DONE]")


def _params(state: WorkerState, engine: Engine, req: GenerationRequest, prompt_tokens: int, stop: list[str]):
    asked = getattr(req, "max_completion_tokens", None) or req.max_tokens or state.config.max_new_tokens
    room = (engine.positions or prompt_tokens + asked) - prompt_tokens
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    return GenerationParams(min(asked, state.config.max_new_tokens, room), temperature, top_p, stop)


def _prompt_ids(state: WorkerState, engine: Engine, req: GenerationRequest, chat: bool) -> list[int]:
    """Tokenise the prompt (in the model's thread pool, after admission) and check its length."""
    if chat:
        messages = [{"role": m.template_role(), "content": m.text()} for m in req.messages]
        prompt = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        prompt = req.prompt if isinstance(req.prompt, str) else req.prompt[0]
    ids = engine.encode(prompt)
    if not ids:
        raise _refuse("the prompt is empty", "empty_prompt", "messages" if chat else "prompt")
    _too_long(engine, len(ids), "the prompt")
    return ids


async def _serve_generation(state: WorkerState, req: GenerationRequest, chat: bool):
    engine = state.require_engine("generation", req.model)
    if chat and not engine.has_chat_template():
        raise ApiError(
            400,
            f"model {state.config.name} has no chat template: use /v1/completions",
            "invalid_request_error",
            "no_chat_template",
        )
    stop = check_generation_request(req, chat)
    include_usage = bool((req.stream_options or {}).get("include_usage"))
    reply = Reply(chat=chat, model=state.config.name, stream=req.stream, include_usage=include_usage)
    return await _generate(state, engine, lambda: _prompt_ids(state, engine, req, chat), req, stop, reply)


# ---------------------------------------------------------------- the app


def _routes(api: FastAPI, state: WorkerState) -> None:
    @api.get("/health")
    async def health():
        if state.engine is not None:
            return {"status": "ok", "worker": state.worker_id, "model": state.config.name}
        status = "failed" if state.load_error else "loading"
        return JSONResponse({"status": status, "worker": state.worker_id}, 503, headers={"Retry-After": "1"})

    @api.get("/metrics")
    async def metrics():
        # Prometheus 2's text format (Debian 12's server), which these names need no escaping for.
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_PLAIN_0_0_4)

    @api.get("/v1/models")
    async def models():
        card = {"id": state.config.name, "object": "model", "created": state.created, "owned_by": "budgetgpu"}
        return {"object": "list", "data": [card]}

    @api.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest):
        engine = state.require_engine("embeddings", req.model)
        texts = check_embedding_request(req)

        def work(cancel: Cancel) -> tuple[list[list[float]], int]:
            # After admission, in the thread pool: one batched tokenizer call for the lengths.
            for i, count in enumerate(engine.count_tokens_each(texts)):
                _too_long(engine, count, f"input {i}")
            return engine.embed(texts, cancel)

        if state.batcher is not None:
            future, cancel = _batched(state, state.batcher, texts)
        else:
            future, cancel = await _run(state, work)
        vectors, tokens = await _finish(state, future, cancel)
        data = [
            {"object": "embedding", "index": i, "embedding": _encode_vector(v, req.encoding_format)}
            for i, v in enumerate(vectors)
        ]
        return {"object": "list", "data": data, "model": state.config.name, "usage": _usage(tokens)}

    @api.post("/v1/completions")
    async def completions(req: CompletionRequest):
        return await _serve_generation(state, req, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest):
        return await _serve_generation(state, req, chat=True)


def _error_handlers(api: FastAPI) -> None:
    @api.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return exc.response()

    @api.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors())
        return ApiError(400, problems, "invalid_request_error").response()

    @api.exception_handler(404)
    async def not_found(request: Request, exc: Exception):
        return ApiError(404, f"no route {request.url.path}", "invalid_request_error", "not_found").response()

    @api.exception_handler(Exception)
    async def failed(request: Request, exc: Exception):
        LOG.error("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
        return ApiError(500, f"the worker failed: {type(exc).__name__}", "server_error", "internal_error").response()


class WorkerApp:
    """The ASGI app: FastAPI inside a layer that stamps X-Budgetgpu-Worker and counts every answer."""

    def __init__(self, api: FastAPI, state: WorkerState) -> None:
        self.api, self.state = api, state
        self._header = (b"x-budgetgpu-worker", state.worker_id.encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.api(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]

        # The head waits for the first body bytes, so that both leave in one write (WholeWrites):
        # a worker killed between the two would hand NGINX a head without its body, an answer the
        # gateway may no longer retry on another worker.
        head = []

        async def send_stamped(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                head.append({**message, "headers": [*message.get("headers", []), self._header]})
                return
            if head:
                await send(head.pop())
            await send(message)

        try:
            body = await self._bounded_body(scope, receive)
            if body is None:
                await self._too_large(scope, send_stamped)
                return
            await self.api(scope, _replay(body, receive), send_stamped)
        finally:
            endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
            self.state.metrics.observe_request(endpoint, status[0], time.perf_counter() - start)

    async def _bounded_body(self, scope, receive) -> bytes | None:
        """The whole request body, or None past the path's limit (read no further than that)."""
        limit = self.state.config.body_limit(scope["path"])
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        return b"".join(chunks)

    async def _too_large(self, scope, send) -> None:
        limit = self.state.config.body_limit(scope["path"])
        error = _refuse(
            f"the request body is larger than {limit} bytes, the most {scope['path']} takes (max_body_bytes)",
            "body_too_large",
            status=413,
        )
        await error.response()(scope, _no_body, send)


async def _no_body() -> dict:
    return {"type": "http.request", "body": b"", "more_body": False}


class WholeWrites:
    """A transport whose writes of one event-loop turn go out as one (a head and its body): a
    process killed between two writes leaves half an answer; killed after one, the kernel still
    delivers all of it."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(bytes(data))

    def _flush(self) -> None:
        if self._pending and not self._transport.is_closing():
            self._transport.write(b"".join(self._pending))
        self._pending.clear()

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def whole_writes_protocol() -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol (h11, the one the worker's packages hold) over WholeWrites."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class WholeWritesH11(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(WholeWrites(transport))

    return WholeWritesH11


def _replay(body: bytes, receive):
    """A receive that hands the app the body read already, then waits for the client as before."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _load_in_background(state: WorkerState) -> None:
    try:
        state.engine = await asyncio.to_thread(load_engine, state.config)
    except Exception as exc:  # any load failure ends the worker with one line
        state.load_error = f"{type(exc).__name__}: {exc}"
        print(
            f"inference_worker {state.worker_id}: cannot load {state.config.model_dir}: {state.load_error}",
            file=sys.stderr,
            flush=True,
        )
        if state.on_load_failure:
            state.on_load_failure()


def build_app(config: WorkerConfig, worker_id: str, engine: Engine | None = None) -> WorkerApp:
    """The worker's app; without an engine it loads the model after start (/health says 503 meanwhile)."""
    state = WorkerState(config, worker_id, engine)

    @asynccontextmanager
    async def lifespan(api: FastAPI):
        task = asyncio.create_task(_load_in_background(state)) if state.engine is None else None
        yield
        if task is not None:
            task.cancel()
        state.executor.shutdown(wait=False, cancel_futures=True)
        if state.batcher is not None:
            state.batcher.close()

    api = FastAPI(title=f"budgetgpu inference worker {config.name}", lifespan=lifespan, docs_url=None, redoc_url=None)
    _error_handlers(api)
    _routes(api, state)
    return WorkerApp(api, state)


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the worker's JSON config")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--worker-id", default=None, help="named in X-Budgetgpu-Worker (default host:port)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = load_config(args.config)
        if config.quantization != "none":
            import torch

            check_device(config, torch.cuda.is_available())
    except ConfigError as exc:
        print(f"inference_worker: {exc}", file=sys.stderr, flush=True)
        return 2
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    import uvicorn

    worker_id = args.worker_id or f"{args.host}:{args.port}"
    # The model loads before the port opens: the gateway then finds a loading worker refused (and
    # retries the request on another) instead of getting an answer it would hand the client.
    LOG.info("%s: worker %s loading %s", config.name, worker_id, config.model_dir)
    try:
        engine = load_engine(config)
    except Exception as exc:  # any load failure ends the worker with one line
        print(
            f"inference_worker {worker_id}: cannot load {config.model_dir}: {type(exc).__name__}: {exc}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    app = build_app(config, worker_id, engine)
    # Keep-alive longer than NGINX's upstream keepalive_timeout (60 s): the gateway closes idle
    # connections first, so it never sends a request on one the worker is closing.
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            http=whole_writes_protocol(),
            access_log=False,
            log_config=None,
            timeout_graceful_shutdown=5,
            timeout_keep_alive=75,
        )
    )
    LOG.info("%s: worker %s listening on %s:%s", config.name, worker_id, args.host, args.port)
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
