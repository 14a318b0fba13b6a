"""slurm: the GRES type from the PCI device id, the node lines from the facts (CPU layout, RealMemory
with its margin), the GPUs joined from gpu_facts and pcie_facts with their device nodes and cores, the
GPUs that inference workers and training jobs hold left out, slurmd -G compared with the facts, and
what cgroup.conf may constrain."""

from __future__ import annotations

import copy

import pytest
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils import slurm
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.services import (
    INFERENCE_USER,
    inference_services_normalize,
)
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.slurm import (
    cgroup_settings,
    cpu_layout,
    gres_conf_lines,
    gres_problems,
    gres_type,
    mem_per_cpu,
    node_conf_line,
    real_memory,
    slurm_node,
    slurm_nodes,
)

TWO_SOCKETS = {
    "hostname": "node1",
    "processor_vcpus": 32,
    "processor_count": 2,
    "processor_cores": 8,
    "processor_threads_per_core": 2,
    "memtotal_mb": 128000,
}


def gpus(*devices: tuple[str, str, int | None]) -> dict:
    """gpu_facts and pcie_facts of GPUs given as (bus id, device id, NUMA node)."""
    return {
        "budgetgpu_gpus": {
            "gpus": [
                {"index": i, "uuid": f"GPU-{i}", "bus_id": bus.upper(), "name": "NVIDIA something"}
                for i, (bus, _d, _n) in enumerate(devices)
            ]
        },
        "budgetgpu_pcie": {
            "gpus": [{"bus_id": bus, "device_id": device, "numa_node": numa} for bus, device, numa in devices]
        },
        "budgetgpu_net": {"cluster_interface": {"address": "10.0.0.11"}},
    }


def hostvars(facts: dict, **more: dict) -> dict:
    return {"node1": {"ansible_facts": facts, "group_names": ["gpu_nodes"]}, **more}


MIXED = gpus(("0000:01:00.0", "0x2204", 0), ("0000:41:00.0", "0x2684", 1), ("0000:61:00.0", "0x2684", 1))


@pytest.mark.parametrize(
    ("device", "kind"),
    [("0x2204", "rtx3090"), ("0x2684", "rtx4090"), ("0x2335", "h200"), ("0x2203", "rtx3090ti"), (0x2204, "rtx3090")],
)
def test_gres_type_is_a_stable_name_of_the_device_id(device, kind):
    assert gres_type(device) == kind


def test_gres_type_of_an_unknown_id_names_the_id_and_a_bad_id_is_refused():
    assert gres_type("0x2B00") == "nvidia_2b00"
    with pytest.raises(ValueError, match="found PCI device id None, expected a hex id"):
        gres_type(None)


def test_real_memory_keeps_a_margin_and_at_least_512_mib():
    assert real_memory(128000, 5) == 121600
    assert real_memory(4096, 5) == 3584  # 5% would be 205 MiB only
    assert real_memory(128000, 0) == 127488
    with pytest.raises(ValueError, match="slurm_memory_margin_pct: found 100"):
        real_memory(128000, 100)
    with pytest.raises(ValueError, match="found memtotal_mb None"):
        real_memory(None)


def test_cpu_layout_from_the_facts_and_cpus_alone_where_they_do_not_multiply_out():
    assert cpu_layout(TWO_SOCKETS) == {"CPUs": 32, "Sockets": 2, "CoresPerSocket": 8, "ThreadsPerCore": 2}
    assert cpu_layout({**TWO_SOCKETS, "processor_count": 1}) == {"CPUs": 32}
    with pytest.raises(ValueError, match="found processor_vcpus None"):
        cpu_layout({})


