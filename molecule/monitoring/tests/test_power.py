"""Role gpu_power on the simulated nodes: caps set, set again at a reboot (the container restarted), drift corrected
and reported by a second run, a cap out of range refused by preflight with nothing changed."""

from __future__ import annotations

import json
import os

import pytest
import testinfra.utils.ansible_runner

testinfra_hosts = testinfra.utils.ansible_runner.AnsibleRunner(os.environ["MOLECULE_INVENTORY_FILE"]).get_hosts(
    "gpu_nodes"
)

UNIT = "budgetgpu-gpu-power.service"
CAPS = {"monitoring-3090": [280000, 280000, 280000, 250000], "monitoring-h200": [500000]}
H200_UUID = "GPU-0f7beba8-d2ad-9855-c2eb-a600187383a0"
# What nvidia-smi -q -d POWER reads, through the node's (simulated) NVML.
READ = (
    "import pynvml as n; n.nvmlInit(); "
    "print([n.nvmlDeviceGetPowerManagementLimit(n.nvmlDeviceGetHandleByIndex(i)) "
    "for i in range(n.nvmlDeviceGetCount())])"
)
# provision.yml with every role but gpu_power skipped: the probe, the caps and the summary.
OTHER_ROLES = "nvidia_driver,cuda,python_env,container_runtime,gpu_probe"


def limits(host) -> list[int]:
    return json.loads(host.check_output(f'python3 -c "{READ}"'))


def simulated(host) -> str:
    name = host.backend.get_hostname()
    if name not in CAPS:
        pytest.skip("a node with simulated GPUs")
    return name


def test_caps_are_set_and_the_boot_unit_is_enabled(host):
    name = simulated(host)
    assert limits(host) == CAPS[name]
    unit = host.service(UNIT)
    assert unit.is_enabled and unit.is_running  # oneshot, RemainAfterExit
    table = host.check_output("gpu-probe --sysfs-root /var/lib/budgetgpu-sim/sys")
    expected = "/250 W (100-400)" if name == "monitoring-3090" else "/500 W (200-700)"
    assert expected in table and "energy since the driver loaded: GPU 0 " in table


def test_node_without_a_driver_has_nothing_to_cap(host):
    if host.backend.get_hostname() != "monitoring-nvml":
        pytest.skip("a check for monitoring-nvml")
    assert host.service(UNIT).is_enabled
    assert json.loads(host.file("/etc/budgetgpu/gpu-power.json").content_string)["caps"] == {}
    assert "no power caps declared" in host.check_output(f"journalctl -u {UNIT} --no-pager")


def test_boot_unit_sets_the_caps_again_after_a_reboot(host, reboot):
    name = simulated(host)
    # A cap changed behind the unit's back (nvidia-smi -pl): kept in the simulation's state under /run, as
    # NVML keeps it until the reboot. Only a real boot forgets it, and only the boot unit sets the caps again.
    host.check_output(
        'python3 -c "import pynvml as n; n.nvmlInit(); '
        'n.nvmlDeviceSetPowerManagementLimit(n.nvmlDeviceGetHandleByIndex(0), 300000)"'
    )
    assert limits(host)[0] == 300000
    since = host.check_output("date +%s")
    reboot(host)
    assert limits(host) == CAPS[name]
    assert host.service(UNIT).is_running  # started by the boot (multi-user.target), not by a test
    ran = host.check_output(f"journalctl -u {UNIT} --since=@{since} -o cat --no-pager")
    assert "power limit" in ran, ran


def test_jobs_and_workers_start_after_the_boot_unit(host):
    simulated(host)
    units = {"budgetgpu-job-powercheck.service": "", "budgetgpu-infer-powercheck@.service": "@0"}
    for unit in units:
        host.check_output(f"printf '[Service]\\nExecStart=/bin/true\\n' > /etc/systemd/system/{unit}")
    try:
        host.check_output("systemctl daemon-reload")
        for unit, instance in units.items():
            shown = host.check_output(f"systemctl show -p After -p Wants {unit.replace('@', instance)}")
            assert shown.count(UNIT) == 2, shown
    finally:
        host.check_output("rm -f /etc/systemd/system/budgetgpu-*-powercheck*.service && systemctl daemon-reload")


def test_a_cap_changed_by_hand_is_corrected_by_the_next_run_and_reported(host, tmp_path, playbook):
    if host.backend.get_hostname() != "monitoring-3090":
        pytest.skip("one run for the scenario, on monitoring-3090")
    # nvidia-smi -i 3 -pl 400
    host.check_output(
        'python3 -c "import pynvml as n; n.nvmlInit(); '
        'n.nvmlDeviceSetPowerManagementLimit(n.nvmlDeviceGetHandleByIndex(3), 400000)"'
    )
    assert limits(host)[3] == 400000
    report = tmp_path / "drift.json"
    # As the nightly run does it: safe mode, the drift report callback on.
    done = playbook(
        "provision.yml", "--skip-tags", OTHER_ROLES, "--limit", "monitoring-3090",
        "-e", '{"budgetgpu_safe_mode": true}',
        ANSIBLE_CALLBACKS_ENABLED="budgetgpu.cluster.drift_report", BUDGETGPU_DRIFT_REPORT=str(report),
        ANSIBLE_CALLBACK_RESULT_FORMAT="json",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert limits(host) == CAPS["monitoring-3090"]
    changed = json.loads(report.read_text())["hosts"]["monitoring-3090"]["changed"]
    power = [entry for entry in changed if entry["role"] == "gpu_power"]
    assert [entry["drift"] for entry in power] == [
        ["GPU 3 (GPU-30900003-5a1e-4c0d-9b7e-000000000003, 0000:04:00.0, NVIDIA GeForce RTX 3090): "
         "power limit 400 W -> 250 W"]
    ]  # fmt: skip
    assert "at $0.12/kWh" in done.stdout  # the provisioning summary's energy line


def test_preflight_refuses_a_cap_out_of_the_cards_range_and_changes_nothing(host, playbook):
    if host.backend.get_hostname() != "monitoring-h200":
        pytest.skip("one run for the scenario, on monitoring-h200")
    config = host.file("/etc/budgetgpu/gpu-power.json").content_string
    done = playbook(
        "preflight.yml", "--limit", "monitoring-h200", "-e", '{"gpu_power_limit_watts": {"all": 800}}',
        ANSIBLE_CALLBACK_RESULT_FORMAT="json",
    )  # fmt: skip
    assert done.returncode != 0
    assert (
        f"FAIL monitoring-h200: gpu_power_limit_watts['all']: GPU 0 ({H200_UUID}, 0000:00:06.0, NVIDIA H200): 800 W is "
        "outside the card's range 200-700 W" in done.stdout
    ), done.stdout[-3000:]
    assert limits(host) == CAPS["monitoring-h200"]
    assert host.file("/etc/budgetgpu/gpu-power.json").content_string == config
