"""Who may open a node's GPUs: the group's one name, the driver's device file options, the DeviceAllow= entries
of a unit that holds some GPUs (never a rule that opens them all), and what a unit of the roles renders."""

from __future__ import annotations

import pytest
from ansible_collections.budgetgpu.cluster.plugins.module_utils import device_allow
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils import gpu_devices, jobs
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.nodes import cluster_nodes
from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import render_job_unit

PROC_DEVICES_550 = """Character devices:
  1 mem
195 nvidia
195 nvidiactl
234 nvidia-caps-imex-channels
236 nvidia-nvlink
237 nvidia-caps
508 nvidia-uvm
"""


def opens(entries: list[str], major: int, minor: int) -> bool:
    rules = device_allow.parse_device_allow(entries)
    groups = device_allow.parse_proc_devices(PROC_DEVICES_550)
    return device_allow.node_allowed(rules, groups, major, minor, stat_char=lambda _path: None)


def test_the_group_is_budgetgpu_gpu_unless_the_inventory_names_one():
    assert gpu_devices.gpu_group(None) == gpu_devices.gpu_group("") == "budgetgpu-gpu"
    assert gpu_devices.gpu_group("hpc-gpu") == "hpc-gpu"


@pytest.mark.parametrize("bad", ["GPU", "9gpu", "a b", "x" * 33, ["budgetgpu-gpu"], "gpu;rm"])
def test_a_group_name_that_is_not_one_is_refused_naming_the_variable(bad):
    with pytest.raises(ValueError, match=r"^budgetgpu_gpu_group: found .*, expected a group name"):
        gpu_devices.gpu_group(bad)


def test_the_driver_options_make_the_files_roots_mode_0660_of_the_group():
    assert gpu_devices.driver_device_options(997) == {
        "NVreg_DeviceFileUID": "0",
        "NVreg_DeviceFileGID": "997",
        "NVreg_DeviceFileMode": "0660",
    }
    with pytest.raises(ValueError, match="expected the number of the group"):
        gpu_devices.driver_device_options(None)


def test_a_unit_opens_its_gpus_and_the_control_nodes_and_no_other_gpu():
    gpus = [{"index": i, "uuid": f"GPU-{i}"} for i in range(4)]
    allow = gpu_devices.unit_device_allow(gpus, [2])
    assert allow == ["/dev/char/195:2 rw", "/dev/char/195:254 rw", "/dev/char/195:255 rw"]
    assert opens(allow, 195, 2) and opens(allow, 195, 255)
    assert [minor for minor in (0, 1, 3) if opens(allow, 195, minor)] == []


def test_the_probes_minor_number_wins_over_the_index():
    gpus = [{"index": 0, "minor_number": 1}, {"index": 1, "minor_number": 0}]
    assert gpu_devices.gpu_minors(gpus, [0]) == [1]
    # A GPU the facts do not list (driver not loaded at the probe) stands for its index.
    assert gpu_devices.gpu_minors([], [3, 1]) == [1, 3]


def test_the_old_group_rule_opened_every_gpu_and_is_no_longer_enough_for_the_gpus_alone():
    assert opens(["char-nvidia rw"], 195, 3)  # what the units had: every GPU of the node
    uncovered = device_allow.uncovered_groups(["char-nvidia-uvm rw"], PROC_DEVICES_550)
    assert (195, "nvidiactl") in uncovered
    assert "/dev/char/195:255 rw" in device_allow.uncovered_message(uncovered)
    assert (195, "nvidia") not in device_allow.uncovered_groups(
        ["/dev/char/195:255 rw", "char-nvidia-* rw"], PROC_DEVICES_550
    )


def plan_on_a_4_gpu_node(nproc: int) -> dict:
    gpus = {"driver": {"state": "loaded"}, "count": 4, "gpus": [{"index": i, "uuid": f"GPU-{i}"} for i in range(4)]}
    hostvars = {"node1": {"ansible_facts": {"budgetgpu_gpus": gpus}}}
    nodes = cluster_nodes(hostvars, ["node1"])
    job = {"name": "main", "script": "/srv/train.py", "nodes": "all", "nproc_per_node": nproc}
    (job,) = jobs.torchrun_jobs_normalize([job])
    return jobs.torchrun_plan([job], "node1", {"all": ["node1"]}, nodes)[0]


def test_a_jobs_plan_opens_the_gpus_of_its_ranks_only():
    """A job of 2 ranks on a 4-GPU node (an inference worker may hold GPU 3): its unit opens GPUs 0 and 1."""
    job = plan_on_a_4_gpu_node(2)
    assert job["gpu_indices"] == [0, 1]
    assert [minor for minor in range(4) if opens(job["device_allow"], 195, minor)] == [0, 1]
    assert plan_on_a_4_gpu_node("gpu")["gpu_indices"] == [0, 1, 2, 3]


def test_a_training_unit_opens_only_the_gpus_of_its_ranks_and_gets_the_group(tmp_path):
    job = plan_on_a_4_gpu_node(2)
    unit = render_job_unit(tmp_path, {"budgetgpu_gpu_group": "hpc-gpu", "_torchrun_job": job}).read_text()
    allow = [line.split("=", 1)[1] for line in unit.splitlines() if line.startswith("DeviceAllow=")]
    assert "SupplementaryGroups=hpc-gpu" in unit.splitlines()
    assert [minor for minor in range(4) if opens(allow, 195, minor)] == [0, 1], allow
    assert opens(allow, 195, 255) and opens(allow, 508, 0)  # nvidiactl, nvidia-uvm
