"""energy: kWh from the counter, from a steady draw and from samples, and the guide's cost arithmetic."""

from __future__ import annotations

import math

import pytest
from ansible_collections.budgetgpu.cluster.plugins.module_utils import energy


def test_the_guides_day_costs_4_61_at_0_12():
    # "Four 3090s at 350W each plus system overhead equals about 1.6KW. At $0.12/kWh, that's $4.60/day"
    watts = 4 * 350 + 200  # the overhead that makes the guide's 1.6 kW
    day = energy.kwh_from_power(watts, 24)
    assert day == pytest.approx(38.4)
    assert energy.cost(day, energy.DEFAULT_PRICE_PER_KWH) == pytest.approx(4.608)
    # The guide truncates to $4.60; to the cent it is $4.61.
    assert energy.format_money(energy.cost(day, 0.12)) == "$4.61"


def test_the_guides_year_is_about_1_680():
    year = energy.cost(energy.kwh_from_power(1600, 24 * 365), 0.12)
    assert energy.format_money(year) == "$1,681.92"
    assert year == pytest.approx(1680, rel=0.002)  # "Over a year, that's $1,680"


def test_the_guides_california_figure_is_not_its_own_arithmetic():
    # "In California at $0.30/kWh? $4,380": 1.6 kW all year at $0.30 is $4,204.80 ($4,380 is 1.667 kW).
    assert energy.format_money(energy.cost(energy.kwh_from_power(1600, 24 * 365), 0.30)) == "$4,204.80"


def test_nvml_counter_millijoules_become_kwh():
    assert energy.kwh_from_joules(3_600_000) == 1.0
    assert energy.gpu_kwh({"energy_total_j": 7_200_000.0}) == 2.0
    assert energy.gpu_kwh({"energy_total_j": "unsupported"}) is None
    assert energy.gpu_kwh({"energy_total_j": None}) is None


def test_samples_integrate_by_the_trapezoid_rule_in_any_order():
    # 300 W for an hour, then a ramp from 300 W to 100 W over the next hour: 0.3 + 0.2 kWh.
    samples = [(3600.0, 300.0), (0.0, 300.0), (7200.0, 100.0)]
    assert energy.kwh_from_samples(samples) == pytest.approx(0.5)
    assert energy.kwh_from_samples([(0.0, 300.0)]) == 0.0
    # The steady-draw rule and the samples agree.
    assert energy.kwh_from_samples([(0, 1600), (86400, 1600)]) == pytest.approx(energy.kwh_from_power(1600, 24))


def test_money_is_written_with_a_symbol_before_or_a_code_after():
    assert energy.format_money(1234.5, "€") == "€1,234.50"
    assert energy.format_money(4.608, "EUR") == "4.61 EUR"


def test_summary_adds_the_gpus_with_a_counter_and_names_the_others():
    gpus = [
        {"index": 0, "energy_total_j": 3_600_000.0},
        {"index": 1, "energy_total_j": 7_200_000.0},
        {"index": 2, "energy_total_j": "unsupported"},
    ]
    line = energy.energy_summary(gpus, 0.30, "EUR")
    assert line.startswith("energy since the driver loaded: GPU 0 1.00 kWh, GPU 1 2.00 kWh; 3.00 kWh = 0.90 EUR")
    assert "at 0.30 EUR/kWh" in line and "no counter on GPU 2" in line
    assert energy.energy_summary([{"index": 0, "energy_total_j": "unsupported"}]) == (
        "energy: no GPU with an energy counter"
    )


START = {"time": 1000.0, "gpus": {"GPU-a": 1_000_000.0, "GPU-b": 2_000_000.0, "GPU-old": 9_000_000.0}}