def test_a_node_with_mixed_gpus_on_two_sockets():
    node = slurm_node(hostvars({**TWO_SOCKETS, **MIXED}), "node1")
    assert node["gres"] == "gpu:rtx3090:1,gpu:rtx4090:2"
    assert node["address"] == "10.0.0.11"
    assert node_conf_line(node) == (
        "NodeName=node1 NodeAddr=10.0.0.11 CPUs=32 Sockets=2 CoresPerSocket=8 ThreadsPerCore=2 "
        "RealMemory=121600 Gres=gpu:rtx3090:1,gpu:rtx4090:2 State=UNKNOWN"
    )
    assert gres_conf_lines(node) == [
        "NodeName=node1 Name=gpu Type=rtx3090 File=/dev/nvidia0 Cores=0-7",
        "NodeName=node1 Name=gpu Type=rtx4090 File=/dev/nvidia1 Cores=8-15",
        "NodeName=node1 Name=gpu Type=rtx4090 File=/dev/nvidia2 Cores=8-15",
    ]
    assert mem_per_cpu(node) == 3800


def test_cores_are_left_to_slurm_on_one_socket_or_an_unknown_numa_node_or_nps4():
    one_socket = {**TWO_SOCKETS, "processor_count": 1, "processor_cores": 16}
    assert [g["cores"] for g in slurm_node(hostvars({**one_socket, **MIXED}), "node1")["gpus"]] == [None] * 3
    unknown = gpus(("0000:01:00.0", "0x2204", None), ("0000:02:00.0", "0x2204", 3))
    assert [g["cores"] for g in slurm_node(hostvars({**TWO_SOCKETS, **unknown}), "node1")["gpus"]] == [None, None]


def test_the_driver_minor_number_names_the_device_node_where_the_probe_has_it():
    facts = gpus(("0000:01:00.0", "0x2204", 0))
    facts["budgetgpu_gpus"]["gpus"][0]["minor_number"] = 3
    assert slurm_node(hostvars({**TWO_SOCKETS, **facts}), "node1")["gpus"][0]["file"] == "/dev/nvidia3"


def test_gpus_that_inference_workers_and_training_jobs_hold_are_left_out():
    services = inference_services_normalize(
        [{"name": "embed", "model": "/m", "task": "embeddings", "nodes": ["node1"], "gpus": [2], "port": 8100}]
    )
    node = slurm_node(hostvars({**TWO_SOCKETS, **MIXED}), "node1", services)
    assert node["gres"] == "gpu:rtx3090:1,gpu:rtx4090:1"
    assert node["left_out"] == [
        {
            "index": 2,
            "bus_id": "0000:61:00.0",
            "file": "/dev/nvidia2",
            "why": "inference worker budgetgpu-infer-embed@0.service",
            "user": INFERENCE_USER,
        }
    ]
    jobs = [{"name": "main", "nodes": "gpu_nodes", "nproc_per_node": 1, "state": "started", "user": "alice"}]
    node = slurm_node(hostvars({**TWO_SOCKETS, **MIXED}), "node1", [], jobs)
    assert [g["index"] for g in node["left_out"]] == [0]
    assert node["left_out"][0]["why"] == "training job main"


def test_each_held_gpus_device_file_is_given_to_the_user_its_holders_unit_runs_as():
    """Issue 40 item 3: the device file by the driver's minor, and the user of the unit that holds it (the job's,
    the service's), which alone of the GPU group may open it (the role's ACL); the other GPUs are not held."""
    facts = copy.deepcopy({**TWO_SOCKETS, **MIXED})
    facts["budgetgpu_gpus"]["gpus"][2]["minor_number"] = 5
    services = inference_services_normalize(
        [{"name": "embed", "model": "/m", "task": "embeddings", "nodes": ["node1"], "gpus": [2], "port": 8100,
          "user": "llm"}]
    )  # fmt: skip
    jobs = [{"name": "main", "nodes": "gpu_nodes", "nproc_per_node": 1, "state": "started", "user": "alice"}]
    node = slurm_node(hostvars(facts), "node1", services, jobs)
    assert [(g["index"], g["file"], g["user"]) for g in node["left_out"]] == [
        (0, "/dev/nvidia0", "alice"),
        (2, "/dev/nvidia5", "llm"),
    ]
    assert [g["file"] for g in node["gpus"]] == ["/dev/nvidia1"]


