"""The inference cluster through its gateway: every worker of both nodes answers, the embeddings make
sense, generation streams, the units are hardened and pinned to their GPU by UUID, the firewall keeps
the workers from everyone but the gateway, a killed worker comes back, and an overloaded worker
answers 503 at once. HTTP clients run on the nodes (python3's urllib), as the gateway's clients would.

The tests run in file order against the converged scenario (molecule.yml)."""

from __future__ import annotations

import json
import math
import subprocess
import time
from collections import Counter
from collections.abc import Callable

import pytest

GATEWAY, OTHER = "inference-node1", "inference-node2"
NODES = (GATEWAY, OTHER)
NETWORK = "budgetgpu-molecule-inference"
EMBED_PORT, GENERATE_PORT = 8100, 8200  # first worker port of each service (molecule.yml)
EMBED_GATEWAY, GENERATE_GATEWAY = 8080, 8081
EMBED_WORKERS = {f"{node}-{slot}" for node in NODES for slot in (0, 1)}

# Runs on a node: one HTTP request per entry of argv[1] (JSON list of {url, body, stream}), all in
# parallel; prints [{status, worker, retry_after, body, seconds, error}].
CLIENT = r"""
import json, sys, time, urllib.error, urllib.request
from concurrent.futures import ThreadPoolExecutor

def call(spec):
    start = time.monotonic()
    data = json.dumps(spec["body"]).encode() if spec.get("body") is not None else None
    req = urllib.request.Request(spec["url"], data=data, headers={"Content-Type": "application/json"})
    out = {"status": None, "worker": None, "retry_after": None, "body": None, "error": None}
    try:
        with urllib.request.urlopen(req, timeout=spec.get("timeout", 60)) as answer:
            out["status"], out["worker"] = answer.status, answer.headers.get("X-Budgetgpu-Worker")
            out["body"] = answer.read().decode()
    except urllib.error.HTTPError as err:
        out["status"], out["worker"] = err.code, err.headers.get("X-Budgetgpu-Worker")
        out["retry_after"], out["body"] = err.headers.get("Retry-After"), err.read().decode()
    except Exception as err:
        out["error"] = f"{type(err).__name__}: {err}"
    out["seconds"] = time.monotonic() - start
    return out

specs = json.loads(sys.argv[1])
with ThreadPoolExecutor(max_workers=max(1, int(sys.argv[2]))) as pool:
    print(json.dumps(list(pool.map(call, specs))))
"""


