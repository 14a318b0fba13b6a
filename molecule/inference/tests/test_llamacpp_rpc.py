"""One llama.cpp worker over both nodes (issue 43 items 4 and 5), service span of molecule.yml: llama-server on
inference-node1 (the head) with --rpc to ggml-rpc-server on inference-node2, both on GPU 1. Through the gateway
with the official openai client; the RPC server killed during a run of requests: the head aborts (llama.cpp's
behaviour), the units bring the group back (the RPC server's unit, then the head's, which waits for it) and the
gateway answers 503 with Retry-After meanwhile, never 502; the RPC port admits the head alone. An RPC node that
stays down (issue 43 item 4's last sentence): the head's unit ends failed at its start limit, naming the node, with
an alert and no restart loop, the gateway answers 503 with Retry-After throughout, and the role's recovery
(reset-failed, then a start) serves again once the node is back.

A CPU build has no GPU device of its own (llama-server --list-devices: none), so the head serves its own node's GPU
through an RPC server of its own on loopback, the last of its --rpc (the role's head_rpc): the layers land on both
nodes. llama-server's default log level does not print the split; the first test raises it for one start of the
head. The helpers are test_inference.py's; these run after test_llamacpp.py's."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time

from test_inference import GATEWAY, KEY, OTHER, gpu_uuids, healthy, main_pid, sh, wait_for

SPAN_PORT, SPAN_GATEWAY = 8400, 8083  # molecule.yml: service span; its RPC server listens on node2's port 8400
OWN_PORT = 8401  # the head's own RPC server: 127.0.0.1, port + the head's GPUs of span (1) + slot (placement.py)
HEAD, RPC = "budgetgpu-infer-span@0.service", "budgetgpu-infer-span.rpc@0.service"
# A runtime drop-in (gone at the next daemon-reload once removed) that makes the head's llama-server log where its
# layers went; its default log level does not (about 25 lines a request at level 4: not the role's setting).
VERBOSE = f"/run/systemd/system/{HEAD}.d/verbose.conf"
RPC_SERVER = "/usr/local/lib/budgetgpu/ggml-rpc-server"

# Runs on a node: prints the remote IPv4 address of each established TCP connection to local port argv[1].
PEERS = r"""
import socket, struct, sys
for line in open("/proc/net/tcp").readlines()[1:]:
    local, remote, state = line.split()[1:4]
    if state == "01" and int(local.split(":")[1], 16) == int(sys.argv[1]):
        print(socket.inet_ntoa(struct.pack("<I", int(remote.split(":")[0], 16))))
"""

# Runs on a node: one completion at a time to argv[1] for at most argv[2] seconds, until 5 answers in a row are 200
# after one that was not; prints [{t, status, retry_after, error}] (t: seconds since the start).
RUN = r"""
import json, sys, time, urllib.error, urllib.request
url, limit, key = sys.argv[1], float(sys.argv[2]), sys.argv[3]
body = json.dumps({"model": "span", "prompt": "The cat", "max_tokens": 4}).encode()
seen, start, failed, good = [], time.monotonic(), False, 0
while time.monotonic() - start < limit and not (failed and good >= 5):
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json",
                                                          "Authorization": f"Bearer {key}"})
    out = {"t": round(time.monotonic() - start, 2), "status": None, "retry_after": None, "error": None}
    try:
        with urllib.request.urlopen(req, timeout=30) as answer:
            out["status"] = answer.status
            answer.read()
    except urllib.error.HTTPError as err:
        out["status"], out["retry_after"] = err.code, err.headers.get("Retry-After")
    except Exception as err:
        out["error"] = f"{type(err).__name__}: {err}"
    failed = failed or out["status"] != 200
    good = good + 1 if failed and out["status"] == 200 else 0
    seen.append(out)
    time.sleep(0.2)