def test_the_gpus_of_a_spanning_llamacpp_workers_rpc_node_are_left_out_even_while_its_head_is_down():
    service = {"name": "chat", "model": "/m.gguf", "task": "generation", "engine": "llamacpp", "nodes": "gpu_nodes",
               "nodes_per_worker": 2, "model_shape": {"layers": 2, "kv_heads": 2, "head_dim": 32}}  # fmt: skip
    services = inference_services_normalize([service])
    head = {"ansible_facts": {**TWO_SOCKETS, **MIXED, "hostname": "node0"}, "group_names": ["gpu_nodes"]}
    found = hostvars({**TWO_SOCKETS, **MIXED}, node0=head)
    rpc_node = {"node0": found.pop("node0"), **found}  # node0 first: the head of the worker group
    node = slurm_node(rpc_node, "node1", services)
    why = "llama.cpp RPC server of service chat"
    assert node["left_out"] == [{"index": i, "bus_id": MIXED["budgetgpu_pcie"]["gpus"][i]["bus_id"],
                                 "file": f"/dev/nvidia{i}", "why": why, "user": INFERENCE_USER}
                                for i in range(3)]  # fmt: skip
    assert node["gres"] == ""
    # The head without facts (down, or left out of the run): its RPC node's GPUs stay held all the same.
    down = {"node0": {"group_names": ["gpu_nodes"]}, **found}
    assert slurm_node(down, "node1", services)["left_out"] == node["left_out"]


def test_a_node_without_gpus_has_no_gres():
    node = slurm_node(hostvars({**TWO_SOCKETS, **gpus()}), "node1")
    assert node["gres"] == "" and "Gres=" not in node_conf_line(node) and gres_conf_lines(node) == []


def test_every_bad_node_is_named_with_what_it_lacks():
    broken = gpus(("0000:01:00.0", "0x2204", 0))
    broken["budgetgpu_pcie"]["gpus"] = []
    all_hostvars = {
        **hostvars({**TWO_SOCKETS, **broken}),
        "node2": {"ansible_facts": dict(TWO_SOCKETS)},
        "node3": {"ansible_facts": {**MIXED}},
    }
    with pytest.raises(ValueError) as error:
        slurm_nodes(["node1", "node2", "node3"], all_hostvars)
    assert str(error.value) == (
        "node1: GPU 0 (0000:01:00.0): found no PCI function in budgetgpu_pcie, expected one per GPU; "
        "node2: found no budgetgpu_gpus/budgetgpu_pcie facts, expected the probe's (run role probe); "
        "node3: found processor_vcpus None, expected the CPU count (gather facts)"
    )


SLURMD_G = """slurmd: Gres Name=gpu Type=rtx3090 Count=1 Index=0 ID=7696487 File=/dev/nvidia0 (null)
slurmd: Gres Name=gpu Type=rtx4090 Count=1 Index=1 ID=7696487 File=/dev/nvidia1 (null)
slurmd: Gres Name=gpu Type=rtx4090 Count=1 Index=2 ID=7696487 File=/dev/nvidia2 (null)
"""


def test_slurmd_finding_what_the_probe_found_is_no_problem():
    node = slurm_node(hostvars({**TWO_SOCKETS, **MIXED}), "node1")
    assert gres_problems(node, SLURMD_G) == []


