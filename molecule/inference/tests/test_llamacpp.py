"""engine llamacpp in the inference cluster (issue 29): llama.cpp's llama-server, a CPU build of
scripts/build-llama-server, serving the tiny GPT-2 as a GGUF file under the same unit, user, GPU
pinning, gateway, keys and health checks as the built-in worker; through the gateway with the
official openai client (completions, chats, both streamed), killed and restarted while the gateway
serves on, and its /metrics read from the gateway's node (an address the firewall admits, as
Prometheus' is) in Prometheus' text format, holding every llama.cpp series the recording rules read;
Debian's Prometheus, scraping every worker, records the same series for both engines' workers.

The helpers are test_inference.py's, the fixtures conftest.py's; these tests run after test_inference.py's."""

from __future__ import annotations

import json
import re
import subprocess

from prometheus_client.parser import text_string_to_metric_families
from test_inference import (
    AUTH,
    GATEWAY,
    GENERATE_GATEWAY,
    KEY,
    NODES,
    OTHER,
    REPO,
    gpu_uuids,
    healthy,
    main_pid,
    requests,
    sh,
    wait_for,
)

LLAMA_PORT, LLAMA_GATEWAY = 8300, 8082  # molecule.yml: service llama
UNIT = "budgetgpu-infer-llama@0.service"
LLAMA_SERVER = "/usr/local/lib/budgetgpu/llama-server"
GGUF = "/var/lib/budgetgpu/models/llama/tiny-lm.gguf"
RULES = REPO / "roles" / "prometheus" / "templates" / "budgetgpu.rules.yml.j2"


def completion(gateway_address: str, i: int) -> dict:
    body = {"model": "llama", "prompt": f"The cat {i}", "max_tokens": 4}
    return {"url": f"http://{gateway_address}:{LLAMA_GATEWAY}/v1/completions", "body": body, "headers": AUTH}


def test_llama_server_workers_come_up_as_the_services_unprivileged_user_pinned_by_gpu_uuid(addresses) -> None:
    for node in NODES:
        url = f"http://{addresses[node]}:{LLAMA_PORT}/health"
        wait_for(url, lambda url=url: healthy(GATEWAY, url))
        pid = main_pid(node, UNIT)
        argv = sh(node, f"cat /proc/{pid}/cmdline").split("\0")
        assert argv[0] == LLAMA_SERVER, argv
        options = dict(zip(argv[1::2], argv[2::2], strict=False))
        assert options["--model"] == GGUF and options["--alias"] == "llama", argv
        assert options["--host"] == addresses[node] and options["--port"] == str(LLAMA_PORT), argv
        assert options["--parallel"] == "2" and "--metrics" in argv, argv
        # Each slot holds max_input_tokens + max_new_tokens (256 + 64): -c is their sum over the 2 slots.
        assert options["--ctx-size"] == "640", argv
        assert sh(node, f"stat -c %U /proc/{pid}").strip() == "budgetgpu-infer"
        # (The container's root may not read another user's /proc/<pid>/environ: the unit's, then.)
        props = dict(
            line.split("=", 1)
            for line in sh(
                node, f"systemctl show {UNIT} -p NoNewPrivileges -p ProtectSystem -p Restart -p Environment"
            ).splitlines()
        )
        assert f"CUDA_VISIBLE_DEVICES={gpu_uuids(node)[3]}" in props["Environment"].split(), props
        hardening = (props["NoNewPrivileges"], props["ProtectSystem"], props["Restart"])
        assert hardening == ("yes", "strict", "always"), props
        # The binary and the model are root's: the worker's user can change neither.
        for path in (LLAMA_SERVER, GGUF):
            assert sh(node, f"stat -c %U {path}").strip() == "root", path
            probe = f"runuser -u budgetgpu-infer -- test -w {path} && echo writable || echo read-only"
            assert sh(node, probe).strip() == "read-only", path


def test_the_official_openai_client_completes_chats_and_streams_through_the_gateway(gateway) -> None:
    # ignore_eos (llama-server's own option): the random weights would otherwise stop at any token.
    script = f"""
import json, openai
client = openai.OpenAI(base_url="http://{gateway}:{LLAMA_GATEWAY}/v1", api_key="{KEY}", max_retries=0)
extra = {{"ignore_eos": True}}
models = [m.id for m in client.models.list()]
done = client.completions.create(model="llama", prompt="The cat", max_tokens=8, extra_body=extra)
chat = client.chat.completions.create(
    model="llama", messages=[{{"role": "user", "content": "hi"}}], max_tokens=4, extra_body=extra)
pieces = [c.choices[0].text for c in client.completions.create(
    model="llama", prompt="The cat", max_tokens=6, stream=True, extra_body=extra) if c.choices]
deltas = [c.choices[0].delta.content for c in client.chat.completions.create(
    model="llama", messages=[{{"role": "user", "content": "hi"}}], max_tokens=6, stream=True, extra_body=extra)
    if c.choices and c.choices[0].delta.content]
refused = None
try:
    openai.OpenAI(base_url="http://{gateway}:{LLAMA_GATEWAY}/v1", api_key="sk-wrong", max_retries=0).completions.create(
        model="llama", prompt="x", max_tokens=1)
except openai.AuthenticationError as err:
    refused = [err.status_code, err.code]
print(json.dumps({{"models": models, "completion_tokens": done.usage.completion_tokens, "text": done.choices[0].text,
                  "chat_role": chat.choices[0].message.role, "chat_tokens": chat.usage.completion_tokens,
                  "pieces": len(pieces), "deltas": len(deltas), "refused": refused}}))
"""
    got = json.loads(sh(OTHER, f"/opt/test-clients/openai/bin/python - <<'EOF'\n{script}\nEOF"))
    assert got["models"] == ["llama"], got
    assert got["completion_tokens"] == 8 and got["text"], got
    assert got["chat_role"] == "assistant" and got["chat_tokens"] == 4, got
    # A stream arrives in pieces (one event per token, some tokens may be empty text).
    assert got["pieces"] >= 2 and got["deltas"] >= 2, got
    # The gateway's key check, not llama-server's (it runs without a key, behind the firewall).
    assert got["refused"] == [401, "invalid_api_key"], got


