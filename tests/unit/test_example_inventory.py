"""The example inventory (the guide's cluster) names only variables that some role documents,
with values that role's argument spec accepts. Nothing here connects to the example's hosts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((REPO / "inventory/example/group_vars/all.yml").read_text())
# Cluster-wide inputs (docs/inputs-and-paths.md) that no single role owns.
CLUSTER_WIDE = {
    "budgetgpu_cluster_subnet",
    "budgetgpu_user",
    "budgetgpu_electricity_price_per_kwh",
    "budgetgpu_currency",
    "budgetgpu_node_base_watts",
}
TYPES = {"int": int, "bool": bool, "str": str, "list": list, "dict": dict, "path": str, "raw": object}


def argument_specs() -> dict[str, dict]:
    specs = {}
    for path in sorted(REPO.glob("roles/*/meta/argument_specs.yml")):
        for entry in yaml.safe_load(path.read_text())["argument_specs"].values():
            specs.update(entry.get("options") or {})
    return specs


SPECS = argument_specs()


@pytest.mark.parametrize("name", sorted(EXAMPLE))
def test_every_example_variable_is_documented_by_a_role(name):
    assert name in SPECS or name in CLUSTER_WIDE, f"{name} is in inventory/example but in no role's argument_specs"


@pytest.mark.parametrize("name", sorted(set(EXAMPLE) & set(SPECS)))
def test_every_example_value_fits_its_argument_spec(name):
    spec, value = SPECS[name], EXAMPLE[name]
    if "choices" in spec:
        assert value in spec["choices"], f"{name}={value!r}: expected one of {spec['choices']}"
    elif spec.get("type") in TYPES and not (spec.get("type") in ("int", "bool", "str") and isinstance(value, str)):
        assert isinstance(value, TYPES[spec["type"]]), f"{name}={value!r}: expected {spec['type']}"


def test_the_example_hosts_are_the_guides_four_nodes():
    hosts = yaml.safe_load((REPO / "inventory/example/hosts.yml").read_text())
    assert sorted(hosts["all"]["children"]["gpu_nodes"]["hosts"]) == ["node1", "node2", "node3", "node4"]


# --- the guide's power numbers ----------------------------------------------------------------------
# The guide: "Four 3090s at 350W each plus system overhead equals about 1.6KW", "2x EVGA 1300W PSU".
GUIDE_GPU_WATTS, GUIDE_NODE_WATTS, GUIDE_PSU_WATTS = 350, 1600, 2 * 1300


def guide_node_gpus() -> list[dict]:
    """gpu_facts' entries for one of the guide's nodes, from gpu_sim's 4 x RTX 3090 profile."""
    import json

    profile = json.loads((REPO / "roles/gpu_sim/files/profiles/rtx3090x4-risers.json").read_text())
    devices = [device for device in profile["pci"] if "nvml" in device]
    return [
        {
            "index": index,
            "uuid": device["nvml"]["uuid"],
            "bus_id": device["bdf"],
            "name": device["nvml"]["name"],
            **{f"power_limit_{k}_w": device["nvml"][f"power_limit_{k}_mw"] / 1000 for k in ("min", "max", "default")},
        }
        for index, device in enumerate(devices)
    ]


def test_the_examples_power_numbers_are_the_guides():
    base = GUIDE_NODE_WATTS - 4 * GUIDE_GPU_WATTS
    assert EXAMPLE["budgetgpu_node_base_watts"] == base == 200
    assert EXAMPLE["gpu_power_limit_watts"] == GUIDE_GPU_WATTS
    assert EXAMPLE["gpu_power_budget_watts"] == GUIDE_PSU_WATTS - base == 2400
    assert EXAMPLE["budgetgpu_electricity_price_per_kwh"] == 0.12
    hosts = yaml.safe_load((REPO / "inventory/example/hosts.yml").read_text())
    assert list(hosts["all"]["children"]["prometheus"]["hosts"]) == ["node1"]


def test_the_guides_node_fits_the_examples_budget_and_a_one_psu_node_is_refused():
    from ansible_collections.budgetgpu.cluster.plugins.module_utils import gpu_power

    gpus = guide_node_gpus()
    assert len(gpus) == 4
    caps, budget = EXAMPLE["gpu_power_limit_watts"], EXAMPLE["gpu_power_budget_watts"]
    assert gpu_power.cap_problems("node1", gpus, caps, budget) == []
    # The commented lower cap (our choice) fits as well.
    assert gpu_power.cap_problems("node1", gpus, 280, budget) == []
    # The comment's one-PSU node: 1300 W less the rest of the node, 1100 W, under four 350 W caps.
    assert gpu_power.cap_problems("node1", gpus, caps, 1300 - EXAMPLE["budgetgpu_node_base_watts"]) == [
        "node1: gpu_power_budget_watts: the GPUs' limits add up to 1400 W (GPU 0 350 W, GPU 1 350 W, GPU 2 350 W, "
        "GPU 3 350 W), above the budget 1100 W: lower the caps"
    ]