print(json.dumps(seen))
"""


def test_one_worker_spans_both_nodes_its_head_connected_to_the_rpc_server_on_the_other(addresses) -> None:
    url = f"http://{addresses[GATEWAY]}:{SPAN_PORT}/health"
    wait_for(url, lambda: healthy(GATEWAY, url), timeout=120)
    argv = sh(GATEWAY, f"cat /proc/{main_pid(GATEWAY, HEAD)}/cmdline").split("\0")
    assert argv[argv.index("--rpc") + 1] == f"{addresses[OTHER]}:{SPAN_PORT},127.0.0.1:{OWN_PORT}", argv
    # No head on node2: one worker over both. Each node's GPU 1 behind an RPC server as the workers' user: node2's
    # on its cluster address, the head's own on loopback.
    assert main_pid(OTHER, HEAD) in ("", "0")
    for node, address, port in ((OTHER, addresses[OTHER], SPAN_PORT), (GATEWAY, "127.0.0.1", OWN_PORT)):
        pid = main_pid(node, RPC)
        rpc = sh(node, f"cat /proc/{pid}/cmdline").split("\0")
        assert rpc[:6] == [RPC_SERVER, "--host", address, "--port", str(port), "--cache"], (node, rpc)
        assert sh(node, f"stat -c %U /proc/{pid}").strip() == "budgetgpu-infer"
        env = sh(node, f"systemctl show -p Environment --value {RPC}").split()
        assert f"CUDA_VISIBLE_DEVICES={gpu_uuids(node)[1]}" in env, (node, env)
    # The head holds its connection to node2's server.
    peers = sh(OTHER, f"python3 -c '{PEERS}' {SPAN_PORT}").split()
    assert addresses[GATEWAY] in peers, peers


def model_buffers(since: int) -> dict[str, float]:
    """{RPC server's address:port: MiB of the model's layers on it} that the head's llama-server logged since."""
    journal = sh(GATEWAY, f"journalctl -u {HEAD} --since @{since} -o cat --no-pager")
    found = re.findall(r"RPC\d+\[([^\]]+)\] model buffer size = +([\d.]+) MiB", journal)
    return {server: float(mib) for server, mib in found}


def test_the_split_models_layers_are_on_the_rpc_server_of_each_node(addresses) -> None:
    since = int(time.time())  # the containers' clock is this host's
    sh(GATEWAY, f"mkdir -p {VERBOSE.rsplit('/', 1)[0]} && printf '[Service]\\nEnvironment=LLAMA_ARG_LOG_VERBOSITY=4\\n'"
                f" > {VERBOSE} && systemctl daemon-reload && systemctl restart {HEAD}")  # fmt: skip
    try:
        wait_for("the head's model buffers in its journal", lambda: len(model_buffers(since)) >= 2, 60)
    finally:
        # The drop-in goes; the head keeps its log level until its next start (the kill test's). reset-failed: these
        # starts do not count against its start limit (3 in 2 minutes), which the next tests need.
        sh(GATEWAY, f"rm -f {VERBOSE} && systemctl daemon-reload && systemctl reset-failed {HEAD}")
    # node2's server (RPC0: the first layers) and the head's own (RPC1: the last and the output), both > 0 MiB.
    buffers = model_buffers(since)
    assert sorted(buffers) == sorted([f"{addresses[OTHER]}:{SPAN_PORT}", f"127.0.0.1:{OWN_PORT}"]), buffers
    assert all(mib > 0 for mib in buffers.values()), buffers
    print(f"span's layers: {buffers} MiB")
    url = f"http://{addresses[GATEWAY]}:{SPAN_PORT}/health"
    wait_for(url, lambda: healthy(GATEWAY, url), timeout=60)


def test_the_official_openai_client_completes_and_streams_through_the_gateway_of_the_split_model(gateway) -> None:
    script = f"""
import json, openai
client = openai.OpenAI(base_url="http://{gateway}:{SPAN_GATEWAY}/v1", api_key="{KEY}", max_retries=0)
extra = {{"ignore_eos": True}}
done = client.completions.create(model="span", prompt="The cat", max_tokens=8, extra_body=extra)
pieces = [c.choices[0].text for c in client.completions.create(
    model="span", prompt="The cat", max_tokens=6, stream=True, extra_body=extra) if c.choices]
print(json.dumps({{"tokens": done.usage.completion_tokens, "text": done.choices[0].text, "pieces": len(pieces)}}))
"""
    got = json.loads(sh(OTHER, f"/opt/test-clients/openai/bin/python - <<'EOF'\n{script}\nEOF"))
    assert got["tokens"] == 8 and got["text"] and got["pieces"] >= 2, got


def assert_served_then_503s_then_served(seen: list[dict]) -> None:
    """The answers of a run of requests across an outage: served; then 503s, each with Retry-After, and no 502 or
    broken answer; then served again."""
    statuses = [answer["status"] for answer in seen]
    assert statuses[0] == 200 and 503 in statuses, seen
    assert set(statuses) == {200, 503}, [answer for answer in seen if answer["status"] not in (200, 503)][:3]
    assert all(answer["retry_after"] for answer in seen if answer["status"] == 503), seen
    assert statuses[-5:] == [200] * 5, seen


