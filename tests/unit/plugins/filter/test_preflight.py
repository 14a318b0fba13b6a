"""The cluster-wide preflight checks and the torchrun job filters, on hand-made clusters."""

from __future__ import annotations

import base64
import copy
from typing import Any

import pytest
from ansible_collections.budgetgpu.cluster.plugins.filter.preflight import (
    cluster_check,
    preflight_script_paths,
)
from ansible_collections.budgetgpu.cluster.plugins.filter.torchrun import (
    cluster_nodes,
    running_units,
    systemd_exec,
    systemd_show,
    torchrun_environment,
    torchrun_jobs_normalize,
    torchrun_masters_unknown,
    torchrun_plan,
    torchrun_recorded_masters,
)

GROUPS = {"all": ["node1", "node2"], "gpu_nodes": ["node1", "node2"], "other": ["node3"], "ungrouped": []}
EXAMPLE = "/opt/budgetgpu/examples/train_ddp.py"


def gpus_fact(count: int = 4, model: str = "NVIDIA GeForce RTX 3090", driver: str = "550.54.14") -> dict[str, Any]:
    return {
        "driver": {"state": "loaded", "version": driver},
        "count": count,
        "gpus": [{"index": i, "name": model} for i in range(count)],
    }


def pcie_fact(widths: tuple[int, ...] = (16, 16, 4, 4), model: str = "NVIDIA GeForce RTX 3090") -> dict[str, Any]:
    return {
        "count": len(widths),
        "gpus": [
            {
                "bus_id": f"0000:0{i + 1}:00.0",
                "name": model,
                "effective": {"gen": 3, "width": w},
                "capable": {"gen": 3, "width": 4},
                "limiting_hop": f"0000:0{i + 1}:00.0",
            }
            for i, w in enumerate(widths)
        ],
    }


def hostvars(**over: Any) -> dict[str, Any]:
    facts = {
        "budgetgpu_gpus": gpus_fact(),
        "budgetgpu_pcie": pcie_fact(),
        "budgetgpu_python_env": {"python": "3.11.2", "torch": "2.13.0", "cuda": "12.8", "nccl": "2.27.3"},
        "processor_nproc": 16,
    }
    facts.update(over.pop("facts", {}))
    return {"ansible_facts": facts, "budgetgpu_preflight_scripts": {"/srv/train.py": True}, **over}


def make_nodes(**per_host: dict[str, Any]) -> dict[str, dict[str, Any]]:
    hv = {"node1": hostvars(), "node2": hostvars(), "node3": hostvars()}
    for host, over in per_host.items():
        hv[host] = hostvars(**copy.deepcopy(over))
    return cluster_nodes(hv, ["node1", "node2"])


def jobs(*items: dict[str, Any]) -> list[dict[str, Any]]:
    return torchrun_jobs_normalize([{"name": "pretrain", "script": "/srv/train.py", **i} for i in items])


def check(job_list: list[dict[str, Any]], nodes: dict[str, Any] | None = None, **options: Any) -> dict[str, Any]:
    return cluster_check(nodes or make_nodes(), job_list, GROUPS, {"provided_scripts": [EXAMPLE], **options})


def fields(result: dict[str, Any]) -> set[tuple[str, str]]:
    return {(p["host"], p["field"]) for p in result["problems"]}


def test_a_good_cluster_passes_with_a_report_per_node():
    result = check(jobs({}))
    assert result["problems"] == []
    assert result["report"][0].startswith("budgetgpu preflight: 2 nodes, 1 jobs: 0 problems")
    assert any(
        "node node1: 4 GPUs (4x NVIDIA GeForce RTX 3090), driver 550.54.14, 16 CPUs" in line
        for line in result["report"]
    )


@pytest.mark.parametrize("name", ["my job", "a/b", "", "../etc", None, "ok\n"])
def test_a_job_name_with_spaces_or_slashes_fails(name):
    result = check(jobs({"name": name}))
    assert ("node1,node2", "name") in fields(result)
    line = next(line for line in result["report"] if "name:" in line)
    assert line.startswith("FAIL node1,node2:") and "expected letters, digits" in line


def test_duplicate_ranks_fail_on_both_hosts():
    result = check(jobs({"rendezvous": "static", "node_ranks": {"node1": 0, "node2": 0}}))
    assert {("node1", "node_rank"), ("node2", "node_rank")} <= fields(result)
    assert any("node2 has rank 0 too" in p["hint"] for p in result["problems"])


def test_duplicate_ranks_from_host_vars_fail():
    nodes = make_nodes(node1={"torchrun_node_rank": 1}, node2={"torchrun_node_rank": 1})
    result = check(jobs({"rendezvous": "static"}), nodes)
    assert {("node1", "node_rank"), ("node2", "node_rank")} <= fields(result)


def test_ranks_must_be_contiguous_and_the_static_master_rank_0():
    result = check(jobs({"rendezvous": "static", "node_ranks": {"node1": 0, "node2": 2}}))
    assert ("node2", "node_rank") in fields(result)
    result = check(jobs({"rendezvous": "static", "node_ranks": {"node1": 1, "node2": 0}}))
    assert ("node1", "node_rank") in fields(result)


