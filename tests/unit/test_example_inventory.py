"""The example inventory (the guide's cluster) names only variables that some role documents,
with values that role's argument spec accepts. Nothing here connects to the example's hosts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((REPO / "inventory/example/group_vars/all.yml").read_text())
# Cluster-wide inputs (CONTRIBUTING.md) that no single role owns.
CLUSTER_WIDE = {"budgetgpu_cluster_subnet", "budgetgpu_user"}
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