def test_a_missing_device_node_and_a_gpu_the_probe_did_not_see_are_named():
    node = slurm_node(hostvars({**TWO_SOCKETS, **MIXED}), "node1")
    missing = SLURMD_G.splitlines()[0] + "\nslurmd: fatal: can't stat gres.conf file /dev/nvidia1: No such file\n"
    assert gres_problems(node, missing) == [
        "node1: GPU 1 (0000:41:00.0): slurmd found nothing at /dev/nvidia1, expected type rtx4090 (the probe's)",
        "node1: GPU 2 (0000:61:00.0): slurmd found nothing at /dev/nvidia2, expected type rtx4090 (the probe's)",
        "node1: slurmd -G says: slurmd: fatal: can't stat gres.conf file /dev/nvidia1: No such file",
    ]
    extra = SLURMD_G + "slurmd: Gres Name=gpu Type=rtx3090 Count=1 Index=3 ID=7696487 File=/dev/nvidia3 (null)\n"
    assert gres_problems(node, extra) == [
        "node1: slurmd found a rtx3090 GPU at /dev/nvidia3 that the probe did not, expected none"
    ]


def test_cgroup_v1_with_every_controller_constrains_everything():
    assert cgroup_settings("tmpfs", ["cpuset", "memory", "devices", "freezer", "cpu", "cpuacct"]) == {
        "plugin": "cgroup/v1",
        "constrain": {"ConstrainCores": True, "ConstrainRAMSpace": True, "ConstrainDevices": True},
        "proctrack_cgroup": True,
        "missing": [],
    }


def test_cgroup_v1_without_memory_or_freezer_says_what_is_not_constrained():
    settings = cgroup_settings("tmpfs", ["cpuset", "devices"])
    assert settings["constrain"] == {"ConstrainCores": True, "ConstrainRAMSpace": False, "ConstrainDevices": True}
    assert settings["proctrack_cgroup"] is False
    assert settings["missing"] == [
        "ConstrainRAMSpace=no: the kernel's cgroup v1 has no memory controller",
        "proctrack/linuxproc: the kernel's cgroup v1 has no freezer controller",
    ]


def test_cgroup_v2_needs_cpuset_and_memory_and_filters_devices_without_a_controller():
    settings = cgroup_settings("cgroup2fs", ["cpu", "memory", "pids"])
    assert settings["plugin"] == "cgroup/v2"
    assert settings["constrain"] == {"ConstrainCores": False, "ConstrainRAMSpace": True, "ConstrainDevices": True}
    assert settings["proctrack_cgroup"] is True
    assert settings["missing"] == ["ConstrainCores=no: the kernel's cgroup v2 has no cpuset controller"]


# --- cost per job and per user (the epilog's records) -----------------------------------------------


def _record(job: str, user: str, kwh: float, gpus: int = 2, end: float = 1000.0) -> dict:
    return {"job": job, "user": user, "gpus": list(range(gpus)), "start": end - 60, "end": end, "seconds": 60.0,
            "joules": {f"GPU-{i}": kwh * 3.6e6 / gpus for i in range(gpus)}, "kwh": kwh}  # fmt: skip


def test_a_job_on_two_nodes_is_summed_and_each_user_is_totalled():
    records = {
        "node1": [_record("41", "ana", 1.5), _record("42", "bo", 0.25)],
        "node2": [_record("41", "ana", 1.0), _record("43", "ana", 0.5, gpus=1)],
    }
    costs = slurm.job_costs(records, 0.20, "EUR")
    assert [(j["job"], j["nodes"], j["gpus"], round(j["kwh"], 3)) for j in costs["jobs"]] == [
        ("41", ["node1", "node2"], 4, 2.5), ("43", ["node2"], 1, 0.5), ("42", ["node1"], 2, 0.25)]  # fmt: skip
    assert [(u["user"], u["jobs"], round(u["cost"], 2)) for u in costs["users"]] == [("ana", 2, 0.6), ("bo", 1, 0.05)]
    assert costs["lines"][:3] == [
        "Slurm jobs: 3, GPU energy at 0.20 EUR/kWh",
        "  user ana: 2 job(s), 3.000 kWh, 0.60 EUR",
        "  user bo: 1 job(s), 0.250 kWh, 0.05 EUR",
    ]
    assert costs["lines"][3] == "  job 41 (ana, 4 GPU(s) on node1, node2): 2.500 kWh, 0.50 EUR"