def test_a_job_run_counts_each_gpus_counter_since_the_start():
    now = [
        {"index": 0, "uuid": "GPU-a", "energy_total_j": 1_000_000.0 + 3_600_000},  # 1 kWh
        {"index": 1, "uuid": "GPU-b", "energy_total_j": 2_000_000.0 + 1_800_000},  # 0.5 kWh
    ]
    run = energy.job_run_energy(START, now, 0.12, "$")
    assert run["kwh"] == pytest.approx(1.5)
    assert run["cost"] == pytest.approx(0.18)
    assert run["gpus"] == 2
    assert run["line"] == "energy since the job started: 1.500 kWh on 2 GPUs = $0.18 at $0.12/kWh"


def test_a_job_run_leaves_out_a_gpu_without_counter_or_whose_counter_went_back():
    now = [
        {"index": 0, "uuid": "GPU-a", "energy_total_j": 1_000_000.0 + 360_000},
        {"index": 1, "uuid": "GPU-old", "energy_total_j": 5.0},  # the driver reloaded since the start
        {"index": 2, "uuid": "GPU-new", "energy_total_j": 7.0},  # not recorded at the start
        {"index": 3, "uuid": "GPU-b", "energy_total_j": "N/A"},
    ]
    run = energy.job_run_energy(START, now, 0.30, "EUR")
    assert run["kwh"] == pytest.approx(0.1) and run["gpus"] == 1
    assert run["line"].endswith("= 0.03 EUR at 0.30 EUR/kWh (not counted: GPU 1, 2, 3)")


@pytest.mark.parametrize("start", [None, {}, {"gpus": "x"}, "text"])
def test_a_job_run_without_a_start_record_says_so(start):
    run = energy.job_run_energy(start, [{"uuid": "GPU-a", "energy_total_j": 5.0}])
    assert run == {"kwh": None, "cost": None, "gpus": 0, "line": "energy: no counters recorded at the job's start"}


def test_a_job_run_on_gpus_without_counters_says_so():
    run = energy.job_run_energy({"gpus": {}}, [{"uuid": "GPU-a", "energy_total_j": None}])
    assert run["kwh"] is None and run["line"] == "energy: no GPU with an energy counter since the job's start"


def reading(time_s: float, cpu: dict | None = None, base_watts: float | None = None, **joules: float) -> dict:
    gpus = {"gpus": [{"index": i, "uuid": uuid, "energy_total_j": j} for i, (uuid, j) in enumerate(joules.items())]}
    return energy.energy_reading(gpus, time_s, cpu=cpu, base_watts=base_watts)


GUIDE_GPU_WATTS = 350  # "Four 3090s at 350W each plus system overhead equals about 1.6KW"
DAY_S = 24 * 3600


def guide_day(cpu_then: dict | None = None, cpu_now: dict | None = None) -> dict:
    """One of the guide's nodes at full load for the 24 hours between two nightly runs: four 3090s at 350 W
    on NVML's counters, the RAPL reader's states at both runs (or none), budgetgpu_node_base_watts unset."""
    gpu_j = GUIDE_GPU_WATTS * DAY_S
    then = reading(1_000_000, cpu=cpu_then, a=5e6, b=5e6, c=5e6, d=5e6)
    now = reading(1_000_000 + DAY_S, cpu=cpu_now, a=5e6 + gpu_j, b=5e6 + gpu_j, c=5e6 + gpu_j, d=5e6 + gpu_j)
    return energy.energy_per_day(then, now)


def rapl_state(time_s: float, joules: float) -> dict:
    return {"time": time_s, "boot_id": "b", "joules": joules, "zones": {"intel-rapl:0": {"joules": joules}}}


def test_the_guides_node_at_full_load_costs_its_4_60_a_day_without_rapl():
    # What the guide's figure covers: one node ("Four 3090s at 350W each plus system overhead equals
    # about 1.6KW"), 24/7, "At $0.12/kWh, that's $4.60/day": 1400 W measured + 200 W estimated.
    day = guide_day()
    assert day["gpu_kwh_per_day"] == pytest.approx(33.6) and day["rest_kwh_per_day"] == pytest.approx(4.8)
    assert day["cpu_kwh_per_day"] is None
    assert day["kwh_per_day"] == pytest.approx(38.4) and day["hours"] == pytest.approx(24)
    assert day["cost_per_day"] == pytest.approx(4.608)
    # The guide writes $4.60 (4.608 cut to the cent; its year, $1,680, is 365 x 4.60); to the cent $4.61.
    assert math.floor(day["cost_per_day"] * 100) / 100 == 4.60
    assert day["line"] == (
        "energy: 38.40 kWh a day = $4.61 a day at $0.12/kWh (GPUs 33.60 kWh: 33.60 kWh measured on 4 GPUs"
        " over 24.0 h since the last nightly run; rest of the node, CPU included, estimated at"
        " budgetgpu_node_base_watts 200 W (no RAPL reading): 4.80 kWh)"
    )


