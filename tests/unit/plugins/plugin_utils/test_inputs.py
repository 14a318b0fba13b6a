"""plugin_utils/inputs.py: every role's inputs against its argument spec, unknown prefixed names with
the nearest known one, renamed names with the new one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils import inputs

REPO = Path(__file__).resolve().parents[4]
OPTIONS, KNOWN = inputs.load_specs(str(REPO / "roles"))


def problems(variables: dict) -> list[str]:
    return inputs.check_inputs("node3", variables, OPTIONS, KNOWN)


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ({"nvidia_driver_branch": "latest"}, ["node3: nvidia_driver_branch: expected int, found 'latest'"]),
        ({"nvidia_driver_secure_boot": "maybe"}, ["node3: nvidia_driver_secure_boot: expected str (one of refuse"]),
        ({"nccl_network_busbw_floor_gbps": -1}, ["node3: nccl_network_busbw_floor_gbps: expected auto or a number"]),
        ({"nccl_network_busbw_floor_gbps": "fast"}, ["nccl_network_busbw_floor_gbps: expected auto or a number"]),
        ({"nccl_network_busbw_floor_gbps": True}, ["nccl_network_busbw_floor_gbps: expected auto or a number"]),
        (
            {"nvidia_driver_reboots": True},
            ["node3: nvidia_driver_reboots: no role", "did you mean nvidia_driver_reboot?"],
        ),
        ({"budgetgpu_simulted": True}, ["node3: budgetgpu_simulted:", "did you mean budgetgpu_simulated?"]),
        ({"torchrun_jobs": {"name": "a"}}, ["node3: torchrun_jobs: expected a YAML list of mappings, found a mapping"]),
        ({"torchrun_jobs": "name=a"}, ["node3: torchrun_jobs: expected a YAML list of mappings, found a string"]),
        ({"torchrun_jobs": ["train"]}, ["node3: torchrun_jobs: expected a YAML list of mappings, found"]),
        ({"probe_pcie_min_width": 3}, ["node3: probe_pcie_min_width: expected int (one of 0, 1, 2, 4, 8, 16, 32)"]),
        ({"cuda_hold": "perhaps"}, ["node3: cuda_hold: expected bool, found 'perhaps'"]),
        ({"budgetgpu_cluster_subnet": "192.168.1.1"}, ["node3: budgetgpu_cluster_subnet: expected a CIDR"]),
        ({"budgetgpu_cluster_subnet": "lan"}, ["node3: budgetgpu_cluster_subnet: expected a CIDR"]),
        ({"budgetgpu_simulated": "maybe"}, ["node3: budgetgpu_simulated: expected bool"]),
        ({"reprovision_force": "sure"}, ["node3: reprovision_force: expected bool"]),
        ({"torchrun_node_rank": "first"}, ["node3: torchrun_node_rank: expected int"]),
        ({"gpu_power_limit_watts": "280W"}, ["node3: gpu_power_limit_watts: expected watts above 0, or a mapping"]),
        ({"gpu_power_limit_watts": {"all": 0}}, ["node3: gpu_power_limit_watts: expected watts above 0"]),
        ({"gpu_power_budget_watts": "1.2 kW"}, ["node3: gpu_power_budget_watts: expected float"]),
    ],
)
def test_bad_inputs_are_refused_naming_host_variable_expected_and_found(variables, expected):
    found = problems(variables)
    assert len(found) == 1, found
    for text in expected:
        assert text in found[0]


@pytest.mark.parametrize(
    "variables",
    [
        {"nvidia_driver_branch": 550, "nvidia_driver_secure_boot": "refuse", "nvidia_driver_reboot": False},
        {"nccl_network_busbw_floor_gbps": "auto"},
        {"nccl_network_busbw_floor_gbps": 0},
        {"nccl_network_busbw_floor_gbps": 2.5},
        {"gpu_power_limit_watts": 280, "gpu_power_budget_watts": 1200},
        {"gpu_power_limit_watts": {"all": 300, "NVIDIA GeForce RTX 3090": 280.5, "01:00.0": 250}},
        {"torchrun_jobs": [{"name": "a", "script": "/srv/a.py", "port": 29600}]},
        # Cluster inputs and the facts roles set are known, not flagged.
        {"budgetgpu_cluster_subnet": "10.0.0.0/24", "budgetgpu_safe_mode": True, "budgetgpu_pending": []},
        {"budgetgpu_cluster_subnet": "", "reprovision_force": True, "torchrun_node_rank": 2},
        # Not the collection's: left alone.
        {"ansible_host": "10.0.0.1", "fake_gpus": 3, "cudaversion": "x"},
    ],
)
def test_good_inputs_pass(variables):
    names = {name: value for name, value in variables.items() if inputs.is_input_name(name)}
    assert problems(names) == []


def test_a_name_like_no_known_one_gets_no_guess():
    found = problems({"budgetgpu_extra_typo": 1})
    assert found == [
        "node3: budgetgpu_extra_typo: no role knows this variable: check its spelling against the roles' argument specs"
    ]


def test_a_renamed_variable_names_its_new_name():
    options = {name: spec for name, spec in OPTIONS.items() if name not in inputs.RENAMED}
    known = KNOWN - set(inputs.RENAMED)
    found = inputs.check_inputs("node1", {"nccl_network_interface": "eth1"}, options, known)
    assert found == ["node1: nccl_network_interface: renamed to budgetgpu_cluster_interface"]


def test_every_role_spec_is_read():
    for role in (REPO / "roles").iterdir():
        spec = role / "meta" / "argument_specs.yml"
        entries = yaml.safe_load(spec.read_text())["argument_specs"].values() if spec.is_file() else []
        # A role without inputs of its own (run_inputs) has nothing to read.
        if any(entry.get("options") for entry in entries):
            assert any(name.startswith(role.name + "_") for name in OPTIONS), role.name
    # an entry point other than main (nvidia_driver's repository, nccl_network's comm_test) counts too
    assert "nccl_network_busbw_floor_gbps" in OPTIONS


def test_every_budgetgpu_fact_the_roles_set_is_known():
    """A new fact with the cluster prefix must be listed, or every run after the play that sets it
    would refuse it as an unknown input."""
    pattern = re.compile(r"^\s+(budgetgpu_[a-z0-9_]+):", re.MULTILINE)
    set_here = set()
    for path in [*REPO.glob("roles/*/tasks/*.yml"), *REPO.glob("roles/*/handlers/*.yml")]:
        set_here.update(pattern.findall(path.read_text()))
    for path in REPO.glob("plugins/modules/*.py"):
        set_here.update(re.findall(r'"(budgetgpu_[a-z0-9_]+)"\s*:', path.read_text()))
    assert set_here - inputs.ROLE_FACTS - set(inputs.OTHER_INPUTS) == set()


def inventory_inputs(path: Path) -> dict:
    """The collection's inputs an inventory file sets (all levels), untemplated values left out."""
    data = yaml.safe_load(path.read_text()) or {}
    found = {}

    def walk(node):
        if isinstance(node, dict):
            for name, value in node.items():
                if isinstance(name, str) and inputs.is_input_name(name):
                    if "{{" not in str(value):
                        found[name] = value
                else:
                    walk(value)

    walk(data)
    return found


