"""Every filter of nvidia.py, torch.py and disruption.py has a doc sidecar that ansible-doc reads."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ansible_collections.budgetgpu.cluster.plugins.filter import disruption, nvidia, torch

FILTERS = Path(__file__).resolve().parents[4] / "plugins" / "filter"
NAMES = sorted({name for module in (nvidia, torch, disruption) for name in module.FilterModule().filters()})


@pytest.mark.parametrize("name", NAMES)
def test_filter_has_a_sidecar(name):
    doc = yaml.safe_load((FILTERS / f"{name}.yml").read_text())
    documentation = doc["DOCUMENTATION"]
    assert documentation["name"] == name
    assert documentation["short_description"] and documentation["description"]
    assert [part.strip() for part in documentation["positional"].split(",")] == list(documentation["options"])
    assert doc["EXAMPLES"].strip() and doc["RETURN"]["_value"]["description"]
