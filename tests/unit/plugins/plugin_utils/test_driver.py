"""Driver-domain checks that the nvidia_driver role lists in its one input check."""

from __future__ import annotations

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.driver import (
    module_flavor_decision,
    module_options_problems,
)

GTX_1080_TI = {"bus_id": "0000:03:00.0", "device_id": "0x1b06"}
RTX_5090 = {"bus_id": "0000:04:00.0", "device_id": "0x2b85"}


def test_flavor_decision_returns_the_problem_instead_of_failing():
    decision = module_flavor_decision("open", [GTX_1080_TI], None, 550, "node1")
    assert decision["flavor"] == ""
    assert decision["problem"].startswith("node1: nvidia_driver_kernel_modules is 'open' but 0000:03:00.0")
    assert module_flavor_decision("auto", [GTX_1080_TI, RTX_5090], None, 550, "node1")["problem"].endswith(
        "move one kind of GPU to another node"
    )
    assert module_flavor_decision("auto", [], None, 580) == {"flavor": "open", "problem": ""}
    assert module_flavor_decision("auto", [], None, 550) == {"flavor": "proprietary", "problem": ""}


def test_module_options_problems_name_host_variable_and_entry():
    assert module_options_problems({"nvidia": {"NVreg_PreserveVideoMemoryAllocations": 1}}, "node1") == []
    problems = module_options_problems({"nvidia": "NVreg_X=1", "Bad-Name": {}, "nvidia_drm": {"bad-opt": 1}}, "node1")
    assert [problem.split(" must ", maxsplit=1)[0] for problem in problems] == [
        "node1: nvidia_driver_module_options['nvidia']",
        "node1: nvidia_driver_module_options['Bad-Name']",
        "node1: nvidia_driver_module_options['nvidia_drm']",
    ]
    assert module_options_problems("nvidia=1", "node1") == [
        "node1: nvidia_driver_module_options is str, expected a mapping"
    ]