def test_a_killed_rpc_server_costs_a_restart_with_503s_and_retry_after_never_a_502(addresses, gateway) -> None:
    head, rpc = main_pid(GATEWAY, HEAD), main_pid(OTHER, RPC)
    run = subprocess.Popen(
        ["docker", "exec", OTHER, "python3", "-c", RUN, f"http://{gateway}:{SPAN_GATEWAY}/v1/completions", "90", KEY],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(3)
    sh(OTHER, f"kill -KILL {rpc}")
    killed = time.monotonic()
    out, err = run.communicate(timeout=150)
    assert run.returncode == 0, err[-2000:]
    seen = json.loads(out)
    assert_served_then_503s_then_served(seen)
    first_503 = next(answer["t"] for answer in seen if answer["status"] == 503)
    back = next(answer["t"] for answer in seen if answer["t"] > first_503 and answer["status"] == 200)
    print(f"span served again {back - first_503:.1f} s after its first 503 ({time.monotonic() - killed:.1f} s wall)")
    assert back - first_503 < 60, seen
    # The RPC server's unit restarted it; the head aborted (llama.cpp's behaviour) and its unit restarted it.
    assert main_pid(OTHER, RPC) not in ("", "0", rpc) and main_pid(GATEWAY, HEAD) not in ("", "0", head)
    journal = sh(GATEWAY, f"journalctl -u {HEAD} --since '-5min' --no-pager")
    assert "Remote RPC server crashed" in journal, journal[-2000:]


def connects(node: str | None, user: str, address: str, port: int) -> bool:
    """Whether a TCP connection to address:port opens from `node` as `user` (None: this host, outside the
    cluster)."""
    if node is None:
        try:
            socket.create_connection((address, port), timeout=5).close()
        except OSError:
            return False
        return True
    probe = f"import socket; socket.create_connection(('{address}', {port}), timeout=5).close()"
    return subprocess.run(["docker", "exec", "--user", user, node, "python3", "-c", probe],
                          capture_output=True, timeout=60, check=False).returncode == 0  # fmt: skip


def test_the_rpc_port_admits_the_head_alone(addresses) -> None:
    rpc = addresses[OTHER]
    # The head's node (root, as the head's probe runs as the workers' user there too) connects...
    assert connects(GATEWAY, "root", rpc, SPAN_PORT)
    # ...the host outside the cluster and a user of node2 itself that is not root are reset.
    assert not connects(None, "", rpc, SPAN_PORT)
    assert not connects(OTHER, "nobody", rpc, SPAN_PORT)
    # node2 admits the head's address whoever sends from it: on the head's node, its llama-server's user connects and
    # another user is reset on its way out (client_only).
    assert connects(GATEWAY, "budgetgpu-infer", rpc, SPAN_PORT)
    assert not connects(GATEWAY, "nobody", rpc, SPAN_PORT)
    # The head's own RPC server: its llama-server's user on the node connects, another user is reset.
    assert connects(GATEWAY, "budgetgpu-infer", "127.0.0.1", OWN_PORT)
    assert not connects(GATEWAY, "nobody", "127.0.0.1", OWN_PORT)


# Runs on node2: drops every packet to the RPC port, so that the head's connects get no answer at all, as from a
# node switched off (a stopped server alone answers with a reset). test_an_rpc_node_that_stays_down... deletes it.
DROP = "budgetgpu_test_rpc_node_down"
NODE_DOWN = (
    f"nft add table inet {DROP} && nft add chain inet {DROP} input '{{ type filter hook input priority -10; }}'"
    f" && nft add rule inet {DROP} input tcp dport {SPAN_PORT} drop"
)
# What systemd logs of a unit it no longer starts (unit_test_start_limit).
LIMIT_HIT = "Start request repeated too quickly."
# Runs on node1: the alerts of span's workers in Prometheus (this scenario's, on node1) as JSON.
SPAN_ALERTS = """
import json, urllib.parse, urllib.request
query = urllib.parse.quote('ALERTS{alertname="BudgetgpuInferenceWorkerDown",service="span"}')
answer = json.loads(urllib.request.urlopen("http://127.0.0.1:9090/api/v1/query?query=" + query, timeout=5).read())
print(json.dumps([result["metric"] for result in answer["data"]["result"]]))
"""


def unit_state(node: str, unit: str) -> dict[str, str]:
    shown = sh(node, f"systemctl show -p ActiveState,Result,NRestarts,StartLimitBurst,StartLimitIntervalUSec {unit}")
    return dict(line.split("=", 1) for line in shown.splitlines() if "=" in line)


def span_alerts() -> list[dict]:
    return json.loads(sh(GATEWAY, f"python3 - <<'EOF'\n{SPAN_ALERTS}\nEOF"))


def test_an_rpc_node_that_stays_down_fails_the_head_at_its_start_limit_and_the_roles_recovery_serves_again(
    addresses, gateway
) -> None:
    # molecule.yml: the head waits 5 s for its RPC server and starts at most 3 times in 2 minutes.
    limits = unit_state(GATEWAY, HEAD)
    assert (limits["StartLimitBurst"], limits["StartLimitIntervalUSec"]) == ("3", "2min"), limits
    run = subprocess.Popen(
        ["docker", "exec", OTHER, "python3", "-c", RUN, f"http://{gateway}:{SPAN_GATEWAY}/v1/completions", "150", KEY],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(1)
    since = int(time.time())  # the containers' clock is this host's
    try:
        # node2's RPC server goes and stays gone (nothing answers on its port); the head aborts at its next request.
        sh(OTHER, f"systemctl stop {RPC} && {NODE_DOWN}")
        down = time.monotonic()
        # Failed at its start limit: systemd 252 (bookworm's) keeps the Result of the last start (exit-code) and
        # says so in the journal.
        state, journal = unit_state(GATEWAY, HEAD), ""
        while time.monotonic() < down + 90:
            if state["ActiveState"] == "failed":
                journal = sh(GATEWAY, f"journalctl -u {HEAD} --since @{since} --no-pager")
                if LIMIT_HIT in journal:
                    break
            time.sleep(0.5)
            state = unit_state(GATEWAY, HEAD)
        print(f"span's head failed at its start limit {time.monotonic() - down:.1f} s after its RPC node went: {state}")
        assert state["ActiveState"] == "failed" and LIMIT_HIT in journal, (state, journal[-3000:])
        failed = time.monotonic()
        # Its reason, naming the node, the address and the port it waited for: in its journal, and in its status
        # the failed wait's arguments (systemd 252's status shows the log of the last, refused, start only).
        reason = f"the llama.cpp RPC server of node {OTHER} ({addresses[OTHER]} port {SPAN_PORT}) does not answer"
        assert f"{reason} after 5 s" in journal, journal[-3000:]
        status = " ".join(sh(GATEWAY, f"systemctl status -l -n 60 --no-pager {HEAD}", check=False).split())
        # (node2's server, then the head's own: the wait's arguments in --rpc order.)
        waited = (
            f"rpc-wait 5 {OTHER} {addresses[OTHER]} {SPAN_PORT} {GATEWAY} 127.0.0.1 {OWN_PORT} "
            "(code=exited, status=1/FAILURE)"
        )
        assert waited in status and LIMIT_HIT in status, status
        # The alert on the head's /metrics that no longer answer (pending for prometheus_alert_for, then firing).
        alerts = wait_for("span's head in ALERTS", span_alerts, timeout=20)
        assert [(alert["unit"], alert["node"]) for alert in alerts] == [(HEAD, GATEWAY)], alerts
        assert alerts[0]["alertstate"] in ("pending", "firing"), alerts
        # No restart loop: nothing starts it again (RestartSec=2)...
        time.sleep(max(0.0, failed + 3 - time.monotonic()))
        later = unit_state(GATEWAY, HEAD)
        assert (later["ActiveState"], later["NRestarts"]) == ("failed", state["NRestarts"]), (state, later)
        # ...and systemd refuses a start, by hand too, for the rest of the window: hence the role's reset-failed.
        refused = subprocess.run(["docker", "exec", GATEWAY, "systemctl", "start", HEAD], capture_output=True,
                                 text=True, timeout=60, check=False)  # fmt: skip
        assert refused.returncode != 0 and unit_state(GATEWAY, HEAD)["ActiveState"] == "failed", refused.stderr
    finally:
        # The node is back: its RPC server's unit starts (at boot: enabled).
        sh(OTHER, f"nft delete table inet {DROP}", check=False)
        sh(OTHER, f"systemctl start {RPC}")
    # The recovery, as the role's run does it (tasks/run.yml): reset-failed, then enable --now.
    sh(GATEWAY, f"systemctl reset-failed {HEAD} && systemctl enable --now {HEAD}")
    out, err = run.communicate(timeout=200)
    assert run.returncode == 0, err[-2000:]
    seen = json.loads(out)
    assert_served_then_503s_then_served(seen)
    assert unit_state(GATEWAY, HEAD)["ActiveState"] == "active"