def test_costs_take_the_guides_price_and_skip_what_is_not_a_record():
    costs = slurm.job_costs({"node1": [_record("7", "ana", 1.0), "junk", {"job": "8"}], "node2": None})
    assert costs["lines"] == ["Slurm jobs: 1, GPU energy at $0.12/kWh", "  user ana: 1 job(s), 1.000 kWh, $0.12",
                              "  job 7 (ana, 2 GPU(s) on node1): 1.000 kWh, $0.12"]  # fmt: skip


def test_port_ranges_that_are_good_and_apart_have_no_problem():
    ranges = {"slurm_srun_port_range": "60001-60100", "slurm_rendezvous_ports": " 29600 - 29999 "}
    assert slurm.port_range_problems(ranges, "node1") == []


@pytest.mark.parametrize("bad", ["29600", "29999-29600", "80-90", "29600-70000", "a-b", None])
def test_a_port_range_that_is_not_one_names_the_host_the_variable_and_what_was_found(bad):
    problems = slurm.port_range_problems({"slurm_rendezvous_ports": bad}, "node1")
    assert problems == [
        f"node1: slurm_rendezvous_ports: found {bad!r}, expected a port range LOW-HIGH within 1024-65535"
    ]


def test_overlapping_port_ranges_are_refused_by_name():
    ranges = {"slurm_srun_port_range": "29900-30100", "slurm_rendezvous_ports": "29600-29900"}
    assert slurm.port_range_problems(ranges, "node1") == [
        "node1: slurm_rendezvous_ports (29600-29900) overlaps slurm_srun_port_range (29900-30100),"
        " expected separate ranges"
    ]


SLURM_INPUTS = {
    "host": "ctl",
    "controller_host": "ctl",
    "all_hosts": ["ctl", "node1", "node2"],
    "controller_group": ["ctl"],
    "node_hosts": ["node1", "node2"],
    "play_hosts": ["ctl", "node1", "node2"],
    "srun_port_range": "60001-60100",
    "rendezvous_ports": "29600-29999",
    "checkpoint_root": "/srv/checkpoints",
}


def test_slurm_inputs_that_fit_have_no_problem():
    assert slurm.preflight_problems(SLURM_INPUTS) == []


def test_a_rendezvous_range_of_one_port_is_refused():
    """A batch job takes two ports of the range (budgetgpu_node.slurm_energy.job_ports)."""
    assert slurm.preflight_problems({**SLURM_INPUTS, "rendezvous_ports": "29600-29600"}) == [
        "ctl: slurm_rendezvous_ports: found '29600-29600', expected two ports or more"
        " (each batch job takes a pair: its rendezvous port and its workers' store port)"
    ]
    assert slurm.preflight_problems({**SLURM_INPUTS, "rendezvous_ports": "29600-29601"}) == []


def test_a_systemd_job_on_a_slurm_host_with_a_port_in_the_rendezvous_range_is_refused():
    """Table budgetgpu_slurm_jobs would reset the job's own connections (its user owns no element there)."""
    jobs = [
        {"name": "a", "nodes": "pair", "port": 29500, "store_port": 29700},
        {"name": "b", "nodes": "others", "port": 29650, "store_port": 30650},
        {"name": "c", "nodes": "pair", "port": 29650, "store_port": 30650, "state": "absent"},
    ]
    groups = {"pair": ["node1", "node2"], "others": ["node3"]}
    assert slurm.preflight_problems({**SLURM_INPUTS, "jobs": jobs, "groups": groups}) == [
        "node1, node2: job a: store_port: found 29700, expected a port outside slurm_rendezvous_ports (29600-29999) on"
        " a Slurm host (its table resets every connection to that range but root's and a running batch job's user's)"
    ]