@pytest.mark.parametrize(
    "path", ["inventory/example/group_vars/all.yml", "inventory/example/hosts.yml", "inventory/demo/group_vars/all.yml"]
)
def test_the_shipped_inventories_pass(path):
    assert problems(inventory_inputs(REPO / path)) == []


def test_the_settings_that_had_to_agree_are_one_cluster_wide_input_each():
    old = {"node_exporter_port": 9200, "prometheus_node_exporter_port": 9200, "gpu_health_textfile_dir": "/x"}
    old["node_exporter_textfile_dir"] = "/x"
    # Preflight hands the check every name of the collection's prefixes: these among them.
    assert all(inputs.is_input_name(name) for name in old)
    found = inputs.check_inputs("node1", old, OPTIONS, KNOWN)
    assert found == [
        "node1: gpu_health_textfile_dir: renamed to budgetgpu_node_exporter_textfile_dir",
        "node1: node_exporter_port: renamed to budgetgpu_node_exporter_port",
        "node1: node_exporter_textfile_dir: renamed to budgetgpu_node_exporter_textfile_dir",
        "node1: prometheus_node_exporter_port: renamed to budgetgpu_node_exporter_port",
    ]
    assert not set(inputs.RENAMED) & set(OPTIONS)  # no role takes the old names any more
    new = {"budgetgpu_node_exporter_port": 9200, "budgetgpu_node_exporter_textfile_dir": "/srv/textfile"}
    assert inputs.check_inputs("node1", new, OPTIONS, KNOWN) == []
    (bad,) = inputs.check_inputs("node1", {"budgetgpu_node_exporter_port": "high"}, OPTIONS, KNOWN)
    assert bad.startswith("node1: budgetgpu_node_exporter_port: expected int, found 'high'")


def test_the_time_servers_are_a_known_list_of_names():
    # Role probe's clock.yml reads budgetgpu_ntp_servers: set in the inventory it is no unknown input.
    assert problems({"budgetgpu_ntp_servers": ["192.168.1.1", "ntp.lan"]}) == []
    assert problems({"budgetgpu_ntp_server": ["ntp.lan"]}) == [
        "node3: budgetgpu_ntp_server: no role knows this variable: did you mean budgetgpu_ntp_servers?"
    ]
    assert problems({"budgetgpu_ntp_servers": {"a": 1}})[0].startswith(
        "node3: budgetgpu_ntp_servers: expected list of str, found {'a': 1}"
    )