def test_the_guides_node_at_full_load_costs_the_same_with_the_cpu_measured_by_rapl():
    # The Celeron G5905 of the guide's build measured at 45 W on average: part of the 200 W, not on top.
    cpu_j = 45 * DAY_S
    day = guide_day(rapl_state(999_970, 1e5), rapl_state(999_970 + DAY_S, 1e5 + cpu_j))
    assert day["cpu_kwh_per_day"] == pytest.approx(1.08) and day["rest_kwh_per_day"] == pytest.approx(3.72)
    assert day["kwh_per_day"] == pytest.approx(38.4) and day["cost_per_day"] == pytest.approx(4.608)
    assert (
        "CPU 1.08 kWh measured by RAPL; rest of the node estimated at budgetgpu_node_base_watts 200 W less"
        in day["line"]
    )
    assert "the CPU's 45 W: 3.72 kWh)" in day["line"]


def test_a_cpu_above_the_estimate_counts_as_measured_and_says_so():
    cpu_j = 260 * DAY_S
    day = guide_day(rapl_state(0, 0), rapl_state(DAY_S, cpu_j))
    assert day["rest_kwh_per_day"] == 0 and day["kwh_per_day"] == pytest.approx(33.6 + 6.24)
    assert "raise budgetgpu_node_base_watts" in day["line"]


def test_the_base_watts_of_the_inventory_apply():
    then = reading(0, a=0)
    now = reading(DAY_S, base_watts=50, a=0)
    assert energy.energy_per_day(then, now)["rest_kwh_per_day"] == pytest.approx(1.2)


def test_a_shorter_or_longer_window_is_scaled_to_a_day():
    # 6 hours at 1 kW (a run started late, or run by hand in between): 6 kWh, 24 kWh a day.
    then, now = reading(0, a=0), reading(6 * 3600, a=1000 * 6 * 3600)
    assert energy.energy_per_day(then, now)["gpu_kwh_per_day"] == pytest.approx(24)
    # A night skipped: 48 h at 500 W is 24 kWh, 12 kWh a day.
    then, now = reading(0, a=0), reading(48 * 3600, a=500 * 48 * 3600)
    assert energy.energy_per_day(then, now)["gpu_kwh_per_day"] == pytest.approx(12)


def test_the_price_and_currency_of_this_run_apply():
    then = reading(0, a=0)
    now = energy.energy_reading({"gpus": [{"uuid": "a", "energy_total_j": 3.6e6}]}, DAY_S, 0.30, "EUR", base_watts=0)
    line = energy.energy_per_day(then, now)["line"]
    assert line.startswith("energy: 1.00 kWh a day = 0.30 EUR a day at 0.30 EUR/kWh")


def test_a_gpu_whose_counter_went_back_or_is_new_is_left_out_and_named():
    # GPU b's driver reloaded (a reboot): its counter restarted; GPU c was not there last night.
    then = reading(0, a=0, b=9e9)
    now = reading(DAY_S, a=3.6e6, b=1e6, c=5e6)
    day = energy.energy_per_day(then, now)
    assert day["gpus"] == 1 and day["gpu_kwh_per_day"] == pytest.approx(1)
    assert day["line"].endswith("(not counted, counter reset or missing: b, c)")
    assert energy.energy_per_day(reading(0, b=9e9), reading(3600, b=1))["kwh_per_day"] is None