def test_a_rank_for_a_host_outside_the_group_fails():
    result = check(jobs({"node_ranks": {"node1": 0, "node2": 1, "node3": 2}}))
    assert ("node3", "node_ranks") in fields(result)


def test_a_master_outside_the_group_fails():
    result = check(jobs({"master": "node3"}))
    assert ("node1,node2", "master") in fields(result)
    assert "node3" in result["problems"][0]["found"]


@pytest.mark.parametrize("nproc", [0, 5, -1, "four", True])
def test_nproc_per_node_out_of_range_fails(nproc):
    result = check(jobs({"nproc_per_node": nproc}))
    assert any(f == "nproc_per_node" for _unused, f in fields(result)), result["report"]


def test_nproc_above_the_gpu_count_names_each_host():
    nodes = make_nodes(node2={"facts": {"budgetgpu_gpus": gpus_fact(count=1), "budgetgpu_pcie": pcie_fact((16,))}})
    result = check(jobs({"nproc_per_node": 2}), nodes)
    assert fields(result) == {("node2", "nproc_per_node")}
    assert result["problems"][0]["expected"] == "1 to 1 (GPUs on node2)"


def test_gpu_count_comes_from_pcie_when_the_driver_is_not_loaded():
    no_driver = {"driver": {"state": "no_driver"}, "count": 0, "gpus": []}
    nodes = make_nodes(node1={"facts": {"budgetgpu_gpus": no_driver}}, node2={"facts": {"budgetgpu_gpus": no_driver}})
    assert check(jobs({"nproc_per_node": 4}), nodes)["problems"] == []
    nodes = make_nodes(node1={"facts": {"budgetgpu_gpus": no_driver, "budgetgpu_pcie": pcie_fact(())}})
    result = check(jobs({}), nodes)
    assert fields(result) == {("node1", "nproc_per_node")}
    assert "no GPU" in result["problems"][0]["hint"]


@pytest.mark.parametrize("backend", ["etcd", "etcd-v2", "C10D", None, ""])
def test_an_unknown_rendezvous_backend_fails(backend):
    result = check(jobs({"rendezvous": backend}))
    assert ("node1,node2", "rendezvous") in fields(result)


def test_two_jobs_on_one_port_fail():
    result = check(jobs({}, {"name": "eval", "script": "/srv/train.py"}))
    assert ("node1,node2", "port") in fields(result)
    assert "job pretrain" in result["problems"][0]["expected"]
    assert check(jobs({}, {"name": "eval", "port": 29501}))["problems"] == []


def test_jobs_on_disjoint_nodes_may_share_a_port():
    hv = {"node1": hostvars(), "node2": hostvars(), "node3": hostvars()}
    nodes = cluster_nodes(hv, ["node1", "node2", "node3"])
    job_list = jobs({}, {"name": "eval", "nodes": "other"})
    assert cluster_check(nodes, job_list, GROUPS, {"min_cpus_per_process": 1})["problems"] == []


def test_a_store_port_on_another_jobs_port_or_store_port_fails_naming_both():
    # pretrain's store (its port + 1000) on eval's rendezvous port.
    result = check(jobs({}, {"name": "eval", "port": 30500}))
    assert [(p["job"], p["field"], p["found"], p["expected"]) for p in result["problems"]] == [
        ("eval", "port", 30500, "a port other than 30500, which job pretrain uses on these nodes as its store_port")
    ]
    assert result["problems"][0]["hint"] == "give every job its own port and store_port"
    named = check(jobs({"store_port": 31000}, {"name": "eval", "port": 29501, "store_port": 31000}))
    assert fields(named) == {("node1,node2", "store_port")}
    assert named["problems"][0]["expected"].endswith("which job pretrain uses on these nodes as its store_port")


@pytest.mark.parametrize("store_port", [29500, 0, 70000, "next"])
def test_a_store_port_that_is_the_jobs_port_or_no_port_fails(store_port):
    result = check(jobs({"store_port": store_port}))
    assert fields(result) == {("node1,node2", "store_port")}, result["report"]
    # The default follows the port: a port above 64535 needs a store port of its own.
    assert fields(check(jobs({"port": 65000}))) == {("node1,node2", "store_port")}


def test_a_store_port_in_a_nodes_ephemeral_range_fails_on_that_node():
    # The kernel may hand the port to any connection between two restarts, when rank 0's worker binds it again.
    nodes = make_nodes(node2={"facts": {"budgetgpu_net": {"ephemeral_ports": [30000, 60999]}}})
    result = check(jobs({}), nodes)
    assert [(p["host"], p["field"], p["found"]) for p in result["problems"]] == [("node2", "store_port", 30500)]
    expected = "a port outside node2's ephemeral range 30000-60999 (net.ipv4.ip_local_port_range)"
    assert result["problems"][0]["expected"] == expected
    assert check(jobs({"store_port": 29999}), nodes)["problems"] == []


def test_a_missing_script_fails_on_that_host_only():
    nodes = make_nodes(node2={"budgetgpu_preflight_scripts": {"/srv/train.py": False}})
    result = check(jobs({}), nodes)
    assert fields(result) == {("node2", "script")}
    assert "/srv/train.py (missing)" in result["report"][-1]