def test_every_slurm_input_problem_names_the_host_and_the_variable():
    bad = {
        **SLURM_INPUTS,
        "controller_host": "ctrl",
        "controller_group": ["ctl", "ctl2"],
        "node_hosts": ["node1", "node3"],
        "rendezvous_ports": "29600",
        "checkpoint_root": "/srv/check points/",
    }
    assert slurm.preflight_problems(bad) == [
        'ctl: slurm_controller_host: found "ctrl", expected the one host of group slurm_controller',
        "ctl: group slurm_controller: found ctl, ctl2, expected one host (one slurmctld)",
        "ctl: slurm_node_hosts: node3 is not in this play, expected every node (their facts make slurm.conf)",
        "ctl: slurm_rendezvous_ports: found '29600', expected a port range LOW-HIGH within 1024-65535",
        'ctl: slurm_checkpoint_root: found "/srv/check points/", expected an absolute directory without spaces'
        " (each job keeps its checkpoints in <root>/<user>/<job id>)",
    ]
    assert slurm.preflight_problems({**SLURM_INPUTS, "node_hosts": [], "checkpoint_root": None}) == [
        "ctl: slurm_node_hosts: found none, expected the GPU nodes",
        "ctl: slurm_checkpoint_root: found null, expected an absolute directory without spaces"
        " (each job keeps its checkpoints in <root>/<user>/<job id>)",
    ]


def test_a_node_down_keeps_its_last_known_entry_and_is_marked_stale():
    """node2 is down at night: its cached facts expired an hour after the last run. Its entry from the hosts
    file the last run wrote stands in, marked stale, and node1 is configured from its facts as ever (before,
    every host's Slurm configuration failed on node2's missing facts)."""
    cgroup = {"_slurm_cgroup": {"proctrack_cgroup": True}}
    both = {**hostvars({**TWO_SOCKETS, **MIXED}, **{"node2": {}}), "node1": {**hostvars(MIXED)["node1"], **cgroup}}
    both["node1"]["ansible_facts"] = {**TWO_SOCKETS, **MIXED}
    last_run = slurm.slurm_node(both, "node1")
    recorded = "\n".join(
        [
            "# header",
            "node2 10.0.0.12",
            slurm.record_line({**last_run, "host": "node2", "name": "node2", "stale": True}),
        ]
    )
    nodes = slurm_nodes(["node1", "node2"], both, absent=["node2"], recorded=recorded)
    assert [(node["host"], "stale" in node) for node in nodes] == [("node1", False), ("node2", True)]
    assert nodes[0]["proctrack_cgroup"] is True
    assert node_conf_line(nodes[1]).startswith("NodeName=node2 NodeAddr=10.0.0.11 CPUs=32 ")
    assert gres_conf_lines(nodes[1])[0].startswith("NodeName=node2 Name=gpu Type=rtx3090 File=/dev/nvidia0")
    assert "stale" not in slurm.record_line(nodes[1])
    # Down and never recorded: refused, saying why.
    with pytest.raises(ValueError, match=r"node2: found processor_vcpus None.*\(not in this run: down or unreachable"):
        slurm_nodes(["node1", "node2"], both, absent=["node2"], recorded="# nothing\n")
    # In this run, a host without facts is refused whatever the record says.
    with pytest.raises(ValueError, match="node2: found processor_vcpus None, expected the CPU count .gather facts.$"):
        slurm_nodes(["node1", "node2"], both, absent=[], recorded=recorded)


def test_recorded_nodes_skip_what_does_not_parse():
    text = (
        '# budgetgpu-node {"host": "n1", "name": "n1"}\n# budgetgpu-node {not json\n# budgetgpu-node [1]\nn1 10.0.0.1\n'
    )
    assert slurm.recorded_nodes(text) == {"n1": {"host": "n1", "name": "n1"}}


MUNGE = {"host": "node2", "what": "munge key", "path": "/etc/munge/munge.key", "source": "/home/a/.budgetgpu/munge.key",
         "variable": "slurm_munge_key_rotate", "cluster": "c" * 64, "rotate": False}  # fmt: skip


