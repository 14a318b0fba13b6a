"""Choosing the PyTorch wheel that fits a node's driver."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ansible.errors import AnsibleFilterError
from ansible_collections.budgetgpu.cluster.plugins.filter.torch import (
    KNOWN_VARIANTS,
    FilterModule,
    parse_cuda_version,
    torch_pip_index,
    torch_requirement,
    torch_variant,
    torch_variant_problem,
    variant_cuda,
)

REPO = Path(__file__).resolve().parents[4]
PUBLISHED = ["cu126", "cu128", "cu130"]


@pytest.mark.parametrize(
    ("variant", "expected"),
    [("cu118", (11, 8)), ("cu121", (12, 1)), ("cu130", (13, 0)), ("cpu", None), ("auto", None)],
)
def test_variant_cuda(variant, expected):
    assert variant_cuda(variant) == expected


@pytest.mark.parametrize(
    ("version", "expected"),
    [("13.0", (13, 0)), ("12.4", (12, 4)), (12.8, (12, 8)), (None, None), ("", None), ("n/a", None)],
)
def test_parse_cuda_version(version, expected):
    assert parse_cuda_version(version) == expected


@pytest.mark.parametrize(
    ("driver", "expected"),
    [
        ("13.0", "cu130"),  # the H200 fixture: driver 580, CUDA 13.0
        ("13.2", "cu130"),
        ("12.9", "cu128"),
        ("12.8", "cu128"),
        ("12.6", "cu126"),
        ("12.2", "cu126"),  # older 12.x driver: minor version compatibility, oldest 12.x build
        ("11.8", "cpu"),  # no published build runs there
        (None, "cpu"),  # no driver loaded
    ],
)
def test_auto_picks_the_newest_build_the_driver_runs(driver, expected):
    assert torch_variant("auto", driver, PUBLISHED) == expected


def test_auto_without_candidates_considers_every_known_variant():
    assert torch_variant("auto", "12.4") == "cu124"
    assert torch_variant("auto", "11.4") == "cu118"


@pytest.mark.parametrize("variant", ["cpu", "cu118", "cu128"])
def test_explicit_variant_is_kept(variant):
    assert torch_variant(variant, "13.0", PUBLISHED) == variant


@pytest.mark.parametrize("bad", ["cuda", "cu999", "rocm6.2", ""])
def test_unknown_variant_is_refused_naming_the_choices(bad):
    with pytest.raises(AnsibleFilterError, match="unknown: expected one of auto, cpu"):
        torch_variant(bad, "13.0")


def test_unknown_candidate_is_refused():
    with pytest.raises(AnsibleFilterError, match="cu999"):
        torch_variant("auto", "13.0", ["cu999"])


def test_variant_problem():
    assert torch_variant_problem("cu130", "12.8") == (
        "torch variant cu130 needs a driver for CUDA 13.x or newer, the driver supports CUDA 12.8: "
        'choose an older variant, "auto", or upgrade the driver'
    )
    assert torch_variant_problem("cu128", "12.2") == ""
    assert torch_variant_problem("cu128", None) == ""
    assert torch_variant_problem("cpu", "11.0") == ""


def test_requirement_pins_the_build():
    assert torch_requirement("2.13.0", "cpu") == "torch==2.13.0+cpu"
    assert torch_requirement("2.13.0+cu126", "cu128") == "torch==2.13.0+cu128"
    with pytest.raises(AnsibleFilterError, match="resolved variant"):
        torch_requirement("2.13.0", "auto")
    with pytest.raises(AnsibleFilterError, match="not an exact version"):
        torch_requirement(">=2.0", "cpu")


def test_pip_index():
    assert torch_pip_index("cu128") == "https://download.pytorch.org/whl/cu128"
    assert torch_pip_index("cpu", "http://mirror.local/torch/") == "http://mirror.local/torch/cpu"


def test_filters_are_registered():
    assert set(FilterModule().filters()) == {
        "torch_variant",
        "torch_variant_problem",
        "torch_requirement",
        "torch_pip_index",
        "torch_driver_cuda",
        "python_env_problems",
    }


def test_argument_spec_choices_match_the_filter():
    spec = yaml.safe_load((REPO / "roles/python_env/meta/argument_specs.yml").read_text())
    option = spec["argument_specs"]["main"]["options"]["python_env_torch_variant"]
    assert tuple(option["choices"]) == KNOWN_VARIANTS
    candidates = spec["argument_specs"]["main"]["options"]["python_env_torch_cuda_variants"]
    assert set(candidates["default"]) <= set(KNOWN_VARIANTS)