def test_script_paths_skip_the_collections_own_example():
    job_list = jobs(
        {"script": EXAMPLE},
        {"name": "b", "script": "rel.py", "port": 1},
        {"name": "c", "module": "m", "script": None, "port": 2},
    )
    assert preflight_script_paths(job_list, "node1", GROUPS, [EXAMPLE]) == ["/var/lib/budgetgpu/jobs/b/rel.py"]
    assert preflight_script_paths(job_list, "node3", GROUPS, [EXAMPLE]) == []


def test_an_image_jobs_script_is_checked_on_the_host_only_in_its_workdir():
    image = "registry.example/train@sha256:" + "a" * 64
    job_list = jobs(
        {"name": "inside", "image": image, "script": "/opt/app/train.py"},
        {"name": "mounted", "image": image, "script": "train.py", "port": 1},
        {"name": "venv", "script": "/opt/app/train.py", "port": 2},
    )
    assert preflight_script_paths(job_list, "node1", GROUPS) == [
        "/var/lib/budgetgpu/jobs/mounted/train.py",
        "/opt/app/train.py",
    ]


def test_an_image_without_a_digest_is_refused_naming_the_field():
    result = check(jobs({"image": "nvidia/cuda:12.1"}))
    assert ("node1,node2", "image") in fields(result)
    assert "nvidia/cuda:12.1" in "\n".join(result["report"])


def test_script_and_module_are_exclusive():
    assert ("node1,node2", "script") in fields(check(jobs({"module": "pkg.train"})))
    assert ("node1,node2", "script") in fields(check(jobs({"script": None})))


def test_mixed_gpu_models_fail_unless_allowed():
    nodes = make_nodes(node2={"facts": {"budgetgpu_gpus": gpus_fact(model="NVIDIA GeForce RTX 4090")}})
    result = check(jobs({}), nodes)
    assert fields(result) == {("node2", "gpu model")}
    assert "as on node1" in result["problems"][0]["expected"]
    assert check(jobs({"allow_mixed_gpus": True}), nodes)["problems"] == []


def test_gpu_models_are_compared_by_pci_device_id_not_by_name():
    # A provisioned node names its cards through NVML, a fresh one (no driver yet) from the sysfs
    # table: one model all the same, so a node can join a running cluster through site.yml.
    def pcie(device_id: str, name: str) -> dict[str, Any]:
        fact = pcie_fact(model=name)
        for gpu in fact["gpus"]:
            gpu["device_id"] = device_id
        return fact

    fresh = {"budgetgpu_gpus": {"driver": {"state": "not_installed"}, "count": 0, "gpus": []}}
    nodes = make_nodes(
        node1={"facts": {"budgetgpu_pcie": pcie("0x2204", "GeForce RTX 3090")}},
        node2={"facts": {**fresh, "budgetgpu_pcie": pcie("0x2204", "GeForce RTX 3090")}},
    )
    assert ("node2", "gpu model") not in fields(check(jobs({}), nodes))
    nodes["node2"] = make_nodes(node2={"facts": {**fresh, "budgetgpu_pcie": pcie("0x2684", "GeForce RTX 4090")}})[
        "node2"
    ]
    result = check(jobs({}), nodes)
    assert ("node2", "gpu model") in fields(result)
    problem = next(p for p in result["problems"] if p["field"] == "gpu model")
    assert problem["found"] == "GeForce RTX 4090 (0x2684)" and "GeForce RTX 3090 (0x2204)" in problem["expected"]


def test_mixed_gpus_within_one_node_fail():
    mixed = gpus_fact()
    mixed["gpus"][1]["name"] = "NVIDIA GeForce RTX 4090"
    result = check(jobs({}), make_nodes(node1={"facts": {"budgetgpu_gpus": mixed}}))
    assert ("node1", "gpu model") in fields(result)


def test_driver_major_and_venv_versions_must_agree():
    env = {"python": "3.11.2", "torch": "2.12.0", "cuda": "12.6", "nccl": "2.27.3"}
    nodes = make_nodes(node2={"facts": {"budgetgpu_gpus": gpus_fact(driver="535.261.03"), "budgetgpu_python_env": env}})
    result = check(jobs({}), nodes)
    assert fields(result) == {("node2", "driver major"), ("node2", "torch"), ("node2", "cuda")}
    assert all("as on node1" in p["expected"] for p in result["problems"])


def test_an_unprobed_node_fails():
    result = check(jobs({}), cluster_nodes({"node1": hostvars(), "node2": {}}, ["node1", "node2"]))
    assert fields(result) == {("node2", "budgetgpu_gpus")}


def test_a_node_that_failed_this_run_is_not_probed_despite_cached_facts():
    nodes = cluster_nodes({"node1": hostvars(), "node2": hostvars()}, ["node1", "node2", "node1"], failed=["node2"])
    assert list(nodes) == ["node1", "node2"]
    assert fields(check(jobs({}), nodes)) == {("node2", "budgetgpu_gpus")}


def test_few_cpus_per_process_is_a_warning_only():
    result = check(jobs({}), make_nodes(node1={"facts": {"processor_nproc": 2}}))
    assert result["problems"] == []
    assert [(w["host"], w["field"]) for w in result["warnings"]] == [("node1", "cpus per process")]
    assert any(line.startswith("WARN node1: job pretrain cpus per process") for line in result["report"])


