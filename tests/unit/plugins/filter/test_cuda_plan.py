"""Role cuda's plan filter (plugins/filter/nvidia.py cuda_plan): one call that gives the role its NCCL package, its
toolkit package and its one input check, from the plugin_utils/torch_build.py and driver.py functions (tested in
tests/unit/plugins/plugin_utils/); the role calls no other filter that only it used."""

from __future__ import annotations

from ansible_collections.budgetgpu.cluster.plugins.filter.nvidia import cuda_plan

GPUS = {"count": 1, "driver": {"loaded": True, "cuda_driver_version": "13.0", "version": "580.65.06"}}
INPUTS = {
    "host": "node1",
    "distribution": "Debian",
    "version": "12.7",
    "cuda_version": "12.4",
    "torch_variant": "auto",
    "cuda_variants": ["cu126", "cu128", "cu130"],
    "gpus": GPUS,
    "simulated": False,
    "nccl_install": True,
    "nccl_version": "auto",
    "nccl_versions": {"12": "2.21.5-1+cuda12.4", "13": "2.27.7-1+cuda13.0"},
    "nccl_version_pattern": r"^[0-9]+\.[0-9]+\.[0-9]+-[0-9]+\+cuda[0-9]+(\.[0-9]+)?$",
    "toolkit_install": True,
    "toolkit_source": "nvidia_repo",
    "distro_toolkit_version": "11.8",
    "driver_cuda": "13.0",
    "driver_version": "580.65.06",
}


def test_nccl_follows_the_torch_build_the_driver_gets_and_the_toolkit_is_nvidias() -> None:
    plan = cuda_plan(INPUTS)
    # A 580 driver runs CUDA 13: torch gets cu130, NCCL the CUDA 13 build.
    assert plan["nccl"] == {"version": "2.27.7-1+cuda13.0", "cuda_major": 13, "problem": ""}
    assert plan["toolkit_package"] == "cuda-toolkit-12-4"
    assert plan["problems"] == []
    assert cuda_plan({**INPUTS, "toolkit_source": "distro", "cuda_version": "11.8"})["toolkit_package"] == (
        "nvidia-cuda-toolkit"
    )


def test_auto_on_an_unreadable_driver_chooses_no_build_and_is_refused_when_nccl_is_asked_for() -> None:
    unreadable = {"count": 2, "driver": {"loaded": True, "cuda_driver_version": None}}
    plan = cuda_plan({**INPUTS, "gpus": unreadable, "driver_cuda": None})
    assert plan["nccl"] is None and plan["toolkit_package"] is None
    assert plan["problems"][0].startswith("node1: cuda_torch_variant auto: ")
    assert cuda_plan({**INPUTS, "gpus": unreadable, "driver_cuda": None, "nccl_install": False})["problems"] == []


def test_the_nccl_packages_problem_is_the_checks_and_a_bad_version_leaves_no_toolkit_package() -> None:
    plan = cuda_plan({**INPUTS, "nccl_version": "2.21.5-1+cuda12.4"})
    assert plan["nccl"]["version"] is None and plan["problems"] == [plan["nccl"]["problem"]]
    bad = cuda_plan({**INPUTS, "cuda_version": "twelve"})
    assert bad["toolkit_package"] is None
    assert "node1: cuda_version is 'twelve': expected MAJOR.MINOR such as 12.4" in bad["problems"]
