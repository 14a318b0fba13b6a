"""Which wheels of a wheelhouse satisfy a requirement (plugins/plugin_utils/wheelhouse.py), as pip reads
wheel names and version specifiers, and where a relative python_env_wheelhouse lies."""

from __future__ import annotations

import pytest
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.wheelhouse import wheelhouse_folder, wheels_for

WHEELHOUSE = [
    "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",
    "vllm-0.10.2-cp38-abi3-manylinux1_x86_64.whl",
    "vllm-0.11.0-cp38-abi3-manylinux1_x86_64.whl",
    "vllm_flash_attn-2.6.2-cp311-cp311-manylinux1_x86_64.whl",
    ".filled-vllm-0123456789ab",
    "vllm-0.12.0.tar.gz",
]


@pytest.mark.parametrize(
    ("requirement", "expected"),
    [
        ("vllm==0.11.0", ["vllm-0.11.0-cp38-abi3-manylinux1_x86_64.whl"]),
        # PEP 440: 0.11 is 0.11.0; an unpinned package takes any release; another project's prefix is not it.
        ("vllm==0.11", ["vllm-0.11.0-cp38-abi3-manylinux1_x86_64.whl"]),
        ("vllm", ["vllm-0.10.2-cp38-abi3-manylinux1_x86_64.whl", "vllm-0.11.0-cp38-abi3-manylinux1_x86_64.whl"]),
        ("vllm==0.12.0", []),
        # A pin without a local label takes the local builds (torch's +cpu, +cu128), as pip does.
        ("torch==2.13.0", ["torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"]),
        ("torch==2.13.0+cu128", []),
        ("VLLM-Flash.Attn==2.6.2", ["vllm_flash_attn-2.6.2-cp311-cp311-manylinux1_x86_64.whl"]),
    ],
)  # fmt: skip
def test_wheels_for_a_requirement(requirement, expected):
    assert wheels_for(requirement, WHEELHOUSE) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [(".cache/wheelhouse", "/srv/play/.cache/wheelhouse"), ("../wheels/", "/srv/wheels"), ("/data/w", "/data/w")],
)
def test_a_relative_wheelhouse_lies_under_the_playbook(value, expected):
    assert wheelhouse_folder(value, "/srv/play") == expected