def test_a_killed_llama_server_is_restarted_while_the_gateway_serves_on(addresses, gateway) -> None:
    log = "/var/log/nginx/budgetgpu-llama.access.log"
    pid = main_pid(OTHER, UNIT)
    assert pid not in ("", "0")
    sh(OTHER, f"kill -KILL {pid}")
    answers = requests(OTHER, [completion(gateway, i) for i in range(12)], parallel=3)
    assert all(a["status"] == 200 for a in answers), [a for a in answers if a["status"] != 200][:3]
    wait_for(f"{UNIT} running again", lambda: main_pid(OTHER, UNIT) not in ("", "0", pid))
    wait_for(f"{UNIT} healthy again", lambda: healthy(GATEWAY, f"http://{addresses[OTHER]}:{LLAMA_PORT}/health"))
    # The gateway sends it requests again once fail_timeout (5 s) has passed: its access log names the
    # restarted worker as the upstream of a request that came after.
    upstream = f"upstream={addresses[OTHER]}:{LLAMA_PORT} upstream_status=200"

    def served_again() -> bool:
        seen = int(sh(GATEWAY, f"wc -l < {log}"))
        batch = requests(OTHER, [completion(gateway, i) for i in range(8)], parallel=4)
        assert all(a["status"] == 200 for a in batch), [a for a in batch if a["status"] != 200][:3]
        return upstream in sh(GATEWAY, f"tail -n +{seen + 1} {log}")

    wait_for(f"the gateway sending requests to {OTHER}'s llama-server again", served_again, timeout=60)


def test_llama_server_metrics_hold_every_series_the_recording_rules_read(addresses, gateway) -> None:
    # Traffic first, so that the counters have moved on both workers.
    assert all(a["status"] == 200 for a in requests(OTHER, [completion(gateway, i) for i in range(8)], parallel=4))
    fetch = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"
    for node in NODES:
        text = sh(GATEWAY, f"python3 -c '{fetch}' http://{addresses[node]}:{LLAMA_PORT}/metrics")
        # prometheus_client's parser reads it as Prometheus would (a malformed line raises).
        samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert samples["llamacpp:prompt_tokens_total"] > 0 and samples["llamacpp:tokens_predicted_total"] > 0, samples
        read = set(re.findall(r"llamacpp:\w+", RULES.read_text()))
        assert read, "the recording rules read no llama.cpp series"
        assert read <= set(samples), (node, read - set(samples))


PROMETHEUS_QUERY = """
import sys, urllib.parse, urllib.request
url = "http://127.0.0.1:9090/api/v1/query?" + urllib.parse.urlencode({"query": sys.argv[1]})
print(urllib.request.urlopen(url, timeout=5).read().decode())
"""


def prometheus(query: str) -> list[dict]:
    """The result of an instant query of the Prometheus on the gateway's node (its HTTP API)."""
    proc = subprocess.run(
        ["docker", "exec", GATEWAY, "python3", "-c", PROMETHEUS_QUERY, query],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    answer = json.loads(proc.stdout)
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def test_prometheus_records_the_same_series_for_llama_cpp_and_builtin_workers(gateway) -> None:
    # Generation on both engines' services, then their tokens per second as the dashboard reads them.
    generate = {"model": "generate", "prompt": "The cat", "max_tokens": 4}
    specs = [completion(gateway, i) for i in range(8)]
    specs += [{"url": f"http://{gateway}:{GENERATE_GATEWAY}/v1/completions", "body": generate, "headers": AUTH}] * 4
    assert all(a["status"] == 200 for a in requests(OTHER, specs, parallel=2))
    want = {(service, node) for service in ("llama", "generate") for node in NODES}

    def generating() -> set:
        found = prometheus("budgetgpu_inference:generated_tokens:rate5m > 0")
        return want <= {(s["metric"]["service"], s["metric"]["node"]) for s in found}

    wait_for("tokens per second of both engines' workers in Prometheus", generating, timeout=60)
    # Every worker of every engine has its in-flight series (llama.cpp: its busy slots)...
    in_flight = {(s["metric"]["service"], s["metric"]["node"]) for s in prometheus("budgetgpu_inference:in_flight")}
    assert in_flight == {(service, node) for service in ("embed", "generate", "llama") for node in NODES}, in_flight
    # ...and llama-server, which counts no requests, has no request rate rather than a made-up one.
    services = {s["metric"]["service"] for s in prometheus("budgetgpu_inference:requests:rate5m")}
    assert services == {"embed", "generate"}, services
    up = {(s["metric"]["service"], s["value"][1]) for s in prometheus('up{job="inference"}')}
    assert up == {("embed", "1"), ("generate", "1"), ("llama", "1")}, up
