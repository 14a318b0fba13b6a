"""energy: kWh from the counter, from a steady draw and from samples, and the guide's cost arithmetic."""

from __future__ import annotations

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


def reading(time_s: float, **joules: float) -> dict:
    gpus = {"gpus": [{"index": i, "uuid": uuid, "energy_total_j": j} for i, (uuid, j) in enumerate(joules.items())]}
    return energy.energy_reading(gpus, time_s)


def test_a_day_of_the_guides_cluster_is_38_4_kwh_and_4_61():
    # Four GPUs drawing 400 W each (1.6 kW) for the 24 hours between two nightly runs.
    day_j = 1600 * 24 * 3600 / 4
    then = reading(1_000_000, a=5e6, b=5e6, c=5e6, d=5e6)
    now = reading(1_000_000 + 24 * 3600, a=5e6 + day_j, b=5e6 + day_j, c=5e6 + day_j, d=5e6 + day_j)
    day = energy.energy_per_day(then, now)
    assert day["kwh_per_day"] == pytest.approx(38.4) and day["hours"] == pytest.approx(24)
    assert day["cost_per_day"] == pytest.approx(4.608)
    assert day["line"] == (
        "energy: 38.40 kWh a day = $4.61 a day at $0.12/kWh"
        " (38.40 kWh on 4 GPUs over 24.0 h since the last nightly run)"
    )


def test_a_shorter_or_longer_window_is_scaled_to_a_day():
    # 6 hours at 1 kW (a run started late, or run by hand in between): 6 kWh, 24 kWh a day.
    then, now = reading(0, a=0), reading(6 * 3600, a=1000 * 6 * 3600)
    assert energy.energy_per_day(then, now)["kwh_per_day"] == pytest.approx(24)
    # A night skipped: 48 h at 500 W is 24 kWh, 12 kWh a day.
    then, now = reading(0, a=0), reading(48 * 3600, a=500 * 48 * 3600)
    assert energy.energy_per_day(then, now)["kwh_per_day"] == pytest.approx(12)


def test_the_price_and_currency_of_this_run_apply():
    then = reading(0, a=0)
    now = energy.energy_reading({"gpus": [{"uuid": "a", "energy_total_j": 3.6e6}]}, 24 * 3600, 0.30, "EUR")
    line = energy.energy_per_day(then, now)["line"]
    assert line.startswith("energy: 1.00 kWh a day = 0.30 EUR a day at 0.30 EUR/kWh")


def test_a_gpu_whose_counter_went_back_or_is_new_is_left_out_and_named():
    # GPU b's driver reloaded (a reboot): its counter restarted; GPU c was not there last night.
    then = reading(0, a=0, b=9e9)
    now = reading(24 * 3600, a=3.6e6, b=1e6, c=5e6)
    day = energy.energy_per_day(then, now)
    assert day["gpus"] == 1 and day["kwh_per_day"] == pytest.approx(1)
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