def test_nothing_to_compare_says_why():
    now = reading(100, a=1)
    assert energy.energy_per_day(None, now)["line"] == (
        "energy: no reading of an earlier nightly run yet (the next one shows kWh a day)"
    )
    assert energy.energy_per_day(now, now)["kwh_per_day"] is None
    assert energy.energy_per_day(now, None)["line"] == "energy: no reading in this run (no GPU facts)"
    # A GPU without the counter (older than Volta) is not in the reading.
    assert energy.energy_reading({"gpus": [{"uuid": "old", "energy_total_j": "unsupported"}]}, 0)["gpus"] == {}


# --- RAPL: a fixture powercap tree (built here: sysfs names hold ':', which the sanity test refuses) --

# A two-socket server's tree as the kernel lays it out: each package with its core and dram subzones,
# and a client platform's psys zone, which holds the packages.
ZONES = {
    "intel-rapl:0": ("package-0", 262143328850),
    "intel-rapl:0:0": ("core", 262143328850),
    "intel-rapl:0:1": ("dram", 65712999613),
    "intel-rapl:1": ("package-1", 262143328850),
    "intel-rapl:1:0": ("core", 262143328850),
    "intel-rapl:2": ("psys", 262143328850),
}


def powercap_tree(root, energy_uj: dict[str, int]):
    """root/<zone>/{name,energy_uj,max_energy_range_uj}, plus the links and files the real tree has beside."""
    root.mkdir(exist_ok=True)
    for zone, (name, top) in ZONES.items():
        directory = root / zone
        directory.mkdir(exist_ok=True)
        (directory / "name").write_text(name + "\n")
        (directory / "max_energy_range_uj").write_text(f"{top}\n")
        (directory / "energy_uj").write_text(f"{energy_uj.get(zone, 0)}\n")
        (directory / "enabled").write_text("1\n")
    (root / "intel-rapl").mkdir(exist_ok=True)  # the control type's own directory, not a zone
    return str(root)


def test_rapl_counts_each_package_and_its_dram_once(tmp_path):
    root = powercap_tree(tmp_path / "powercap", {"intel-rapl:0": 5_000_000, "intel-rapl:0:1": 1_000_000})
    zones = energy.rapl_zones(root)
    assert sorted(zones) == ["intel-rapl:0", "intel-rapl:0:1", "intel-rapl:1"]
    assert zones["intel-rapl:0"] == {"zone": "package-0", "energy_uj": 5_000_000, "max_energy_range_uj": 262143328850}
    assert zones["intel-rapl:0:1"]["zone"] == "dram-0"
    assert energy.rapl_zones(str(tmp_path / "none")) == {}


def test_rapl_totals_run_on_across_a_wrap_and_a_reboot(tmp_path):
    top = ZONES["intel-rapl:0"][1]
    root = tmp_path / "powercap"
    first = energy.rapl_update(
        None, energy.rapl_zones(powercap_tree(root, {"intel-rapl:0": top - 2_000_000})), 0, "boot1"
    )
    assert first["joules"] == 0, "the first reading starts the count"
    # The package's counter wraps at max_energy_range_uj: 2 J before it and 3 J after it is 5 J.
    second = energy.rapl_update(first, energy.rapl_zones(powercap_tree(root, {"intel-rapl:0": 3_000_000})), 60, "boot1")
    assert second["zones"]["intel-rapl:0"]["joules"] == pytest.approx(5)
    assert second["joules"] == pytest.approx(5) and second["time"] == 60
    # A reboot: the counter is wherever the hardware left it; the node's downtime adds nothing.
    third = energy.rapl_update(second, energy.rapl_zones(powercap_tree(root, {"intel-rapl:0": 100})), 600, "boot2")
    assert third["zones"]["intel-rapl:0"]["joules"] == pytest.approx(5)
    fourth = energy.rapl_update(
        third, energy.rapl_zones(powercap_tree(root, {"intel-rapl:0": 7_000_100})), 660, "boot2"
    )
    assert fourth["zones"]["intel-rapl:0"]["joules"] == pytest.approx(12)
    assert energy.cpu_reading(fourth) == {"time": 660, "joules": pytest.approx(12)}


