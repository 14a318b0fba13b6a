"""The probes inside containers: simulated GPUs, and the real NVML library without a driver."""

from __future__ import annotations

import json
import os

import pytest
import testinfra.utils.ansible_runner

testinfra_hosts = testinfra.utils.ansible_runner.AnsibleRunner(os.environ["MOLECULE_INVENTORY_FILE"]).get_hosts(
    "gpu_nodes"
)

DIR = "/var/lib/budgetgpu-probes"
SYSFS = "/var/lib/budgetgpu-sim/sys"


def facts(host):
    return json.loads(host.file(f"{DIR}/facts.json").content_string)


def by_bus(pcie):
    return {gpu["bus_id"]: gpu for gpu in pcie["gpus"]}


def test_risers_node_tells_slot_limits_from_the_bad_riser(host):
    data = facts(host)
    if data["host"] != "monitoring-3090":
        pytest.skip("a check for monitoring-3090")
    assert data["gpus"]["driver"]["state"] == "loaded" and data["gpus"]["count"] == 4
    assert {gpu["name"] for gpu in data["gpus"]["gpus"]} == {"NVIDIA GeForce RTX 3090"}
    assert data["pcie"]["count"] == 4  # the HDMI audio functions are not GPUs
    gpus = by_bus(data["pcie"])
    assert [gpus[bus]["effective"]["width"] for bus in sorted(gpus)] == [16, 4, 4, 1]
    assert [gpus[bus]["effective"]["gen"] for bus in sorted(gpus)] == [3, 3, 3, 3]
    assert [gpus[bus]["downgraded"] for bus in sorted(gpus)] == [False, False, False, True]
    assert gpus["0000:04:00.0"]["limiting_hop"] == "0000:00:1d.0"
    assert [gpu["bus_id"] for gpu in data["gpus"]["gpus"]] == sorted(gpus)  # NVML and sysfs agree


def test_h200_node_matches_the_reference_capture(host):
    data = facts(host)
    if data["host"] != "monitoring-h200":
        pytest.skip("a check for monitoring-h200")
    gpu = data["gpus"]["gpus"][0]
    assert (gpu["name"], gpu["memory_total_mib"], gpu["compute_capability"]) == ("NVIDIA H200", 143771, "9.0")
    assert gpu["fan_speed_pct"] == gpu["nvlinks_active"] == gpu["numa_node"] == "unsupported"
    link = data["pcie"]["gpus"][0]
    assert (link["effective"]["gen"], link["effective"]["width"], link["downgraded"]) == (5, 16, False)


def test_real_libnvidia_ml_without_driver_says_not_loaded(host):
    data = facts(host)
    if data["host"] != "monitoring-nvml":
        pytest.skip("a check for monitoring-nvml")
    assert host.package("libnvidia-ml1").is_installed
    assert not host.file("/usr/local/lib/budgetgpu-sim/python/pynvml.py").exists  # the real nvidia-ml-py answers
    driver = data["gpus"]["driver"]
    assert (driver["state"], driver["loaded"], data["gpus"]["count"]) == ("not_loaded", False, 0)
    assert "kernel module is not loaded" in driver["reason"]
    assert data["pcie"]["count"] == 2  # GPUs on the bus all the same


def test_cluster_interface_is_eth0(host):
    net = facts(host)["net"]
    assert net["cluster_interface"]["name"] == "eth0"
    eth0 = next(iface for iface in net["interfaces"] if iface["name"] == "eth0")
    assert eth0["kind"] == "veth" and eth0["mtu"] > 0
    assert any(iface["kind"] == "loopback" for iface in net["interfaces"])


def test_gpu_probe_runs_from_the_node_venv_and_agrees_with_the_modules(host):
    data = facts(host)
    assert host.file("/usr/local/bin/gpu-probe").linked_to == "/opt/budgetgpu/node/bin/gpu-probe"
    first_line = host.file("/opt/budgetgpu/node/bin/gpu-probe").content_string.partition("\n")[0]
    assert first_line == "#!/opt/budgetgpu/node/bin/python3 -I"
    out = host.check_output(f"gpu-probe --json --sysfs-root {SYSFS}")
    probe = json.loads(out)
    assert probe["pcie"]["gpus"] == data["pcie"]["gpus"]
    assert probe["gpus"]["driver"]["state"] == data["gpus"]["driver"]["state"]
    assert probe["gpus"]["count"] == data["gpus"]["count"]
    table = host.check_output(f"gpu-probe --sysfs-root {SYSFS}")
    assert f"{data['pcie']['count']} NVIDIA GPU(s) on the PCI bus" in table.splitlines()[0]


NODE_PYTHON = "/opt/budgetgpu/node/bin/python3"


def test_the_node_venv_is_roots_with_the_pins_and_the_package(host):
    for path in ("/opt/budgetgpu/node", "/opt/budgetgpu/node/packages/budgetgpu_node"):
        folder = host.file(path)
        assert (folder.user, folder.group, folder.mode) == ("root", "root", 0o755)
    code = (
        "import json, pynvml; from importlib import metadata; import budgetgpu_node.gpu_health as g;"
        "print(json.dumps({d: metadata.version(d) for d in ('nvidia-ml-py', 'prometheus-client')}"
        " | {'pynvml': pynvml.__file__, 'package': g.__file__}))"
    )
    found = json.loads(host.check_output(f"{NODE_PYTHON} -I -c {json.dumps(code)}"))
    assert (found["nvidia-ml-py"], found["prometheus-client"]) == ("13.615.71", "0.26.0")
    assert found["package"] == "/opt/budgetgpu/node/packages/budgetgpu_node/gpu_health.py"
    # gpu_sim's drop-in answers beneath the binding's callers where it is installed; elsewhere the pin.
    simulated = host.file("/usr/local/lib/budgetgpu-sim/python/pynvml.py").exists
    expected = "/usr/local/lib/budgetgpu-sim/python/pynvml.py" if simulated else "site-packages/pynvml.py"
    assert found["pynvml"].endswith(expected)
    # One copy of the node code: none of the folders an earlier release copied module_utils into.
    assert not host.file("/opt/budgetgpu/gpu-probe").exists and not host.file("/opt/budgetgpu/gpu-health").exists


def test_after_provisioning_gpu_facts_reads_nvml_through_the_pinned_binding(host):
    # facts.json is the last converge's (idempotence): the node venv and its local fact were there.
    binding = facts(host)["gpus"]["driver"]["binding"]
    assert json.loads(host.file("/etc/ansible/facts.d/budgetgpu_node_venv.fact").content_string) == {
        "python": NODE_PYTHON
    }
    if host.file("/usr/local/lib/budgetgpu-sim/python/pynvml.py").exists:
        assert binding["path"] == "/usr/local/lib/budgetgpu-sim/python/pynvml.py"  # beneath the binding's callers
    else:
        assert (binding["distribution"], binding["version"]) == ("nvidia-ml-py", "13.615.71")
        assert binding["path"].startswith("/opt/budgetgpu/node/lib/")
