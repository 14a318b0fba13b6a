"""roles/inference's worker drop-in (worker.conf.j2) for a worker of two GPUs: both pinned by UUID,
each checked by the health watch before the start, the command engine told how many it has."""

from __future__ import annotations

from pathlib import Path

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference import placement, services
from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import output_of, run_playbook

REPO = Path(__file__).resolve().parents[3]
UUIDS = [f"GPU-3090000{i}-5a1e-4c0d-9b7e-00000000000{i}" for i in range(4)]
HOSTVARS = {
    "node1": {
        "group_names": ["inference_nodes"],
        "budgetgpu_gpus": {"gpus": [{"index": i, "uuid": u, "memory_total_mib": 24576} for i, u in enumerate(UUIDS)]},
        "ansible_host": "10.0.0.11",
    }
}
PLAYBOOK = """\
- name: Render one worker's drop-in
  hosts: all
  gather_facts: false
  tasks:
    - name: Render
      ansible.builtin.template:
        src: "{{ test_repo }}/roles/inference/templates/worker.conf.j2"
        dest: "{{ test_out }}"
        mode: "0644"
      vars:
        _inference_worker_script: /opt/budgetgpu/inference/inference_worker.py
        _inference_llama_server: /usr/local/lib/budgetgpu/llama-server
"""


def test_a_worker_of_two_gpus_is_pinned_to_both_and_each_is_health_checked(tmp_path):
    command = "vllm serve {model} --port {port} --tensor-parallel-size {gpus}"
    service = services.inference_services_normalize(
        [
            {
                "name": "chat",
                "model": "/srv/m",
                "task": "generation",
                "gpus_per_worker": 2,
                "engine": "command",
                "command": command,
                "nodes": ["node1"],
            }
        ]  # fmt: skip
    )[0]
    worker = placement.inference_workers(service, HOSTVARS, "node1", [])[1]
    out = tmp_path / "worker.conf"
    result = run_playbook(
        tmp_path,
        PLAYBOOK,
        {"test_repo": str(REPO), "test_out": str(out), "_inference_pair": [{"service": service}, worker]},
        host="node1",
    )
    assert result.returncode == 0, output_of(result)
    text = out.read_text()
    assert f"Environment=CUDA_VISIBLE_DEVICES={UUIDS[2]},{UUIDS[3]} CUDA_DEVICE_ORDER=PCI_BUS_ID" in text
    checks = [line for line in text.splitlines() if line.startswith("ExecCondition=")]
    assert [line.split()[-1] for line in checks] == [UUIDS[2], UUIDS[3]]
    assert '"--port" "8101" "--tensor-parallel-size" "2"' in text