@pytest.mark.parametrize(
    ("found", "installed", "package_new", "rotate", "action"),
    [
        ("c" * 64, "c" * 64, False, False, "keep"),
        ("", "", True, False, "install"),  # no key yet
        ("d" * 64, "", True, False, "install"),  # the package's own random key, made in this run: never a cluster's
        ("d" * 64, "d" * 64, False, False, "refuse"),  # the key the role installed, another than the control node's
        ("e" * 64, "d" * 64, False, False, "refuse"),  # changed by someone since
        ("d" * 64, "d" * 64, False, True, "install"),  # a rotation asked for
        # A node provisioned before the role recorded its key (the first run after an upgrade): not the package's.
        ("d" * 64, "", False, False, "refuse"),
        ("d" * 64, "", False, True, "install"),
    ],
)
def test_a_cluster_secret_that_differs_is_refused_unless_a_rotation_is_asked(
    found, installed, package_new, rotate, action
):
    inputs = {**MUNGE, "found": found, "installed": installed, "package_new": package_new, "rotate": rotate}
    assert slurm.secret_action(inputs)["action"] == action


def test_the_refusal_names_host_file_both_digests_and_variable_and_no_control_copy_is_an_error():
    said = slurm.secret_action({**MUNGE, "found": "d" * 64, "installed": "d" * 64})["reason"]
    assert said.startswith("node2: /etc/munge/munge.key holds another munge key than the control node's /home/a/")
    assert "slurm_munge_key_rotate=true" in said and said.endswith("Nothing changed")
    assert f"SHA-256 {'d' * 64} on node2 (one the role installed), {'c' * 64} on the control node" in said
    unrecorded = slurm.secret_action({**MUNGE, "found": "d" * 64, "installed": ""})["reason"]
    assert f"SHA-256 {'d' * 64} on node2 (one the role has no record of installing (a node provisioned" in unrecorded
    with pytest.raises(ValueError, match="node2: found no munge key on the control node"):
        slurm.secret_action({**MUNGE, "cluster": ""})


def entry(name: str, owner: str, kind: str = "directory") -> dict:
    return {"path": f"/srv/ckpt/{name}", "pw_name": owner, "isdir": kind == "directory", "islnk": kind == "link"}


def test_a_checkpoint_root_holding_only_its_users_directories_is_accepted():
    ok = {"host": "n1", "root": "/srv/ckpt", "stat": {"exists": True, "isdir": True, "islnk": False}}
    assert slurm.checkpoint_root_problems({**ok, "entries": [entry("ana", "ana"), entry("ben", "ben")]}) == []
    assert slurm.checkpoint_root_problems({**ok, "stat": {"exists": False}}) == []


def test_a_checkpoint_root_that_holds_other_things_or_is_a_link_is_refused():
    """/var/lib/budgetgpu as the checkpoint root (which preflight accepted): root would make users' directories
    beside its own records."""
    root = {"host": "n1", "root": "/var/lib/budgetgpu", "stat": {"exists": True, "isdir": True, "islnk": False}}
    found = [entry("slurm-jobs", "root"), entry("rapl", "root"), entry("ana", "ana"), entry("ben", "ana"),
             entry("x", "ben", "link"), entry("notes", "root", "file")]  # fmt: skip
    (said,) = slurm.checkpoint_root_problems({**root, "entries": found})
    assert said.startswith(
        "n1: slurm_checkpoint_root: found /var/lib/budgetgpu holding ben (directory of ana), notes (file of root), "
        "rapl (directory of root), slurm-jobs (directory of root), x (link of ben), expected a directory of its own"
    )
    link = {**root, "stat": {"exists": True, "islnk": True}}
    assert "a link, expected a directory of its own" in slurm.checkpoint_root_problems({**link, "entries": []})[0]
