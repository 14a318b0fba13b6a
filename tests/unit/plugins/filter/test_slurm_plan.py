"""Role slurm's plan filter (plugins/filter/slurm.py slurm_plan): one call that gives the role its nodes, the lines
of slurm.conf, gres.conf and the hosts file, and its batch jobs, from the plugin_utils/slurm.py and slurm_batch.py
functions (tested in tests/unit/plugins/plugin_utils/); the role calls no other filter that only it used."""

from __future__ import annotations

import pytest
from ansible.errors import AnsibleFilterError
from ansible_collections.budgetgpu.cluster.plugins.filter.slurm import FilterModule, slurm_plan

LAYOUT = {"processor_vcpus": 32, "processor_count": 2, "processor_cores": 8, "processor_threads_per_core": 2}


def facts(hostname: str, address: str, memtotal_mb: int, *device_ids: str) -> dict:
    """A GPU node's setup facts and probes, its GPUs on the first socket."""
    buses = [f"0000:0{i + 1}:00.0" for i in range(len(device_ids))]
    return {
        "ansible_facts": {
            **LAYOUT,
            "hostname": hostname,
            "memtotal_mb": memtotal_mb,
            "budgetgpu_gpus": {"gpus": [{"index": i, "uuid": f"GPU-{i}", "bus_id": b} for i, b in enumerate(buses)]},
            "budgetgpu_pcie": {
                "gpus": [{"bus_id": b, "device_id": d, "numa_node": 0} for b, d in zip(buses, device_ids, strict=True)]
            },
            "budgetgpu_net": {"cluster_interface": {"address": address}},
        }
    }


HOSTVARS = {
    "node1": facts("node1", "10.0.0.11", 128000, "0x2204", "0x2204"),
    "node2": facts("node2", "10.0.0.12", 64000, "0x2684"),
}
INPUTS = {
    "hosts": ["node1", "node2"],
    "hostvars": HOSTVARS,
    "services": [],
    "margin_pct": 5,
    "absent": [],
    "recorded": "",
    "jobs": [{"name": "pretrain", "script": "/srv/train.py", "gpu_type": "rtx3090", "gpus_per_node": 2}],
    "host": "node1",
}


def test_the_plan_says_each_nodes_lines_and_checks_the_jobs_against_them() -> None:
    plan = slurm_plan(INPUTS)
    assert [node["name"] for node in plan["nodes"]] == ["node1", "node2"]
    assert plan["conf_lines"] == {
        "node1": "NodeName=node1 NodeAddr=10.0.0.11 CPUs=32 Sockets=2 CoresPerSocket=8 ThreadsPerCore=2 "
        "RealMemory=121600 Gres=gpu:rtx3090:2 State=UNKNOWN",
        "node2": "NodeName=node2 NodeAddr=10.0.0.12 CPUs=32 Sockets=2 CoresPerSocket=8 ThreadsPerCore=2 "
        "RealMemory=60800 Gres=gpu:rtx4090:1 State=UNKNOWN",
    }
    assert plan["gres_lines"] == [
        "NodeName=node1 Name=gpu Type=rtx3090 File=/dev/nvidia0 Cores=0-7",
        "NodeName=node1 Name=gpu Type=rtx3090 File=/dev/nvidia1 Cores=0-7",
        "NodeName=node2 Name=gpu Type=rtx4090 File=/dev/nvidia0 Cores=0-7",
    ]
    assert [line.split('"host":')[1][:8] for line in plan["record_lines"]] == ['"node1",', '"node2",']
    # The smallest node's share: 60800 MiB over 32 CPUs.
    assert plan["def_mem_per_cpu"] == 1900
    assert plan["batch_jobs"][0]["sbatch"] == ["--job-name=pretrain", "--nodes=1", "--gres=gpu:rtx3090:2"]


def test_a_job_no_node_can_run_fails_the_task_naming_it() -> None:
    plan = FilterModule().filters()["slurm_plan"]
    with pytest.raises(AnsibleFilterError, match=r"node1: slurm_jobs\[pretrain\]"):
        plan({**INPUTS, "jobs": [{**INPUTS["jobs"][0], "gpus_per_node": 3}]})