def test_pcie_links_below_the_expected_width_fail():
    nodes = make_nodes(node1={"probe_pcie_min_width": 8}, node2={"probe_pcie_expected": {"0000:01:00.0": {"gen": 4}}})
    result = check(jobs({}), nodes)
    assert fields(result) == {
        ("node1", "pcie 0000:03:00.0 width"),
        ("node1", "pcie 0000:04:00.0 width"),
        ("node2", "pcie 0000:01:00.0 gen"),
    }


@pytest.mark.parametrize("bus_id", ["01:00.0", "00000000:01:00.0", "0000:01:00.0", "0000:01:00.0 "])
def test_pcie_expectations_take_every_bus_id_form_the_module_takes(bus_id):
    # The short and NVML forms were "not on the PCI bus" in preflight while pcie_facts took them.
    nodes = make_nodes(node2={"probe_pcie_expected": {bus_id: {"gen": 4}}})
    assert fields(check(jobs({}), nodes)) == {("node2", "pcie 0000:01:00.0 gen")}


@pytest.mark.parametrize("bus_id", ["10000:e1:00.0", "00010000:E1:00.0"])
def test_pcie_expectations_keep_vmd_domains_above_ffff(bus_id):
    vmd = pcie_fact((16,))
    vmd["gpus"][0].update(bus_id="10000:e1:00.0", limiting_hop="10000:e1:00.0")
    nodes = make_nodes(node2={"facts": {"budgetgpu_pcie": vmd}, "probe_pcie_expected": {bus_id: {"gen": 4}}})
    assert fields(check(jobs({}), nodes)) == {("node2", "pcie 10000:e1:00.0 gen")}


def test_pcie_generation_counts_the_links_above_the_gpu_as_pcie_facts_does():
    # Preflight compared only what both ends of each link support; pcie_facts (the one rule) also counts
    # a switch link that trained below it. An idle GPU's own link at gen1 is no problem.
    fact = pcie_fact((16, 16))
    for gpu, upstream_gen in zip(fact["gpus"], (3, 4), strict=True):
        gpu["capable"] = {"gen": 4, "width": 16}
        gpu["links"] = [{"gen": upstream_gen, "width": 16}, {"gen": 1, "width": 16}]
    expected = {"0000:01:00.0": {"gen": 4}, "0000:02:00.0": {"gen": 4}}
    nodes = make_nodes(node2={"facts": {"budgetgpu_pcie": fact}, "probe_pcie_expected": expected})
    result = check(jobs({}), nodes)
    assert fields(result) == {("node2", "pcie 0000:01:00.0 gen")}
    problem = result["problems"][0]
    assert problem["found"].startswith("gen3") and problem["expected"] == "gen4" and "riser" in problem["hint"]


def test_a_node_that_is_down_fails_preflight_but_only_warns_in_safe_mode():
    nodes = make_nodes(node2={"facts": {}})
    nodes["node2"]["probed"] = False
    assert ("node2", "budgetgpu_gpus") in fields(check(jobs({}), nodes))
    nightly = check(jobs({}), nodes, down_nodes_ok=True)
    assert ("node2", "budgetgpu_gpus") not in fields(nightly)
    assert ("node2", "budgetgpu_gpus") in {(w["host"], w["field"]) for w in nightly["warnings"]}


def test_a_downgraded_link_is_a_warning_that_names_the_gpu_and_what_to_check():
    riser = pcie_fact((16, 16, 4, 1))
    riser["gpus"][3].update(
        downgraded=True,
        limiting_hop="0000:00:1d.0",
        downgrade_reasons=["link 0000:00:1d.0 -> 0000:04:00.0 trained at x1 but both ends support x4: reseat"],
    )
    result = check(jobs({}), make_nodes(node2={"facts": {"budgetgpu_pcie": riser}}))
    assert result["problems"] == []
    warning = next(w for w in result["warnings"] if w["field"].startswith("pcie"))
    assert (warning["host"], warning["field"]) == ("node2", "pcie 0000:04:00.0 link")
    assert warning["found"] == "gen3 x1 (limiting hop 0000:00:1d.0)"
    assert warning["expected"] == "gen3 x4 (what both ends support)"
    assert any("WARN node2: pcie 0000:04:00.0 link" in line and "reseat" in line for line in result["report"])


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("port", 0),
        ("port", 70000),
        ("port", "high"),
        ("max_restarts", -1),
        ("checkpoint_every_minutes", -5),
        ("checkpoint_every_steps", 1.5),
        ("straggler_every_steps", -1),
        ("venv", "relative/venv"),
        ("workdir", "tmp"),
        ("environment", {"BAD-NAME": "1"}),
        ("environment", ["A=1"]),
        ("user", "root"),
        ("user", "Bad User"),
        ("backend", "mpi"),
        ("state", "running"),
        ("enabled", "yes"),
        ("nodes", "no_such_group"),
        ("nprocs", 2),
    ],
)
def test_bad_fields_are_named(key, value):
    result = check(jobs({key: value}))
    assert any(f.split(".")[0] == key for _unused, f in fields(result)), result["report"]
    assert all(line.startswith(("budgetgpu", "  node", "FAIL", "WARN")) for line in result["report"])


