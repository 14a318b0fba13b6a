"""engine llamacpp in the inference cluster (issue 29): llama.cpp's llama-server, a CPU build of
scripts/build-llama-server, serving the tiny GPT-2 as a GGUF file under the same unit, user, GPU
pinning, gateway, keys and health checks as the built-in worker; through the gateway with the
official openai client (completions, chats, both streamed), killed and restarted while the gateway
serves on, and its /metrics read from the gateway's node (an address the firewall admits, as
Prometheus' is) in Prometheus' text format, holding every llama.cpp series the recording rules read;
Debian's Prometheus, scraping every worker, records the same series for both engines' workers. The gateway
passes only what it serves (issue 40): llama-server's own paths answer 404 at NGINX and it runs without slots,
none of the client's headers but Content-Type reaches a worker (X-Conversation-Id, seen on the wire), and one
key holds at most half of what the workers admit while another key is served.

The helpers are test_inference.py's, the fixtures conftest.py's; these tests run after test_inference.py's."""

from __future__ import annotations

import json
import re
import subprocess
import time

from prometheus_client.parser import text_string_to_metric_families
from test_inference import (
    AUTH,
    GATEWAY,
    GENERATE_GATEWAY,
    KEY,
    NODES,
    OTHER,
    OTHER_KEY,
    REPO,
    error_of,
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
        assert options["--parallel"] == "2" and "--metrics" in argv and "--no-slots" in argv, argv
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


# ---------------------------------------------------------------- the gateway passes only what it serves (issue 40)


def test_llama_servers_own_paths_do_not_pass_the_gateway_and_it_runs_without_slots(addresses, gateway) -> None:
    base = f"http://{gateway}:{LLAMA_GATEWAY}"
    private = [
        {"url": f"{base}/slots", "headers": AUTH},
        {"url": f"{base}/props", "headers": AUTH},
        {"url": f"{base}/tokenize", "body": {"content": "x"}, "headers": AUTH},
        {"url": f"{base}/infill", "body": {"input_prefix": "x"}, "headers": AUTH},
        # Another client's stream, by its conversation id: read (GET) or cancelled.
        {"url": f"{base}/v1/stream?conv_id=anyone", "headers": AUTH},
        {"url": f"{base}/v1/messages", "body": {"model": "llama", "max_tokens": 1, "messages": []}, "headers": AUTH},
        {"url": f"{base}/v1/responses", "body": {"model": "llama", "input": "x"}, "headers": AUTH},
    ]
    for spec, answer in zip(private, requests(OTHER, private), strict=True):
        assert answer["status"] == 404 and error_of(answer)["code"] == "not_found", (spec["url"], answer)
        assert "only /v1/models, /v1/completions, /v1/chat/completions and /health" in error_of(answer)["message"]
    # On the worker itself (from the gateway's node, which the firewall admits): no slot endpoints at all.
    slots = requests(GATEWAY, [{"url": f"http://{addresses[OTHER]}:{LLAMA_PORT}/slots", "timeout": 5}])[0]
    assert slots["status"] is not None and slots["status"] >= 400, slots


# Runs on the gateway's node: records the TCP payload sent to port argv[1] (the workers', on both nodes: the
# gateway's own worker over lo) until its stdin closes (at most 120 s), then prints it. "ready" once it listens.
SNIFF = r"""
import json, select, socket, struct, sys, time
port = int(sys.argv[1])
raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))
print("ready", flush=True)
seen, deadline = [], time.monotonic() + 120
while time.monotonic() < deadline:
    readable = select.select([raw, sys.stdin], [], [], 1)[0]
    if sys.stdin in readable:
        break
    if raw not in readable:
        continue
    frame = raw.recv(65535)
    if frame[12:14] != b"\x08\x00" or frame[23] != 6:  # IPv4, TCP
        continue
    tcp = frame[14 + (frame[14] & 15) * 4:]
    if struct.unpack("!H", tcp[2:4])[0] == port:
        seen.append(tcp[(tcp[12] >> 4) * 4:].decode("latin-1"))
print(json.dumps("".join(seen)), flush=True)
"""


def test_the_gateway_passes_the_engine_none_of_the_clients_headers_but_content_type(gateway) -> None:
    # X-Conversation-Id makes llama-server go on generating after its client left (no limit of NGINX counts that
    # work): sent by the official client, it must not reach a worker; nor the key or the client's own headers.
    sniffer = subprocess.Popen(
        ["docker", "exec", "-i", GATEWAY, "python3", "-c", SNIFF, str(LLAMA_PORT)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    script = f"""
import openai
client = openai.OpenAI(base_url="http://{gateway}:{LLAMA_GATEWAY}/v1", api_key="{KEY}", max_retries=0)
for i in range(4):
    for chunk in client.completions.create(model="llama", prompt="The cat", max_tokens=4, stream=True,
                                           extra_headers={{"X-Conversation-Id": f"conv-marker-{{i}}"}}):
        pass
"""
    try:
        assert sniffer.stdout.readline().strip() == "ready", sniffer.stderr.read()[-2000:]
        sh(OTHER, f"/opt/test-clients/openai/bin/python - <<'EOF'\n{script}\nEOF")
        time.sleep(1)  # the last packets on their way to the capture
        out, _err = sniffer.communicate(input="stop\n", timeout=60)
    finally:
        sniffer.kill()
    captured = json.loads(out.strip().splitlines()[-1]).lower()
    # The completions that reached the workers (Prometheus' scrapes of /metrics pass there too)...
    sent = [r for r in re.split(r"(?=(?:get|post) /)", captured) if r.startswith("post /v1/completions http/1.1")]
    assert len(sent) >= 4, captured[:2000]
    for request in sent:
        # ...with NGINX's own headers and the body's type...
        assert "content-type: application/json" in request and "x-request-id:" in request, request[:1000]
        # ...and none of the client's others (the openai client sends User-Agent and X-Stainless-*).
        for header in ("x-conversation-id", "conv-marker", "authorization", KEY.lower(), "user-agent", "x-stainless"):
            assert header not in request, (header, request[:1000])


# Runs on a node: opens argv[3] requests with key argv[4] to the llama gateway that send their header and no body
# (NGINX holds each, counted against its key, until the body comes), waits argv[5] seconds for answers, prints
# {held, answers}, then keeps them open until stdin closes.
HOLD = r"""
import json, socket, select, sys, time
host, port, count, key, wait = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n").encode()
held = [socket.create_connection((host, port)) for _unused in range(count)]
for s in held:
    s.sendall(head)
answers, deadline = {}, time.monotonic() + wait
while time.monotonic() < deadline:
    for s in select.select([s for s in held if s not in answers], [], [], 0.2)[0]:
        data = s.recv(65536)
        answers[s] = data.decode("latin-1")
print(json.dumps({"held": count - len(answers), "answers": list(answers.values())}), flush=True)
sys.stdin.read()
"""


def test_one_key_holds_at_most_its_share_of_the_workers_while_another_key_is_served(gateway) -> None:
    # 2 workers x (2 slots + 4 queued) = 12 at a time; one key holds at most half (conns_per_key's default).
    holder = subprocess.Popen(
        ["docker", "exec", "-i", OTHER, "python3", "-c", HOLD, gateway, str(LLAMA_GATEWAY), "12", KEY, "2"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        got = json.loads(holder.stdout.readline())
        # The same key from another address is refused too; another key is served meanwhile.
        same_key, other_key = requests(
            GATEWAY,
            [
                completion(gateway, 1) | {"timeout": 10},
                completion(gateway, 2) | {"headers": {"Authorization": f"Bearer {OTHER_KEY}"}, "timeout": 10},
            ],
            parallel=2,
        )
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert got["held"] == 6, got
    assert all(a.startswith("HTTP/1.1 429") and "too_many_connections" in a for a in got["answers"]), got["answers"][:2]
    assert same_key["status"] == 429 and error_of(same_key)["code"] == "too_many_connections", same_key
    assert "with the API key ci (conns_per_key 6)" in error_of(same_key)["message"], same_key
    assert other_key["status"] == 200, other_key
    # Once the key's requests are gone, the key is served again.
    wait_for("key ci served again", lambda: requests(OTHER, [completion(gateway, 3)])[0]["status"] == 200, timeout=30)


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
    # (span: one worker over both nodes, headed on the gateway's node; test_llamacpp_rpc.py)
    everywhere = {(service, node) for service in ("embed", "generate", "llama") for node in NODES}
    assert in_flight == everywhere | {("span", GATEWAY)}, in_flight
    # ...and llama-server, which counts no requests, has no request rate rather than a made-up one.
    services = {s["metric"]["service"] for s in prometheus("budgetgpu_inference:requests:rate5m")}
    assert services == {"embed", "generate"}, services
    up = {(s["metric"]["service"], s["value"][1]) for s in prometheus('up{job="inference"}')}
    assert up == {("embed", "1"), ("generate", "1"), ("llama", "1"), ("span", "1")}, up
