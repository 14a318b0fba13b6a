"""roles/inference's gateway config (nginx.conf.j2) passes only what the service serves (issue 40): the
OpenAI paths of its task by exact name, of the client's headers only Content-Type (an allow-list: the
key and llama-server's X-Conversation-Id stay at NGINX), and one API key holds at most conns_per_key
requests at a time, below what the workers admit together. molecule/inference runs it for real."""

from __future__ import annotations

import re
from pathlib import Path

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference import gateway, services
from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import output_of, run_playbook

REPO = Path(__file__).resolve().parents[3]
PLAYBOOK = """\
- name: Render one service's gateway config
  hosts: all
  gather_facts: false
  tasks:
    - name: Render
      ansible.builtin.template:
        src: "{{ test_repo }}/roles/inference/templates/nginx.conf.j2"
        dest: "{{ test_out }}"
        mode: "0644"
      vars:
        _inference_keys_dir: /etc/nginx/budgetgpu-keys
        _inference_max_fails: 3
        _inference_fail_timeout_s: 5
        _inference_connect_timeout_s: 1
        _inference_client_timeout_s: 10
"""
UPSTREAMS = [
    {"address": "10.0.0.11:8300", "node": "node1"},
    {"address": "10.0.0.11:8301", "node": "node1"},
    {"address": "10.0.0.12:8300", "node": "node2"},
    {"address": "10.0.0.12:8301", "node": "node2"},
]


def render(tmp_path: Path, service: dict, stale: list | None = None) -> str:
    out = tmp_path / "gateway.conf"
    entry = {
        "service": service,
        "upstreams": UPSTREAMS,
        "stale": stale or [],
        "rates": {100: ["ci"]},
        "listen": "10.0.0.11",
        "gateway_port": 8082,
        "body_limits": gateway.inference_body_limits(service),
        "max_conns": gateway.inference_max_conns(service),
        "routes": gateway.inference_gateway_routes(service, len(UPSTREAMS)),
    }
    result = run_playbook(
        tmp_path, PLAYBOOK, {"test_repo": str(REPO), "test_out": str(out), "_inference_svc": entry}, host="node1"
    )
    assert result.returncode == 0, output_of(result)
    return out.read_text()


def test_the_gateway_passes_the_tasks_paths_and_content_type_only_and_bounds_each_key(tmp_path):
    service = services.inference_services_normalize(
        [{"name": "llama", "model": "/srv/tiny.gguf", "task": "generation", "engine": "llamacpp", "concurrency": 2,
          "queue": 4}]
    )[0]  # fmt: skip
    text = render(tmp_path, service)
    served = re.findall(r"^\s*location (= )?(\S+) \{", text, re.MULTILINE)
    assert [path for exact, path in served if not path.startswith("@")] == [
        "/health",
        "/metrics",
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/",
    ]
    # Only exact paths pass (no prefix under /v1/: llama-server's /v1/stream, /v1/messages); "/" answers 404.
    assert all(exact == "= " for exact, path in served if path not in ("/",) and not path.startswith("@"))
    catch_all = text.split("location / {", 1)[1].split("}", 1)[0]
    assert "return 404" in catch_all and "proxy_pass" not in catch_all
    # Headers: an allow-list in every proxied location.
    proxied = text.count("proxy_pass http://budgetgpu_llama;")
    assert proxied == 4 == text.count("proxy_pass_request_headers off;")
    forwarded = set(re.findall(r"proxy_set_header (\S+) (\S+);", text))
    assert forwarded == {
        ("Connection", '""'),
        ("Host", "$proxy_host"),
        ("X-Request-Id", "$request_id"),
        ("Content-Type", "$http_content_type"),
    }
    assert "$proxy_add_x_forwarded_for" not in text
    # Methods: each served path takes OpenAI's, before any key is asked for; the rest is a 405 naming them
    # (/metrics answers 404 to every method).
    blocks = dict(re.findall(r"^\s*location = (\S+) \{(.*?)^    \}", text, re.MULTILINE | re.DOTALL))
    taken = {
        path: re.search(r"if \(\$request_method !~ \^\((\S+)\)\$\)", blocks[path])[1]
        for path in blocks
        if path != "/metrics"
    }
    assert taken == {
        "/health": "GET|HEAD",
        "/v1/models": "GET|HEAD",
        "/v1/completions": "POST",
        "/v1/chat/completions": "POST",
    }, taken
    chat = blocks["/v1/chat/completions"]
    assert chat.index("return 405") < chat.index("$http_authorization")
    assert 'add_header Allow "POST" always;' in chat and '"code":"method_not_allowed"' in chat
    # Each key: 4 workers x (2 + 4) admit 24 at a time; one key holds at most half.
    assert "limit_conn_zone $budgetgpu_llama_key zone=budgetgpu_llama_keys:1m;" in text
    assert text.count("limit_conn budgetgpu_llama_keys 12;") == 3
    assert "max_conns=6 " in text


def test_a_services_own_conns_per_key_and_embeddings_paths(tmp_path):
    service = services.inference_services_normalize(
        [{"name": "embed", "model": "/srv/minilm", "task": "embeddings", "gateway": {"conns_per_key": 50}}]
    )[0]
    text = render(tmp_path, service)
    assert re.findall(r"location = (/v1/\S+) \{", text) == ["/v1/models", "/v1/embeddings"]
    assert text.count("limit_conn budgetgpu_embed_keys 50;") == 2


def test_each_server_names_its_node_and_the_next_run_reads_them_back(tmp_path):
    # Issue 40 item 7: a node without GPU facts at the next run keeps its servers of this config
    # (gateway.recorded_upstreams reads them back); a stale node is named above the upstream block.
    embed = {"name": "embed", "model": "/srv/minilm", "task": "embeddings"}
    service = services.inference_services_normalize([embed])[0]
    text = render(tmp_path, service, stale=["node2"])
    assert gateway.recorded_upstreams(text) == {
        "node1": ["10.0.0.11:8300", "10.0.0.11:8301"],
        "node2": ["10.0.0.12:8300", "10.0.0.12:8301"],
    }
    assert "# Stale: node2 had no GPU facts in the run that wrote this" in text
    # Every server keeps NGINX's failure accounting: a down node's servers leave the rotation after
    # max_fails failures for fail_timeout, and a request they fail is passed to the next worker.
    server = r"^    server \S+ max_conns=\d+ max_fails=3 fail_timeout=5s;  # node node\d$"
    assert len(re.findall(server, text, re.MULTILINE)) == 4
    assert "proxy_next_upstream error timeout non_idempotent;" in text
    assert "proxy_next_upstream_tries 4;" in text
    assert "# Stale" not in render(tmp_path, service)