def sh(node: str, command: str, check: bool = True, timeout: float = 120) -> str:
    proc = subprocess.run(
        ["docker", "exec", node, "bash", "-c", command], capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{node}: `{command[:120]}` failed ({proc.returncode}): {proc.stderr.strip()[-800:]}")
    return proc.stdout


def address(node: str) -> str:
    proc = subprocess.run(
        ["docker", "inspect", "-f", f'{{{{(index .NetworkSettings.Networks "{NETWORK}").IPAddress}}}}', node],
        capture_output=True,
        text=True,
        check=True,
    )
    return proc.stdout.strip()


def requests(node: str, specs: list[dict], parallel: int = 1, timeout: float = 180) -> list[dict]:
    proc = subprocess.run(
        ["docker", "exec", node, "python3", "-c", CLIENT, json.dumps(specs), str(parallel)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def wait_for(what: str, predicate: Callable[[], object], timeout: float = 240.0) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def healthy(node: str, url: str) -> bool:
    return requests(node, [{"url": url, "timeout": 5}])[0]["status"] == 200


def embed(node: str, texts: list[str], url: str) -> list[list[float]]:
    answer = requests(node, [{"url": url, "body": {"model": "embed", "input": texts}}])[0]
    assert answer["status"] == 200, answer
    return [item["embedding"] for item in json.loads(answer["body"])["data"]]


@pytest.fixture(scope="module")
def addresses() -> dict[str, str]:
    return {node: address(node) for node in NODES}


@pytest.fixture(scope="module")
def gateway(addresses: dict[str, str]) -> str:
    return addresses[GATEWAY]


def test_every_worker_comes_up(addresses: dict[str, str]) -> None:
    # The workers load their model after the converge: wait for each one's /health from the gateway.
    for node in NODES:
        for port in (EMBED_PORT, EMBED_PORT + 1, GENERATE_PORT):
            url = f"http://{addresses[node]}:{port}/health"
            wait_for(url, lambda url=url: healthy(GATEWAY, url))


def test_units_are_hardened_and_pinned_by_gpu_uuid() -> None:
    for node in NODES:
        # The GPUs' UUIDs as NVML (gpu_facts) reports them, in nvidia-smi order (the system python has
        # the simulated pynvml).
        uuids = json.loads(
            sh(
                node,
                "python3 -c 'import json, pynvml; pynvml.nvmlInit(); "
                "print(json.dumps([pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)) "
                "for i in range(pynvml.nvmlDeviceGetCount())]))'",
            )
        )
        for unit, gpu in (("embed@0", 0), ("embed@1", 1), ("generate@0", 2)):
            props = dict(
                line.split("=", 1)
                for line in sh(
                    node,
                    f"systemctl show budgetgpu-infer-{unit}.service -p User -p NoNewPrivileges -p ProtectSystem "
                    "-p PrivateTmp -p Restart -p ActiveState -p Environment -p MainPID",
                ).splitlines()
            )
            assert props["User"] == "budgetgpu", (node, unit, props)
            assert props["NoNewPrivileges"] == "yes" and props["ProtectSystem"] == "strict", props
            assert props["PrivateTmp"] == "yes" and props["Restart"] == "always", props
            assert props["ActiveState"] == "active", (node, unit, props)
            env = props["Environment"].split()
            assert f"CUDA_VISIBLE_DEVICES={uuids[gpu]}" in env, (node, unit, env)
            assert {"HF_HUB_OFFLINE=1", "TRANSFORMERS_OFFLINE=1"} <= set(env), env
            owner = sh(node, f"stat -c %U /proc/{props['MainPID']}").strip()
            assert owner == "budgetgpu", (node, unit, owner)
        assert "CUDA_VISIBLE_DEVICES=GPU-" in sh(node, "systemctl cat budgetgpu-infer-embed@0.service")
        sh(node, "systemd-analyze verify budgetgpu-infer-embed@0.service budgetgpu-infer-generate@0.service")


def test_requests_through_nginx_reach_every_worker(gateway: str) -> None:
    url = f"http://{gateway}:{EMBED_GATEWAY}/v1/embeddings"
    specs = [{"url": url, "body": {"model": "embed", "input": f"request {i}"}} for i in range(48)]
    answers = requests(OTHER, specs, parallel=8)
    assert all(a["status"] == 200 for a in answers), [a for a in answers if a["status"] != 200][:3]
    share = Counter(a["worker"] for a in answers)
    assert set(share) == EMBED_WORKERS, share


def test_embeddings_make_sense_through_the_gateway(gateway: str) -> None:
    cat, kitten, carburettor = embed(
        OTHER, ["cat", "kitten", "carburettor"], f"http://{gateway}:{EMBED_GATEWAY}/v1/embeddings"
    )
    assert len(cat) == 384

    def cosine(a: list[float], b: list[float]) -> float:
        return sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))

    assert cosine(cat, kitten) > cosine(cat, carburettor), (cosine(cat, kitten), cosine(cat, carburettor))


def test_generation_and_streams_through_the_gateway(gateway: str) -> None:
    base = f"http://{gateway}:{GENERATE_GATEWAY}/v1"
    plain, stream, models = requests(
        OTHER,
        [
            {"url": f"{base}/completions", "body": {"model": "generate", "prompt": "The cat", "max_tokens": 8}},
            {
                "url": f"{base}/completions",
                "body": {"model": "generate", "prompt": "The cat", "max_tokens": 8, "stream": True},
            },
            {"url": f"{base}/models"},
        ],
    )
    assert plain["status"] == 200 and json.loads(plain["body"])["choices"][0]["text"] is not None, plain
    assert stream["status"] == 200 and "data: [DONE]" in stream["body"], stream
    assert stream["body"].count("data: ") >= 2, stream["body"][:500]
    assert models["status"] == 200 and "generate" in models["body"], models


def test_firewall_lets_only_the_gateway_reach_the_workers(addresses: dict[str, str]) -> None:
    # The gateway's node reaches the other node's workers; the other node is refused by the gateway's.
    assert healthy(GATEWAY, f"http://{addresses[OTHER]}:{EMBED_PORT}/health")
    refused = requests(OTHER, [{"url": f"http://{addresses[GATEWAY]}:{EMBED_PORT}/health", "timeout": 5}])[0]
    assert refused["status"] is None and refused["error"], refused
    assert "budgetgpu_inference" in sh(GATEWAY, "nft list tables")
    # The gateway port is open to the cluster subnet (the other node).
    assert healthy(OTHER, f"http://{addresses[GATEWAY]}:{EMBED_GATEWAY}/health")


def test_a_killed_worker_is_restarted_and_serves_again(addresses: dict[str, str], gateway: str) -> None:
    unit = "budgetgpu-infer-embed@1.service"
    pid = sh(OTHER, f"systemctl show -p MainPID --value {unit}").strip()
    assert pid not in ("", "0")
    sh(OTHER, f"kill -KILL {pid}")
    # Meanwhile the gateway serves every request from the other workers.
    url = f"http://{gateway}:{EMBED_GATEWAY}/v1/embeddings"
    answers = requests(
        OTHER, [{"url": url, "body": {"model": "embed", "input": f"x{i}"}} for i in range(16)], parallel=4
    )
    assert all(a["status"] == 200 for a in answers), [a for a in answers if a["status"] != 200][:3]
    wait_for(
        f"{unit} running again with a new process",
        lambda: sh(OTHER, f"systemctl show -p MainPID --value {unit}").strip() not in ("", "0", pid),
    )
    wait_for(f"{unit} healthy again", lambda: healthy(GATEWAY, f"http://{addresses[OTHER]}:{EMBED_PORT + 1}/health"))
    # NGINX takes a failed server back only after fail_timeout (5 s) has passed since its last
    # failure, which can be later than the worker's own health: ask until it is back in the upstream.
    wait_for(
        f"the gateway sending requests to {OTHER}-1 again",
        lambda: f"{OTHER}-1"
        in {
            a["worker"]
            for a in requests(
                OTHER, [{"url": url, "body": {"model": "embed", "input": f"y{i}"}} for i in range(16)], parallel=8
            )
        },
        timeout=60,
    )


def test_an_overloaded_worker_answers_503_at_once(addresses: dict[str, str]) -> None:
    # concurrency 1, queue 1: of a burst of 8 slow requests at one worker, at most 2 are taken; the
    # others get 503 with Retry-After right away, none waits for its timeout.
    url = f"http://{addresses[OTHER]}:{GENERATE_PORT}/v1/completions"
    body = {"model": "generate", "prompt": "The cluster runs", "max_tokens": 64}
    answers = requests(GATEWAY, [{"url": url, "body": body, "timeout": 60} for _ in range(8)], parallel=8)
    statuses = Counter(a["status"] for a in answers)
    assert statuses[503] >= 5 and statuses[200] >= 1, statuses
    assert all(a["error"] is None for a in answers), [a["error"] for a in answers]
    rejected = [a for a in answers if a["status"] == 503]
    assert all(a["retry_after"] for a in rejected), rejected[0]
    assert max(a["seconds"] for a in rejected) < 5, [round(a["seconds"], 2) for a in rejected]