def test_rapl_samples_and_the_reading_without_rapl():
    state = energy.rapl_update(
        None, {"intel-rapl:0": {"zone": "package-0", "energy_uj": 1, "max_energy_range_uj": 9}}, 5, "b"
    )
    assert energy.rapl_samples(state, 200) == [
        ("budgetgpu_node_cpu_energy_joules_total", {"zone": "package-0"}, 0.0),
        ("budgetgpu_node_cpu_energy_zones", {}, 1.0),
        ("budgetgpu_node_base_watts", {}, 200.0),
        ("budgetgpu_node_cpu_energy_read_timestamp_seconds", {}, 5.0),
    ]
    assert {name for name, _labels, _value in energy.rapl_samples(state, 200)} == set(energy.RAPL_METRICS)
    empty = energy.rapl_update(None, {}, 5, "b")
    assert energy.cpu_reading(empty) is None
    assert ("budgetgpu_node_cpu_energy_zones", {}, 0.0) in energy.rapl_samples(empty, 200)
    assert energy.cpu_reading({"zones": {"x": {}}, "time": "soon", "joules": 1}) is None


def test_the_reading_takes_the_rapl_state_as_slurp_returns_it():
    import base64
    import json

    state = {"time": 50.0, "boot_id": "b", "joules": 12.5, "zones": {"intel-rapl:0": {"joules": 12.5}}}
    slurped = {"content": base64.b64encode(json.dumps(state).encode()).decode(), "encoding": "base64"}
    now = energy.energy_reading({"gpus": []}, 60, cpu=slurped, base_watts=150)
    assert (now["cpu"], now["base_watts"]) == ({"time": 50.0, "joules": 12.5}, 150.0)
    # A node without the reader: slurp failed, nothing to read.
    assert energy.energy_reading({"gpus": []}, 60, cpu={"failed": True, "msg": "file not found"})["cpu"] is None
    assert energy.energy_reading({"gpus": []}, 60, cpu={"content": "bm90IGpzb24=", "encoding": "base64"})["cpu"] is None


def test_a_job_run_counts_the_rest_of_the_node_over_its_hours():
    # Four 3090s at 350 W for 10 hours: 14 kWh measured, 2 kWh of the rest of the node estimated.
    gpus = [{"index": i, "uuid": f"GPU-{i}", "energy_total_j": 350 * 36_000.0} for i in range(4)]
    start = {"time": 1000.0, "gpus": {f"GPU-{i}": 0.0 for i in range(4)}}
    run = energy.job_run_energy(start, gpus, 0.12, "$", now=1000.0 + 36_000)
    assert (run["gpu_kwh"], run["rest_kwh"], run["cpu_kwh"]) == (pytest.approx(14), pytest.approx(2), None)
    assert run["kwh"] == pytest.approx(16) and run["cost"] == pytest.approx(1.92)
    assert run["line"] == (
        "energy since the job started: 16.000 kWh (GPUs 14.000 kWh on 4 GPUs; rest of the node, CPU included,"
        " estimated at budgetgpu_node_base_watts 200 W (no RAPL reading): 2.000 kWh over 10.0 h) = $1.92 at $0.12/kWh"
    )
    # With the CPU's RAPL total at the start and the reader's state now: 50 W measured, 150 W estimated.
    start["cpu"] = {"time": 990.0, "joules": 1000.0}
    state = {"time": 36_990.0, "joules": 1000.0 + 50 * 36_000, "zones": {"intel-rapl:0": {}}}
    run = energy.job_run_energy(start, gpus, 0.12, "$", now=1000.0 + 36_000, base_watts=200, cpu_now=state)
    assert (run["cpu_kwh"], run["rest_kwh"], run["kwh"]) == (pytest.approx(0.5), pytest.approx(1.5), pytest.approx(16))
    assert (
        "CPU 0.500 kWh measured by RAPL; rest of the node estimated at budgetgpu_node_base_watts 200 W" in run["line"]
    )