def test_numbers_given_as_strings_are_numbers():
    assert check(jobs({"port": "29501", "nproc_per_node": "2", "checkpoint_every_minutes": "7.5"}))["problems"] == []


def test_duplicate_job_names_fail():
    result = check(jobs({}, {"port": 29501}))
    assert ("all", "name") in fields(result)


def test_different_torchrun_jobs_per_host_fail():
    nodes = make_nodes(node1={"budgetgpu_preflight_jobs_digest": "a"}, node2={"budgetgpu_preflight_jobs_digest": "b"})
    assert fields(check(jobs({}), nodes)) == {("node2", "torchrun_jobs")}


# --- the units' command lines -------------------------------------------------------------


def test_c10d_plan_runs_torchrun_with_the_rendezvous_on_the_master():
    nodes = make_nodes()
    (job,) = torchrun_plan(jobs({"nproc_per_node": 2, "args": ["--lr", "0.1"]}), "node2", GROUPS, nodes)
    assert job["argv"] == [
        "/opt/budgetgpu/venv/bin/torchrun",
        "--nproc-per-node=2",
        "--nnodes=2:2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=node1:29500",
        "--rdzv-id=pretrain",
        "--rdzv-conf=join_timeout=900,read_timeout=60,is_host=0",
        "--max-restarts=3",
        "/srv/train.py",
        "--lr",
        "0.1",
    ]
    assert job["unit"] == "budgetgpu-job-pretrain.service"
    assert job["env"]["BUDGETGPU_CHECKPOINT_DIR"] == "/var/lib/budgetgpu/jobs/pretrain/checkpoints"
    assert job["env"]["BUDGETGPU_DIST_BACKEND"] == "nccl"


def test_the_master_hosts_the_store_because_the_inventory_says_so():
    # torch left alone decides by resolving its hostname: on a stock install (hostname on
    # 127.0.1.1) no node would host the store. A master named by hostname hosts it all the same.
    for master_addr in (None, "gpu-master.lan"):
        plans = {
            h: torchrun_plan(jobs({"master_addr": master_addr}), h, GROUPS, make_nodes())[0] for h in ("node1", "node2")
        }
        confs = {h: [a for a in p["argv"] if a.startswith("--rdzv-conf=")] for h, p in plans.items()}
        assert confs == {
            "node1": ["--rdzv-conf=join_timeout=900,read_timeout=60,is_host=1"],
            "node2": ["--rdzv-conf=join_timeout=900,read_timeout=60,is_host=0"],
        }
    assert "--rdzv-endpoint=gpu-master.lan:29500" in plans["node2"]["argv"]
    (named,) = torchrun_plan(jobs({"master": "node2"}), "node2", GROUPS, make_nodes())
    assert "--rdzv-conf=join_timeout=900,read_timeout=60,is_host=1" in named["argv"]


def test_an_ipv6_rendezvous_endpoint_is_bracketed():
    net = {"cluster_interface": {"name": "eth1", "address": "fd00::1", "prefixlen": 64}}
    nodes = cluster_nodes({"node1": hostvars(facts={"budgetgpu_net": net}), "node2": hostvars()}, ["node1", "node2"])
    (job,) = torchrun_plan(jobs({}), "node2", GROUPS, nodes, "/opt/budgetgpu/bin/budgetgpu-torchrun")
    assert "--rdzv-endpoint=[fd00::1]:29500" in job["argv"]
    assert job["argv"][2] == "--wait-for-master=[fd00::1]:29500"


def test_every_node_but_the_master_waits_for_the_masters_store():
    launcher = "/opt/budgetgpu/bin/budgetgpu-torchrun"
    for rendezvous in ("c10d", "static"):
        waits = {
            h: [a for a in torchrun_plan(jobs({"rendezvous": rendezvous}), h, GROUPS, make_nodes(), launcher)[0]["argv"]
                if a.startswith("--wait-for-master")]
            for h in GROUPS["gpu_nodes"]
        }  # fmt: skip
        assert waits == {"node1": [], "node2": ["--wait-for-master=node1:29500"]}, rendezvous
    # Without the launcher (torchrun itself) there is nobody to wait.
    (plain,) = torchrun_plan(jobs({}), "node2", GROUPS, make_nodes())
    assert not [a for a in plain["argv"] if a.startswith("--wait-for-master")]


def test_the_launcher_puts_the_c10d_workers_store_on_the_jobs_store_port():
    launcher = "/opt/budgetgpu/bin/budgetgpu-torchrun"
    (job,) = torchrun_plan(jobs({"store_port": 30600}), "node2", GROUPS, make_nodes(), launcher)
    # After the wait (the launcher's first argument), on every node: whichever is rank 0 hosts the workers' store.
    assert job["argv"][2:5] == ["--wait-for-master=node1:29500", "--store-port=30600", "--nproc-per-node=4"]
    # The static rendezvous' workers use the store on port; without the launcher nobody places the store.
    (static,) = torchrun_plan(jobs({"rendezvous": "static"}), "node1", GROUPS, make_nodes(), launcher)
    (plain,) = torchrun_plan(jobs({}), "node1", GROUPS, make_nodes())
    assert not [a for a in static["argv"] + plain["argv"] if a.startswith("--store-port")]


