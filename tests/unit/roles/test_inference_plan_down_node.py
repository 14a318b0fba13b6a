"""roles/inference's plan (tasks/plan.yml) on the gateway when a node of the service has no GPU facts in the
run (issue 40 item 7: switched off at the nightly run, its cached facts expired, or left out by --limit): the
gateway keeps the node's servers of the config the last run wrote, names it, and plans the other nodes' workers.
Before, the plan failed on the node's missing facts and no gateway of a service on it was configured."""

from __future__ import annotations

import json
from pathlib import Path

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference import services
from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import local_inventory, output_of, run_playbook

REPO = Path(__file__).resolve().parents[3]
GPUS = {
    "driver": {"state": "loaded", "version": "550.54.14"},
    "count": 1,
    "gpus": [{"index": 0, "name": "NVIDIA GeForce RTX 3090", "uuid": "GPU-30900000", "memory_total_mib": 24576}],
}
LAST_RUN = """\
upstream budgetgpu_embed {
    least_conn;
    server 10.0.0.11:8100 max_conns=12 max_fails=3 fail_timeout=5s;  # node node1
    server 10.0.0.12:8100 max_conns=12 max_fails=3 fail_timeout=5s;  # node node2
    server 10.0.0.12:8101 max_conns=12 max_fails=3 fail_timeout=5s;  # node node2
}
"""


def test_the_gateway_keeps_a_down_nodes_servers_of_the_last_run_and_names_it(tmp_path):
    service = services.inference_services_normalize(
        [{"name": "embed", "model": "/srv/minilm", "task": "embeddings", "nodes": ["node1", "node2"]}]
    )
    (tmp_path / "budgetgpu-inference-embed.conf").write_text(LAST_RUN)
    out = tmp_path / "gateways.json"
    playbook = f"""\
- name: Plan the inference services on the gateway, node2 down
  hosts: node1
  gather_facts: false
  vars:
    _inference_all: "{{{{ budgetgpu_inference_services }}}}"
    _inference_nginx_conf_dir: {tmp_path}
    _inference_head_rpc: false
    inference_api_keys: {{ci: 0123456789abcdef0123456789abcdef}}
    inference_gateway_allow: []
    budgetgpu_cluster_subnet: 10.0.0.0/24
  tasks:
    - name: Plan
      ansible.builtin.import_tasks: {REPO}/roles/inference/tasks/plan.yml
    # The second plan of a head whose llama-server has no GPU (install.yml), under main.yml's condition, which the
    # included tasks inherit: the plan stays whole meanwhile (it emptied it, and every later task was skipped).
    - name: Plan again
      when: _inference_plan | length > 0 or _inference_gateways | length > 0
      block:
        - name: Plan again
          ansible.builtin.include_tasks: {REPO}/roles/inference/tasks/plan.yml
    - name: Keep the gateways' plan
      ansible.builtin.copy:
        content: "{{{{ _inference_gateways | to_json }}}}"
        dest: {out}
        mode: "0644"
"""
    hosts = {
        "node1": {"budgetgpu_gpus": GPUS, "ansible_host": "10.0.0.11", "budgetgpu_inference_services": service},
        # Down: in the inventory, no facts in this run.
        "node2": {"ansible_host": "10.0.0.12"},
    }
    result = run_playbook(tmp_path, playbook, {}, inventory=local_inventory(tmp_path, hosts))
    assert result.returncode == 0, output_of(result)
    (gateway,) = json.loads(out.read_text())
    assert [(server["address"], server["node"]) for server in gateway["upstreams"]] == [
        ("10.0.0.11:8100", "node1"),
        ("10.0.0.12:8100", "node2"),
        ("10.0.0.12:8101", "node2"),
    ]
    assert gateway["stale"] == ["node2"]
    said = " ".join(result.stdout.split())
    assert "node2: no GPU facts in this run (down or left out): the gateway of service embed keeps the servers" in said
