"""A node's users are not trusted by its workers (issue 40 item 2): a job on a worker's node (any local user
but root, NGINX's www-data and, where Prometheus runs, its user) cannot call a worker directly at the
address it listens on, the node's own, nor, on the gateway's node, a worker of another node (which admits the
gateway's address); the gateway still serves it, with a key. Role firewall's chain output checks
each new local connection's socket owner. Reads only: the nodes stay as the other tests left them."""

from __future__ import annotations

import json
import subprocess

from test_inference import CLIENT, EMBED_GATEWAY, EMBED_PORT, GATEWAY, KEY, NODES, OTHER, address


def call_as(user: str, node: str, url: str, body: dict | None = None, key: str | None = None) -> dict:
    """One request from a process of `user` on `node` (docker exec --user: that uid, no root)."""
    spec = {"url": url, "timeout": 10, "body": body, "headers": {"Authorization": f"Bearer {key}"} if key else {}}
    proc = subprocess.run(
        ["docker", "exec", "--user", user, node, "python3", "-c", CLIENT, json.dumps([spec]), "1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)[0]


def test_a_job_on_a_workers_node_cannot_call_the_worker_but_the_gateway_serves_it() -> None:
    for node in NODES:
        # The workers listen on the node's cluster address (not loopback): a job there is a local client.
        url = f"http://{address(node)}:{EMBED_PORT}/health"
        # A job's user: refused at once (a reset), before the worker sees the request.
        refused = call_as("nobody", node, url)
        assert refused["status"] is None and "Connection refused" in str(refused["error"]), (node, refused)
        # Root (Ansible, the tests) and NGINX's user still reach it: the port is open, the uid decides.
        assert call_as("root", node, url)["status"] == 200, (node, url)
        assert call_as("www-data", node, url)["status"] == 200, (node, url)
    # node2's worker admits the gateway's address, whoever sends from it: on the gateway's node the job is refused on
    # its way out (client_only), NGINX's user and Prometheus' still reach it.
    remote = f"http://{address(OTHER)}:{EMBED_PORT}/health"
    refused = call_as("nobody", GATEWAY, remote)
    assert refused["status"] is None and "Connection refused" in str(refused["error"]), refused
    assert call_as("www-data", GATEWAY, remote)["status"] == 200
    assert call_as("prometheus", GATEWAY, f"http://{address(OTHER)}:{EMBED_PORT}/metrics")["status"] == 200
    # Prometheus' user scrapes the workers of its own node (inference-node1 is the Prometheus host).
    assert call_as("prometheus", GATEWAY, f"http://{address(GATEWAY)}:{EMBED_PORT}/metrics")["status"] == 200
    # The same job through the gateway, with a key: served.
    body = {"model": "embed", "input": ["local access"]}
    served = call_as("nobody", GATEWAY, f"http://{address(GATEWAY)}:{EMBED_GATEWAY}/v1/embeddings", body, KEY)
    assert served["status"] == 200, served
    output = subprocess.run(
        ["docker", "exec", GATEWAY, "nft", "list", "chain", "inet", "budgetgpu_inference", "output"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "meta skuid" in output and "reject with tcp reset" in output, output