def test_workers_get_a_fresh_store_for_each_rendezvous_round():
    # The shared agent store kept the peers' addresses of the round before an in-place restart.
    c10d = torchrun_environment(jobs({})[0], "node1", make_nodes())
    static = torchrun_environment(jobs({"rendezvous": "static"})[0], "node1", make_nodes())
    assert c10d["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in static


def test_a_pull_run_without_the_masters_facts_keeps_the_address_the_unit_has():
    # ansible-pull on node2 knows only node2: the master's cluster address is nowhere in this run.
    launcher = "/opt/budgetgpu/bin/budgetgpu-torchrun"
    net = {"cluster_interface": {"name": "eth0", "address": "10.231.2.3", "prefixlen": 24}}
    alone = cluster_nodes({"node2": hostvars(facts={"budgetgpu_net": net})}, ["node1", "node2"])
    assert [j["name"] for j in torchrun_masters_unknown(jobs({}), "node2", GROUPS, alone)] == ["pretrain"]
    assert torchrun_masters_unknown(jobs({"master_addr": "10.0.0.9"}), "node2", GROUPS, alone) == []
    with_master = cluster_nodes(
        {"node1": hostvars(facts={"budgetgpu_net": net}), "node2": hostvars()}, ["node1", "node2"]
    )
    assert torchrun_masters_unknown(jobs({}), "node2", GROUPS, with_master) == []

    master_net = {"cluster_interface": {"name": "eth0", "address": "10.231.2.2", "prefixlen": 24}}
    both = cluster_nodes(
        {"node1": hostvars(facts={"budgetgpu_net": master_net}), "node2": hostvars(facts={"budgetgpu_net": net})},
        ["node1", "node2"],
    )
    (before,) = torchrun_plan(jobs({}), "node2", GROUPS, both, launcher)
    unit = "ExecStart=" + systemd_exec(before["argv"])
    recorded = torchrun_recorded_masters(
        [{"item": {"name": "pretrain"}, "content": base64.b64encode(unit.encode()).decode()}, {"item": {"name": "x"}}]
    )
    assert recorded == {"pretrain": "10.231.2.2"}
    (job,) = torchrun_plan(jobs({}), "node2", GROUPS, alone, launcher, recorded)
    assert job["argv"] == before["argv"]  # the same unit: no restart pending, no host name
    (guess,) = torchrun_plan(jobs({}), "node2", GROUPS, alone, launcher)
    assert "--rdzv-endpoint=node1:29500" in guess["argv"]  # what it wrote before


def test_recorded_masters_read_every_endpoint_form():
    def slurp(name: str, line: str) -> dict[str, Any]:
        return {"item": {"name": name}, "content": base64.b64encode(line.encode()).decode()}

    units = [
        slurp("v6", 'ExecStart="/x" "--rdzv-endpoint=[fd00::2]:29500" "--rdzv-id=v6"'),
        slurp("static", 'ExecStart="/x" "--nnodes=2" "--master-addr=192.168.1.10" "--master-port=29500"'),
        slurp("none", 'ExecStart="/x" "--standalone"'),
    ]
    assert torchrun_recorded_masters(units) == {"v6": "fd00::2", "static": "192.168.1.10"}


def test_in_place_restarts_with_the_static_rendezvous_are_a_warning():
    warned = check(jobs({"rendezvous": "static"}))
    assert [(w["host"], w["field"]) for w in warned["warnings"]] == [("node1,node2", "max_restarts")]
    assert warned["problems"] == []
    assert check(jobs({"rendezvous": "static", "max_restarts": 0}))["warnings"] == []
    assert check(jobs({}))["warnings"] == []  # c10d restarts in place


def test_static_plan_is_the_guides_command_line():
    hv = {h: hostvars(ansible_host=f"192.168.1.1{i}") for i, h in enumerate(["node1", "node2"])}
    nodes = cluster_nodes(hv, ["node1", "node2"])
    (job,) = torchrun_plan(
        jobs({"rendezvous": "static", "module": "pkg.train", "script": None}), "node2", GROUPS, nodes
    )
    assert job["argv"][1:6] == [
        "--nproc-per-node=4",
        "--nnodes=2",
        "--node-rank=1",
        "--master-addr=192.168.1.10",
        "--master-port=29500",
    ]
    assert job["argv"][-2:] == ["--module", "pkg.train"]


def test_the_cluster_interface_is_the_rendezvous_and_local_address():
    net = {"cluster_interface": {"name": "eth1", "address": "10.0.0.1", "prefixlen": 24}}
    hv = {"node1": hostvars(facts={"budgetgpu_net": net}), "node2": hostvars()}
    nodes = cluster_nodes(hv, ["node1", "node2"])
    (job,) = torchrun_plan(jobs({}), "node1", GROUPS, nodes)
    assert "--rdzv-endpoint=10.0.0.1:29500" in job["argv"]
    assert "--local-addr=10.0.0.1" in job["argv"]


def test_simulated_nodes_train_with_gloo_and_user_env_comes_last():
    nodes = make_nodes(node1={"budgetgpu_simulated": True})
    job = jobs({"environment": {"NCCL_DEBUG": "INFO", "BUDGETGPU_CHECKPOINT_DIR": "/data/ckpt"}})[0]
    env = torchrun_environment(job, "node1", nodes)
    assert env["BUDGETGPU_DIST_BACKEND"] == "gloo"
    assert env["BUDGETGPU_CHECKPOINT_DIR"] == "/data/ckpt"


def test_exec_lines_are_quoted_for_systemd():
    assert systemd_exec(["/bin/x", 'a "b"', "50%", "$HOME", "c\\d"]) == r'"/bin/x" "a \"b\"" "50%%" "$$HOME" "c\\d"'


def test_a_launcher_runs_with_the_venvs_python():
    (job,) = torchrun_plan(jobs({}), "node1", GROUPS, make_nodes(), "/opt/budgetgpu/bin/budgetgpu-torchrun")
    assert job["argv"][:4] == [
        "/opt/budgetgpu/venv/bin/python3",
        "/opt/budgetgpu/bin/budgetgpu-torchrun",
        "--store-port=30500",
        "--nproc-per-node=4",
    ]


def test_hosts_outside_every_job_get_an_empty_plan():
    assert torchrun_plan(jobs({}), "node3", GROUPS, make_nodes()) == []


def test_systemd_show_maps_each_unit_to_its_properties():
    output = (
        "Id=budgetgpu-job-main.service\nLoadState=loaded\nSubState=running\n\n"
        "Id=budgetgpu-job-gone.service\nLoadState=not-found\nSubState=dead\n"
    )
    main, gone = "budgetgpu-job-main.service", "budgetgpu-job-gone.service"
    assert systemd_show(output) == {
        main: {"Id": main, "LoadState": "loaded", "SubState": "running"},
        gone: {"Id": gone, "LoadState": "not-found", "SubState": "dead"},
    }
    assert systemd_show("") == {}


def test_running_units_are_those_safe_mode_counts_as_running_jobs():
    from ansible_collections.budgetgpu.cluster.plugins.filter.probe import probe_running_jobs

    states = ["active", "reloading", "activating", "deactivating", "inactive", "failed", "maintenance"]
    show = "\n\n".join(f"Id=u-{state}.service\nActiveState={state}" for state in states)
    lines = [f"u-{state}.service loaded {state} x" for state in states]
    running = running_units(systemd_show(show))
    assert running == ["u-active.service", "u-reloading.service", "u-activating.service", "u-deactivating.service"]
    assert probe_running_jobs(lines) == running


def test_no_role_decides_by_itself_whether_a_unit_runs():
    from pathlib import Path

    roles = Path(__file__).resolve().parents[4] / "roles"
    found = [
        f"{path.relative_to(roles)}:{number}"
        for path in sorted(roles.glob("*/tasks/*.yml"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if ("ActiveState" in line or "SubState" in line) and "--property=" not in line
    ]
    assert not found, f"use filter running_units (one definition of a running unit): {found}"


def test_a_quarantined_gpu_is_a_warning_with_its_reason_and_time():
    out = {"GPU-2": {"reason": "GPU 2: fan 0% (target 80%) at 88 C: fan dead?", "since": "2026-12-01T02:00:00Z"}}
    local = {"ansible_local": {"budgetgpu_gpu_health": {"quarantine": out, "updated": "2026-12-01T02:01:00Z"}}}
    result = check(jobs({}), make_nodes(node2={"facts": local}))
    assert result["problems"] == []
    lines = [line for line in result["report"] if "GPU-2" in line]
    assert lines == [
        "WARN node2: GPU GPU-2: found 'quarantined since 2026-12-01T02:00:00Z: GPU 2: fan 0% (target 80%) at 88 C: "
        "fan dead?', expected in service: jobs start without it (one rank fewer; a fixed nproc_per_node that needs "
        "it is held) and its inference worker does not start; return it with playbooks/gpu_release.yml "
        "-e gpu=GPU-2 once fixed"
    ]


def test_bf16_on_gloo_is_refused_naming_the_job_and_each_node():
    simulated = make_nodes(node1={"budgetgpu_simulated": True}, node2={"budgetgpu_simulated": True})
    result = check(jobs({"gradient_compression": "bf16"}), simulated)
    assert fields(result) == {("node1", "gradient_compression"), ("node2", "gradient_compression")}
    problem = result["problems"][0]
    assert problem["job"] == "pretrain" and problem["found"] == "bf16 on backend gloo"
    assert problem["expected"] == "backend nccl" and "use fp16 or powersgd" in problem["hint"]
    # On GPU nodes (NCCL) bf16 passes; fp16 and powersgd pass on gloo.
    assert check(jobs({"gradient_compression": "bf16"}))["problems"] == []
    on_gloo = jobs({"gradient_compression": "fp16"}, {"name": "b", "port": 29501, "gradient_compression": "powersgd"})
    assert check(on_gloo, simulated)["problems"] == []


@pytest.mark.parametrize(
    ("field", "value"),
    [("gradient_compression", "int8"), ("powersgd_rank", 0), ("powersgd_start_step", 1), ("bucket_cap_mb", 0),
     ("bucket_cap_mb", "big"), ("accumulate_steps", 0), ("accumulate_steps", True)],
)  # fmt: skip
def test_bad_communication_settings_fail_with_the_field(field, value):
    result = check(jobs({field: value}))
    assert fields(result) == {("node1,node2", field)}, result["problems"]


# --- how the model is spread (issue 42 item 1) ----------------------------------------------------


def gpus_with_capability(capability: str, model: str) -> dict[str, Any]:
    fact = gpus_fact(2, model)
    for gpu in fact["gpus"]:
        gpu["compute_capability"] = capability
    return fact


@pytest.mark.parametrize(
    ("field", "value"),
    [("parallelism", "zero3"), ("parallelism", None), ("mixed_precision", "fp8"), ("mixed_precision", True),
     ("state_precision", "fp16"), ("activation_checkpointing", "yes")],
)  # fmt: skip
def test_unknown_sharding_values_fail_naming_the_field(field, value):
    result = check(jobs({field: value}))
    assert fields(result) == {("node1,node2", field)}, result["problems"]
    assert result["problems"][0]["job"] == "pretrain"


def test_fsdp_and_hsdp_with_bf16_on_ampere_pass():
    ampere = {"facts": {"budgetgpu_gpus": gpus_with_capability("8.6", "NVIDIA GeForce RTX 3090")}}
    nodes = make_nodes(node1=ampere, node2=ampere)
    for parallelism in ("fsdp", "hsdp"):
        job = jobs({"parallelism": parallelism, "mixed_precision": "bf16", "activation_checkpointing": True})
        assert check(job, nodes)["problems"] == [], parallelism
    assert check(jobs({"state_precision": "bf16", "mixed_precision": "bf16"}), nodes)["problems"] == []


def test_bf16_on_a_2080_ti_is_refused_naming_job_node_and_gpu():
    turing = {"facts": {"budgetgpu_gpus": gpus_with_capability("7.5", "NVIDIA GeForce RTX 2080 Ti")}}
    nodes = make_nodes(node1=turing, node2=turing)
    for key in ("mixed_precision", "state_precision"):
        result = check(jobs({key: "bf16"}), nodes)
        assert fields(result) == {("node1", "mixed_precision"), ("node2", "mixed_precision")}, result["problems"]
        problem = result["problems"][1]
        assert problem["job"] == "pretrain" and problem["host"] == "node2"
        assert problem["found"] == "bf16 on GPU 0, 1 (NVIDIA GeForce RTX 2080 Ti, compute capability 7.5)"
        assert problem["expected"] == "compute capability 8.0 or more" and "fp16 under ddp" in problem["hint"]
    # fp16 under ddp is the 2080 Ti's way.
    assert check(jobs({"mixed_precision": "fp16"}), nodes)["problems"] == []


def test_bf16_training_on_gloo_is_refused_on_each_node():
    simulated = make_nodes(node1={"budgetgpu_simulated": True}, node2={"budgetgpu_simulated": True})
    result = check(jobs({"parallelism": "fsdp", "mixed_precision": "bf16"}), simulated)
    assert fields(result) == {("node1", "mixed_precision"), ("node2", "mixed_precision")}
    assert result["problems"][0]["found"] == "bf16 on backend gloo"
    # fsdp itself trains on gloo (the simulated cluster's sharded jobs).
    assert check(jobs({"parallelism": "fsdp"}), simulated)["problems"] == []


def test_sharding_over_nothing_is_refused():
    one_gpu = {"facts": {"budgetgpu_gpus": gpus_fact(1)}}
    single = {"all": ["node1"], "solo": ["node1"]}
    nodes = make_nodes(node1=one_gpu)
    result = cluster_check(nodes, jobs({"parallelism": "fsdp", "nodes": "solo"}), single, {})
    assert fields(result) == {("node1", "parallelism")}
    assert result["problems"][0]["found"] == "fsdp on 1 rank" and "use ddp" in result["problems"][0]["hint"]
    result = cluster_check(nodes, jobs({"parallelism": "hsdp", "nodes": "solo"}), single, {})
    assert fields(result) == {("node1", "parallelism")}
    assert result["problems"][0]["found"] == "hsdp on 1 node" and "fsdp on one node" in result["problems"][0]["hint"]
    # Two GPUs of one node shard fine.
    two_gpus = make_nodes(node1={"facts": {"budgetgpu_gpus": gpus_fact(2)}})
    assert cluster_check(two_gpus, jobs({"parallelism": "fsdp", "nodes": "solo"}), single, {})["problems"] == []


@pytest.mark.parametrize(
    ("over", "field"),
    [({"parallelism": "fsdp", "gradient_compression": "powersgd"}, "gradient_compression"),
     ({"parallelism": "hsdp", "mixed_precision": "fp16"}, "mixed_precision"),
     ({"state_precision": "bf16", "mixed_precision": "fp16"}, "mixed_precision")],
)  # fmt: skip
def test_combinations_that_cannot_run_are_refused(over, field):
    result = check(jobs(over))
    assert fields(result) == {("node1,node2", field)}, result["problems"]
