"""The NCCL package follows the CUDA major of the torch build the venv gets."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.torch_build import (
    UNREADABLE,
    driver_cuda,
    nccl_cuda_major,
    nccl_package,
    torch_variant,
    torch_variant_problem,
)

REPO = Path(__file__).resolve().parents[4]
PUBLISHED = ["cu126", "cu128", "cu130"]
NCCL = {"12": "2.21.5-1+cuda12.4", "13": "2.27.7-1+cuda13.0"}
DRIVER_580 = {"driver": {"loaded": True, "version": "580.95.05", "cuda_driver_version": "13.0"}}


def test_a_580_driver_gets_cu130_and_nccl_for_cuda_13():
    variant = torch_variant("auto", driver_cuda(DRIVER_580), PUBLISHED)
    assert variant == "cu130"
    assert nccl_cuda_major(variant, "12.4") == 13
    assert nccl_package("auto", NCCL, variant, "12.4") == {
        "version": "2.27.7-1+cuda13.0",
        "cuda_major": 13,
        "problem": "",
    }


def test_a_580_driver_refuses_nccl_for_cuda_12():
    answer = nccl_package("2.21.5-1+cuda12.4", NCCL, "cu130", "12.4", "node1")
    assert answer["version"] is None
    assert answer["problem"].startswith("node1: cuda_nccl_version is '2.21.5-1+cuda12.4'")
    assert "but torch gets cu130, built for CUDA 13" in answer["problem"]


def test_the_cpu_build_follows_cuda_version():
    assert nccl_package("auto", NCCL, "cpu", "12.4")["version"] == "2.21.5-1+cuda12.4"
    assert nccl_package("2.21.5-1+cuda12.4", NCCL, "cpu", "12.4")["version"] == "2.21.5-1+cuda12.4"


def test_a_550_driver_keeps_cuda_12():
    variant = torch_variant("auto", "12.4", PUBLISHED)
    assert nccl_package("auto", NCCL, variant, "12.4")["version"] == "2.21.5-1+cuda12.4"


def test_auto_without_an_entry_names_the_variable():
    problem = nccl_package("auto", {"12": "x"}, "cu130", "12.4", "node1")["problem"]
    assert problem.startswith("node1: cuda_nccl_versions has no entry for CUDA 13")


def test_nccl_cuda_major_needs_a_resolved_variant():
    with pytest.raises(ValueError, match="resolved variant"):
        nccl_cuda_major("auto", "12.4")


@pytest.mark.parametrize(
    ("fact", "simulated", "expected"),
    [
        (DRIVER_580, False, "13.0"),
        (DRIVER_580, True, None),
        ({"driver": {"loaded": False, "cuda_driver_version": "13.0"}}, False, None),
        ({}, False, None),
        (None, False, None),
        # A binding without nvmlSystemGetCudaDriverVersion (7.352) on a node with GPUs: not "no driver".
        ({"driver": {"loaded": True, "cuda_driver_version": "unsupported"}, "count": 4}, False, UNREADABLE),
        ({"driver": {"loaded": True, "cuda_driver_version": None}, "count": 1}, False, UNREADABLE),
        ({"driver": {"loaded": True, "cuda_driver_version": "unsupported"}, "count": 0}, False, None),
        ({"driver": {"loaded": True, "cuda_driver_version": "unsupported"}, "count": 4}, True, None),
    ],
)
def test_driver_cuda(fact, simulated, expected):
    assert driver_cuda(fact, simulated) == expected


def test_cuda_role_reads_the_same_torch_candidates_as_python_env():
    python_env = yaml.safe_load((REPO / "roles/python_env/defaults/main.yml").read_text())
    cuda = (REPO / "roles/cuda/defaults/main.yml").read_text()
    assert python_env["python_env_torch_cuda_variants"] == PUBLISHED
    assert f"python_env_torch_cuda_variants | default({PUBLISHED!r})".replace('"', "'") in cuda.replace('"', "'")


UBUNTU_2204 = {
    "driver": {
        "loaded": True,
        "version": "535.247.01",
        "cuda_driver_version": "unsupported",
        "errors": {},
        "binding": {
            "module": "pynvml",
            "distribution": "nvidia-ml-py3",
            "version": "7.352.0",
            "path": "/usr/lib/python3/dist-packages/pynvml.py",
        },
    },
    "count": 4,
}


def test_auto_refuses_gpus_whose_cuda_cannot_be_read_and_never_takes_the_cpu_build():
    cuda = driver_cuda(UBUNTU_2204)
    with pytest.raises(ValueError, match="never installs the CPU build on GPUs"):
        torch_variant("auto", cuda, PUBLISHED)
    problem = torch_variant_problem("auto", cuda, UBUNTU_2204)
    assert problem.startswith("the node has 4 NVIDIA GPU(s) with driver 535.247.01 loaded, but pynvml 7.352.0 ")
    assert "(nvidia-ml-py3, /usr/lib/python3/dist-packages/pynvml.py) cannot read the driver's CUDA version" in problem
    assert "nvmlSystemGetCudaDriverVersion: unsupported" in problem
    assert "install nvidia-ml-py 10.418 or newer" in problem and "such as cu128" in problem


def test_an_explicit_variant_on_an_unreadable_driver_is_the_users_choice():
    cuda = driver_cuda(UBUNTU_2204)
    assert torch_variant("cu128", cuda, PUBLISHED) == "cu128"
    assert torch_variant_problem("cu128", cuda, UBUNTU_2204) == ""


def test_a_node_without_nvidia_gpus_keeps_the_cpu_build():
    for fact in ({}, {"driver": {"loaded": False, "state": "no_driver"}, "count": 0}):
        cuda = driver_cuda(fact)
        assert torch_variant("auto", cuda, PUBLISHED) == "cpu"
        assert torch_variant_problem("auto", cuda, fact) == ""


PYTHON_ENV = {
    "host": "node1",
    "os_family": "Debian",
    "owner": "budgetgpu",
    "owner_create": True,
    "owner_present": False,
    "requirements": ["transformers==5.24.0"],
    "variant_asked": "auto",
    "variant_problem": "",
}


def test_python_env_inputs_that_fit_have_no_problem():
    from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.torch_build import python_env_problems

    assert python_env_problems(PYTHON_ENV) == []
    found = {"wheelhouse": "/w", "torch_wheels": ["/w/torch-2.13.0+cpu-cp311-x.whl"]}
    assert python_env_problems({**PYTHON_ENV, **found}) == []


def test_every_python_env_problem_names_host_and_variable():
    from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.torch_build import python_env_problems

    bad = {**PYTHON_ENV, "owner": "root", "requirements": ["NumPy<2", "numpyro", "numpy"], "variant_problem": "no CUDA"}
    assert python_env_problems(bad) == [
        "node1: python_env_owner is 'root', expected an unprivileged user: set budgetgpu_user (or python_env_owner)"
        " to the user that trains",
        "node1: python_env_requirements names numpy (NumPy<2, numpy): the role installs numpy itself, set"
        " python_env_numpy_version instead",
        "node1: python_env_torch_variant auto: no CUDA",
    ]
    missing = {**PYTHON_ENV, "owner": "ana", "owner_create": False}
    assert python_env_problems(missing) == [
        "node1: python_env_owner 'ana' does not exist and python_env_owner_create is false: create the user or set"
        " python_env_owner_create: true"
    ]
    wheelless = {
        **PYTHON_ENV,
        "wheelhouse": "/w",
        "torch_requirement": "torch==2.13.0+cpu",
        "node_python": "3.13",
        "python_executable": "/usr/bin/python3",
        "torch_wheel": "torch-2.13.0+cpu-cp313-*.whl",
        "torch_wheels": [],
    }
    assert python_env_problems(wheelless) == [
        "node1: python_env_wheelhouse /w has no wheel for torch==2.13.0+cpu on Python 3.13 (/usr/bin/python3 on the"
        " node): torch-2.13.0+cpu-cp313-*.whl: add that wheel and its dependencies for Python 3.13"
        ' (scripts/fill-wheelhouse fetches them for Python 3.11), or set python_env_wheelhouse to "" to install from'
        " the package index"
    ]
