"""gpu_health: Xid lines and classes, the kernel log read incrementally, one pass's findings, the state's
transitions and release. bench_pass() is the timing helper docs/benchmarks/gpu-health.md runs."""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path

import pytest
from ansible_collections.budgetgpu.cluster.plugins.module_utils import gpu_health

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures"
H200 = json.loads((FIXTURES / "h200-node" / "nvml.json").read_text())["gpus"][0]

# Kernel log lines as the NVIDIA driver writes them (one of each class, and the older forms).
XID_79 = (
    "Mar  3 04:12:09 node2 kernel: [81234.567890] NVRM: Xid (PCI:0000:03:00): 79, pid=2741, GPU has fallen off the bus."
)
XID_13 = (
    "Mar  3 04:11:58 node2 kernel: NVRM: Xid (PCI:0000:01:00): 13, pid=2741, name=python3, "
    "Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address"
)
XID_45 = "Mar  3 04:11:58 node2 kernel: NVRM: Xid (PCI:0000:01:00): 45, pid='<unknown>', name=<unknown>, Ch 00000010"
XID_63 = "NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked for remapping, reset gpu to activate."
XID_OLD = "Jan 18 11:38:05 localhost kernel: [ 269.517039] NVRM: Xid (0000:01:00): 31, Ch 0000000b, engmask 00000120"
XID_UNKNOWN = "NVRM: Xid (PCI:0000:02:00): 999, pid=1, something new"

# The sample output of Documentation/ABI/testing/sysfs-bus-pci-devices-aer_stats (kernel 4.19+).
AER_CORRECTABLE = """Receiver Error 2
Bad TLP 0
Bad DLLP 0
RELAY_NUM Rollover 0
Replay Timer Timeout 0
Advisory Non-Fatal 0
Corrected Internal Error 0
Header Log Overflow 0
TOTAL_ERR_COR 2
"""
AER_FATAL = """Undefined 0
Data Link Protocol 0
Surprise Down Error 0
Poisoned TLP 0
Flow Control Protocol 0
Completion Timeout 0
Completer Abort 0
Unexpected Completion 0
Receiver Overflow 0
Malformed TLP 0
ECRC 0
Unsupported Request 0
ACS Violation 0
Uncorrectable Internal Error 0
MC Blocked TLP 0
AtomicOp Egress Blocked 0
TLP Prefix Blocked Error 0
TOTAL_ERR_FATAL 0
"""


def gpu(index: int = 0, **changes):
    """One GPU of a sample, healthy: an RTX 3090 at idle, fan at its target."""
    base = {
        "index": index,
        "uuid": f"GPU-30900000-5a1e-4c0d-9b7e-00000000000{index}",
        "bus_id": f"0000:0{index + 1}:00.0",
        "temperature_c": 45,
        "fans": [{"speed_pct": 40, "target_pct": 40}],
        "throttle_reasons": 0x1,
        "ecc_double_bit_volatile": "unsupported",
        "retired_pages": "unsupported",
        "remapped_rows": "unsupported",
        "pcie": {"replay_counter": 0, "width_current": 16, "gen_current": 1},
        "aer": {"correctable": AER_CORRECTABLE, "nonfatal": "TOTAL_ERR_NONFATAL 0\n", "fatal": AER_FATAL},
    }
    base.update(changes)
    return base


def kinds(findings):
    return sorted((f["kind"], f["severity"]) for f in findings)


# -- Xid ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "bus_id", "xid", "klass", "text"),
    [
        (XID_79, "0000:03:00.0", 79, "take_out", "GPU has fallen off the bus."),
        (
            XID_13,
            "0000:01:00.0",
            13,
            "restart",
            "Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address",
        ),
        (XID_45, "0000:01:00.0", 45, "info", "Ch 00000010"),
        (XID_63, "0000:10:1c.0", 63, "info", "Row Remapper: New row marked for remapping, reset gpu to activate."),
        (XID_OLD, "0000:01:00.0", 31, "restart", "Ch 0000000b, engmask 00000120"),
        (XID_UNKNOWN, "0000:02:00.0", 999, "restart", "something new"),
    ],
)
def test_parse_xid_line_reads_each_form(line, bus_id, xid, klass, text):
    event = gpu_health.parse_xid_line(line)
    assert (event["bus_id"], event["xid"], event["class"], event["text"]) == (bus_id, xid, klass, text)


def test_parse_xid_line_ignores_other_lines():
    assert gpu_health.parse_xid_line("NVRM: GPU at PCI:0000:03:00: GPU-b850f46d-d5ea-c752-ddf3-c4453e44d3f7") is None
    assert gpu_health.parse_xid_line("pcieport 0000:00:1c.4: AER: [ 0] RxErr") is None


def test_unknown_xid_restarts_the_application():
    assert gpu_health.classify_xid(999) == ("restart", "unknown Xid 999")


@pytest.mark.parametrize("xid", [46, 48, 62, 64, 74, 79, 95, 109, 119, 120, 140])
def test_the_take_out_xids_take_the_gpu_out(xid):
    """NVIDIA's catalogue: RESET_GPU, RESTART_BM, WORKFLOW_XID_48."""
    assert gpu_health.classify_xid(xid)[0] == "take_out"


@pytest.mark.parametrize(("xid", "klass"), [(63, "info"), (92, "info"), (94, "restart"), (43, "info"), (13, "restart")])
def test_the_catalogue_corrects_the_first_draft(xid, klass):
    """63 and 92 are IGNORE in NVIDIA's catalogue, 94 RESTART_APP: not take-outs."""
    assert gpu_health.classify_xid(xid)[0] == klass


def test_catalogue_uses_only_the_three_classes():
    assert {klass for klass, _title in gpu_health.XID_CATALOGUE.values()} == {"info", "restart", "take_out"}


def test_xid_bus_ids_get_function_0():
    line = "NVRM: Xid (PCI:0000:3B:00): 79, pid=1, GPU has fallen off the bus."
    assert gpu_health.parse_xid_line(line)["bus_id"] == "0000:3b:00.0"


# -- kernel log ------------------------------------------------------------------------------------------


def test_read_journal_returns_events_and_the_last_cursor():
    out = [
        XID_13 + "\n",
        "Mar  3 04:12:00 node2 kernel: usb 1-1: new device\n",
        XID_79 + "\n",
        "-- cursor: s=abc;i=42\n",
    ]
    events, cursor = gpu_health.read_journal(out, "s=abc;i=1")
    assert [e["xid"] for e in events] == [13, 79]
    assert cursor == "s=abc;i=42"


def test_read_journal_keeps_the_cursor_when_nothing_came():
    assert gpu_health.read_journal(["-- No entries --\n"], "s=abc;i=42") == ([], "s=abc;i=42")
    assert gpu_health.read_journal(["-- cursor: \n"], "s=abc;i=42") == ([], "s=abc;i=42")


def _log(*lines: str) -> bytes:
    return "".join(line + "\n" for line in lines).encode()


def test_kern_log_first_pass_starts_at_the_end_unless_told():
    data = _log(XID_79)
    assert gpu_health.read_kern_log(io.BytesIO(data), None, 7, len(data)) == ([], {"inode": 7, "offset": len(data)})
    events, cursor = gpu_health.read_kern_log(io.BytesIO(data), None, 7, len(data), from_start=True)
    assert [e["xid"] for e in events] == [79] and cursor == {"inode": 7, "offset": len(data)}


def test_kern_log_reads_only_what_was_added():
    old = _log(XID_13)
    data = old + _log("kernel: eth0: link up", XID_79)
    events, cursor = gpu_health.read_kern_log(io.BytesIO(data), {"inode": 7, "offset": len(old)}, 7, len(data))
    assert [e["xid"] for e in events] == [79]
    assert cursor == {"inode": 7, "offset": len(data)}


def test_kern_log_leaves_a_half_written_line_for_the_next_pass():
    data = _log(XID_13) + XID_79.encode()
    events, cursor = gpu_health.read_kern_log(io.BytesIO(data), {"inode": 7, "offset": 0}, 7, len(data))
    assert [e["xid"] for e in events] == [13]
    assert cursor["offset"] == len(_log(XID_13))


@pytest.mark.parametrize(
    ("cursor", "inode", "size", "start"),
    [
        ({"inode": 7, "offset": 500}, 8, 900, 0),  # rotated: a new file
        ({"inode": 7, "offset": 500}, 7, 100, 0),  # truncated (copytruncate)
        ({"inode": 7, "offset": 500}, 7, 900, 500),
        (None, 7, 900, 900),
    ],
)
def test_kern_log_start(cursor, inode, size, start):
    assert gpu_health.kern_log_start(cursor, inode, size) == start


def test_kern_log_rotated_file_is_read_from_0():
    data = _log(XID_63)
    events, cursor = gpu_health.read_kern_log(io.BytesIO(data), {"inode": 7, "offset": 4000}, 8, len(data))
    assert [e["xid"] for e in events] == [63] and cursor == {"inode": 8, "offset": len(data)}


# -- AER -----------------------------------------------------------------------------------------------


def test_parse_aer_reads_the_kernel_format():
    counts = gpu_health.parse_aer(AER_CORRECTABLE)
    assert counts["Receiver Error"] == 2 and counts["RELAY_NUM Rollover"] == 0 and counts["total"] == 2
    assert gpu_health.parse_aer(AER_FATAL)["total"] == 0


def test_parse_aer_without_a_total_sums_and_missing_file_is_empty():
    assert gpu_health.parse_aer("Bad TLP 3\nBad DLLP 1\n")["total"] == 4
    assert gpu_health.parse_aer(None) == {}
    assert gpu_health.parse_aer("garbage\n") == {}


# -- findings ------------------------------------------------------------------------------------------


def test_a_healthy_sample_has_no_findings():
    sample = {"gpus": [gpu(i) for i in range(4)]}
    assert gpu_health.pass_findings(sample, sample, {"0000:01:00.0": {"width": 16, "gen": 4}}) == []


def test_dead_fan_at_0_percent_on_a_hot_gpu():
    findings = gpu_health.fan_findings(
        gpu(2, temperature_c=84, fans=[{"speed_pct": 0, "target_pct": 80}]), gpu_health.LIMITS
    )
    assert kinds(findings) == [("dead_fan", "take_out")]
    assert findings[0]["detail"] == "GPU 2 (GPU-30900000..., 0000:03:00.0): fan 0% (target 80%) at 84 C: fan dead?"
    assert findings[0]["gpu"] == "GPU-30900000-5a1e-4c0d-9b7e-000000000002"


def test_fan_far_below_target_names_which_fan():
    fans = [{"speed_pct": 75, "target_pct": 80}, {"speed_pct": 35, "target_pct": 80}]
    findings = gpu_health.fan_findings(gpu(temperature_c=75, fans=fans), gpu_health.LIMITS)
    assert len(findings) == 1 and "fan 1 35% (target 80%)" in findings[0]["detail"]


def test_fan_gap_below_the_limit_or_a_cool_gpu_is_fine():
    assert (
        gpu_health.fan_findings(gpu(temperature_c=80, fans=[{"speed_pct": 60, "target_pct": 80}]), gpu_health.LIMITS)
        == []
    )
    assert (
        gpu_health.fan_findings(gpu(temperature_c=40, fans=[{"speed_pct": 0, "target_pct": 0}]), gpu_health.LIMITS)
        == []
    )
    assert gpu_health.fan_findings(gpu(temperature_c="unsupported", fans=[{"speed_pct": 0}]), gpu_health.LIMITS) == []


def test_fan_not_supported_is_not_dead():
    # The real H200 answers NotSupported for its fan (a passive card in a server's airflow).
    assert H200["fan"].startswith("ERR:NVMLError_NotSupported")
    hot = gpu(temperature_c=85, fans="unsupported")
    assert gpu_health.fan_findings(hot, gpu_health.LIMITS) == []
    single = gpu(temperature_c=85, fan_speed_pct="unsupported")
    del single["fans"]
    assert gpu_health.fan_findings(single, gpu_health.LIMITS) == []


def test_gpu_facts_single_fan_fields_count_as_one_fan():
    one = gpu(temperature_c=85, fan_speed_pct=0)
    del one["fans"]
    findings = gpu_health.fan_findings(one, {**gpu_health.LIMITS, "dead_fan_severity": "warn"})
    assert kinds(findings) == [("dead_fan", "warn")] and "fan 0% at 85 C" in findings[0]["detail"]


def test_throttle_bits_match_pynvml_and_nvml_probe():
    from ansible_collections.budgetgpu.cluster.plugins.module_utils import nvml_probe

    names = dict(nvml_probe.THROTTLE_REASONS)
    assert names[gpu_health.THROTTLE_BITS["clocksThrottleReasonHwThermalSlowdown"]] == "hw_thermal_slowdown"
    assert names[gpu_health.THROTTLE_BITS["clocksThrottleReasonSwPowerCap"]] == "sw_power_cap"
    assert gpu_health.throttle_mask(["gpu_idle", "hw_slowdown"]) == 0x9
    assert gpu_health.throttle_mask("unsupported") is None


@pytest.mark.parametrize(
    ("reasons", "expected"),
    [
        (0x40 | 0x8, [("hw_slowdown", "warn"), ("thermal_throttle_hw", "warn")]),
        (0x20, [("thermal_throttle", "warn")]),
        (["sw_power_cap"], [("power_cap", "info")]),
        (0x80, [("power_brake", "warn")]),
        (0x1, []),
        (None, []),
    ],
)
def test_throttle_findings(reasons, expected):
    assert kinds(gpu_health.throttle_findings(gpu(throttle_reasons=reasons, temperature_c=88))) == expected


def test_memory_findings():
    before = gpu(ecc_double_bit_volatile=0)
    now = gpu(
        ecc_double_bit_volatile=2,
        retired_pages={"single_bit_ecc": 0, "double_bit_ecc": 2, "pending": True},
        remapped_rows={"correctable": 0, "uncorrectable": 1, "pending": True, "failure": False},
    )
    found = gpu_health.memory_findings(now, before)
    assert kinds(found) == [("ecc_dbe", "take_out"), ("remap_pending", "warn"), ("retired_pages_pending", "warn")]
    assert "2 new double-bit ECC errors (2 since boot)" in found[0]["detail"]


def test_remap_failure_takes_out_and_counters_that_went_back_are_ignored():
    rows = {"correctable": 0, "uncorrectable": 9, "pending": True, "failure": True}
    assert kinds(gpu_health.memory_findings(gpu(remapped_rows=rows), {})) == [("remap_failure", "take_out")]
    # After a reboot the volatile count restarts at 0: no growth.
    assert gpu_health.memory_findings(gpu(ecc_double_bit_volatile=0), gpu(ecc_double_bit_volatile=5)) == []


def test_replay_counter_growth_above_the_limit_per_pass():
    before = gpu(pcie={"replay_counter": 100, "width_current": 16, "gen_current": 4})
    slow = gpu(pcie={"replay_counter": 150, "width_current": 16, "gen_current": 4})
    fast = gpu(pcie={"replay_counter": 5100, "width_current": 16, "gen_current": 4})
    assert gpu_health.link_findings(slow, before, {}, gpu_health.LIMITS) == []
    found = gpu_health.link_findings(fast, before, {}, gpu_health.LIMITS)
    assert kinds(found) == [("pcie_replays", "warn")] and "+5000 this pass (5100 total)" in found[0]["detail"]


def test_link_width_below_boot():
    now = gpu(pcie={"replay_counter": 0, "width_current": 1, "gen_current": 3})
    found = gpu_health.link_findings(now, {}, {"width": 4, "gen": 3}, gpu_health.LIMITS)
    assert kinds(found) == [("link_width", "warn")] and "x1, x4 at boot" in found[0]["detail"]


def test_link_gen_below_boot_counts_only_while_busy():
    link = {"replay_counter": 0, "width_current": 16, "gen_current": 1}
    boot = {"width": 16, "gen": 4}
    assert gpu_health.link_findings(gpu(pcie=link, throttle_reasons=0x1), {}, boot, gpu_health.LIMITS) == []
    busy = gpu_health.link_findings(gpu(pcie=link, throttle_reasons=0x4), {}, boot, gpu_health.LIMITS)
    assert kinds(busy) == [("link_gen", "warn")]


def test_aer_growth():
    grown_cor = AER_CORRECTABLE.replace("Bad TLP 0", "Bad TLP 40").replace("TOTAL_ERR_COR 2", "TOTAL_ERR_COR 42")
    grown_fatal = AER_FATAL.replace("Surprise Down Error 0", "Surprise Down Error 1").replace(
        "TOTAL_ERR_FATAL 0", "TOTAL_ERR_FATAL 1"
    )
    now = gpu(aer={"correctable": grown_cor, "nonfatal": "TOTAL_ERR_NONFATAL 3\n", "fatal": grown_fatal})
    found = gpu_health.aer_findings(now, gpu(), gpu_health.LIMITS)
    assert kinds(found) == [("aer_correctable", "warn"), ("aer_fatal", "take_out"), ("aer_nonfatal", "warn")]
    details = {f["kind"]: f["detail"] for f in found}
    assert details["aer_correctable"].endswith("PCIe AER correctable errors +40 this pass (Bad TLP +40)")
    assert "Surprise Down Error +1" in details["aer_fatal"]
    assert "(unnamed)" in details["aer_nonfatal"]


def test_aer_small_correctable_growth_and_no_files_are_quiet():
    few = AER_CORRECTABLE.replace("TOTAL_ERR_COR 2", "TOTAL_ERR_COR 5").replace("Receiver Error 2", "Receiver Error 5")
    assert gpu_health.aer_findings(gpu(aer={"correctable": few}), gpu(), gpu_health.LIMITS) == []
    assert gpu_health.aer_findings(gpu(aer={}), {}, gpu_health.LIMITS) == []
    parsed = {"correctable": {"Bad TLP": 50, "total": 50}}
    assert kinds(gpu_health.aer_findings(gpu(aer=parsed), gpu(), gpu_health.LIMITS)) == [("aer_correctable", "warn")]


def test_xid_findings_map_bus_ids_to_gpus_and_dedupe():
    events = [gpu_health.parse_xid_line(line) for line in (XID_79, XID_79, XID_13, XID_45, XID_UNKNOWN)]
    found = gpu_health.xid_findings(events, [gpu(0), gpu(2)])
    assert kinds(found) == [("xid_13", "warn"), ("xid_45", "info"), ("xid_79", "take_out"), ("xid_999", "warn")]
    by_kind = {f["kind"]: f for f in found}
    assert by_kind["xid_79"]["gpu"] == gpu(2)["uuid"]
    assert by_kind["xid_999"]["gpu"] is None and by_kind["xid_999"]["bus_id"] == "0000:02:00.0"
    assert "Xid 79, GPU has fallen off the bus: GPU has fallen off the bus." in by_kind["xid_79"]["detail"]


def test_pass_findings_puts_it_together():
    before = {"gpus": [gpu(i) for i in range(4)]}
    now = copy.deepcopy(before)
    now["gpus"][1]["temperature_c"] = 82
    now["gpus"][1]["fans"] = [{"speed_pct": 0, "target_pct": 75}]
    now["gpus"][3]["pcie"] = {"replay_counter": 900, "width_current": 1, "gen_current": 1}
    events = [gpu_health.parse_xid_line(XID_79)]
    boot = {"0000:04:00.0": {"width": 4, "gen": 3}}
    found = gpu_health.pass_findings(now, before, boot, events, {"replay_per_pass": 500})
    assert sorted((f["bus_id"], f["kind"]) for f in found) == [
        ("0000:02:00.0", "dead_fan"),
        ("0000:03:00.0", "xid_79"),
        ("0000:04:00.0", "link_width"),
        ("0000:04:00.0", "pcie_replays"),
    ]
    # The first pass has no previous sample: no growth is counted.
    assert [f["kind"] for f in gpu_health.pass_findings(now, None, boot)] == ["dead_fan", "link_width"]


def test_a_gpu_that_fell_off_the_bus_is_missing_and_its_xid_keeps_its_uuid():
    before = {"gpus": [gpu(i) for i in range(4)]}
    now = {"gpus": [gpu(0), gpu(1), gpu(3)]}
    found = gpu_health.pass_findings(now, before, {}, [gpu_health.parse_xid_line(XID_79)])
    assert sorted((f["gpu"], f["kind"], f["severity"]) for f in found) == [
        (UUID2, "gpu_missing", "take_out"),
        (UUID2, "xid_79", "take_out"),
    ]
    assert found[0]["detail"] == "GPU 2 (GPU-30900000..., 0000:03:00.0): no longer listed by NVML: fallen off the bus?"


def test_no_gpu_at_all_is_the_driver_not_a_missing_gpu():
    assert gpu_health.missing_findings({"gpus": []}, {"gpus": [gpu(0)]}) == []
    assert gpu_health.missing_findings({"gpus": [gpu(0)]}, None) == []


def test_a_gpu_still_missing_stays_found_and_clears_when_it_is_back():
    first = {"gpus": [gpu(i) for i in range(4)]}
    gone = {"gpus": [gpu(0), gpu(1), gpu(3)]}
    state, _lines = gpu_health.watch_state(None, gpu_health.pass_findings(gone, first, {}), 100)
    previous = gpu_health.next_previous(gone, first)
    assert [g["uuid"] for g in previous["missing"]] == [UUID2]
    state, lines = gpu_health.watch_state(state, gpu_health.pass_findings(gone, previous, {}), 160)
    assert lines == [] and state["gpus"][UUID2]["status"] == "take_out"
    previous = gpu_health.next_previous(gone, previous)
    back = gpu_health.pass_findings(first, previous, {})
    assert back == []
    state, lines = gpu_health.watch_state(state, back, 220)
    assert lines == [f"cleared: {gpu_health.missing_findings(gone, first)[0]['detail']}"]
    assert state["gpus"][UUID2]["status"] == "take_out"  # until released
    assert gpu_health.next_previous(first, previous) == {**first, "missing": []}


def test_next_previous_keeps_the_previous_sample_while_no_gpu_answers():
    first = {"gpus": [gpu(0)]}
    assert gpu_health.next_previous({"gpus": []}, first) is first
    assert gpu_health.next_previous({"gpus": []}, None) == {"gpus": []}


# -- state ---------------------------------------------------------------------------------------------

FAN = gpu_health.fan_findings(gpu(1, temperature_c=84, fans=[{"speed_pct": 0, "target_pct": 80}]), gpu_health.LIMITS)
THROTTLE = gpu_health.throttle_findings(gpu(1, throttle_reasons=0x20, temperature_c=84))
XID79 = gpu_health.xid_findings([gpu_health.parse_xid_line(XID_79)], [gpu(2)])
UUID1, UUID2 = gpu(1)["uuid"], gpu(2)["uuid"]


def test_a_new_finding_is_logged_once_and_persists_silently():
    state, lines = gpu_health.watch_state(None, THROTTLE, 100)
    assert lines == [
        "warn: GPU 1 (GPU-30900000..., 0000:02:00.0): software thermal slowdown at 84 C",
        "GPU 1 (GPU-30900000..., 0000:02:00.0): status ok -> warn",
    ]
    entry = state["gpus"][UUID1]
    assert entry["status"] == "warn" and entry["reasons"]["thermal_throttle"]["since"] == 100
    state, lines = gpu_health.watch_state(state, THROTTLE, 160)
    assert lines == [] and state["gpus"][UUID1]["reasons"]["thermal_throttle"]["since"] == 100
    assert state["gpus"][UUID1]["since"] == 100


def test_a_cleared_finding_is_logged_once():
    state, _lines = gpu_health.watch_state({"cursor": "s=1"}, THROTTLE, 100)
    state, lines = gpu_health.watch_state(state, [], 160)
    assert lines == [
        "cleared: GPU 1 (GPU-30900000..., 0000:02:00.0): software thermal slowdown at 84 C",
        "GPU 1 (GPU-30900000..., 0000:02:00.0): status warn -> ok",
    ]
    assert state["gpus"][UUID1]["status"] == "ok" and state["gpus"][UUID1]["reasons"] == {}
    assert state["cursor"] == "s=1"
    assert gpu_health.watch_state(state, [], 220)[1] == []


def test_take_out_is_sticky_until_release():
    state, lines = gpu_health.watch_state(None, XID79, 100)
    assert lines[-1].endswith("status ok -> take_out")
    assert state["gpus"][UUID2]["taken_out"] == {"since": 100, "reason": XID79[0]["detail"]}
    state, lines = gpu_health.watch_state(state, [], 160)  # the Xid was an event of one pass
    assert state["gpus"][UUID2]["status"] == "take_out"
    assert lines == [f"cleared: {XID79[0]['detail']}"]
    state, lines = gpu_health.release(state, UUID2, 300)
    assert state["gpus"][UUID2]["status"] == "ok" and state["gpus"][UUID2]["taken_out"] is None
    assert lines == ["GPU 2 (GPU-30900000..., 0000:03:00.0): released (take_out -> ok)"]
    assert gpu_health.watch_state(state, [], 360)[1] == []


def test_release_keeps_warn_reasons_and_a_persisting_fault_comes_back():
    state, _lines = gpu_health.watch_state(None, FAN + THROTTLE, 100)
    assert state["gpus"][UUID1]["status"] == "take_out"
    state, _lines = gpu_health.release(state, UUID1, 200)
    assert state["gpus"][UUID1]["status"] == "warn" and list(state["gpus"][UUID1]["reasons"]) == ["thermal_throttle"]
    state, lines = gpu_health.watch_state(state, FAN + THROTTLE, 260)
    assert lines == [f"take_out: {FAN[0]['detail']}", "GPU 1 (GPU-30900000..., 0000:02:00.0): status warn -> take_out"]


def test_release_of_an_unknown_gpu_changes_nothing():
    state, _lines = gpu_health.watch_state(None, THROTTLE, 100)
    assert gpu_health.release(state, "GPU-nope", 200) == (state, ["release: GPU-nope is not in the health state"])


def test_info_findings_are_logged_but_keep_the_gpu_ok():
    info = gpu_health.throttle_findings(gpu(1, throttle_reasons=0x4, temperature_c=60))
    state, lines = gpu_health.watch_state(None, info, 100)
    assert lines == ["info: GPU 1 (GPU-30900000..., 0000:02:00.0): power capped (software power limit) at 60 C"]
    assert state["gpus"][UUID1]["status"] == "ok"


def test_a_finding_without_a_gpu_is_kept_by_bus_id():
    orphan = gpu_health.xid_findings([gpu_health.parse_xid_line(XID_UNKNOWN)], [])
    state, lines = gpu_health.watch_state(None, orphan, 100)
    assert list(state["gpus"]) == ["0000:02:00.0"] and lines[0].startswith("warn: GPU (uuid unknown, 0000:02:00.0)")


# -- timing (not a test: docs/benchmarks/gpu-health.md runs it) ----------------------------------------


def bench_pass(state=None):
    """One watch pass of the pure functions on a 4-GPU sample with a dead fan, an Xid 79 in 200 log lines,
    growing AER and replay counters; returns the new state. Excludes NVML and I/O."""
    before = {"gpus": [gpu(i) for i in range(4)]}
    now = copy.deepcopy(before)
    now["gpus"][1].update(temperature_c=84, fans=[{"speed_pct": 0, "target_pct": 80}], throttle_reasons=0x20)
    now["gpus"][3]["pcie"] = {"replay_counter": 900, "width_current": 1, "gen_current": 3}
    now["gpus"][0]["aer"] = {**now["gpus"][0]["aer"], "correctable": AER_CORRECTABLE.replace(" 2\n", " 40\n")}
    log = ["Mar  3 04:12:00 node2 kernel: usb 1-1: new high-speed USB device\n"] * 199 + [
        XID_79 + "\n",
        "-- cursor: s=1\n",
    ]
    events, cursor = gpu_health.read_journal(log, "s=0")
    findings = gpu_health.pass_findings(now, before, {"0000:04:00.0": {"width": 4, "gen": 3}}, events)
    new_state, _lines = gpu_health.watch_state({**(state or {}), "cursor": cursor}, findings, 1000)
    return new_state


def test_bench_pass_runs():
    state = bench_pass()
    statuses = {key: entry["status"] for key, entry in state["gpus"].items()}
    assert statuses == {gpu(0)["uuid"]: "warn", UUID1: "take_out", UUID2: "take_out", gpu(3)["uuid"]: "warn"}


# -- quarantine and the next start --------------------------------------------------------------

UUIDS = [gpu(i)["uuid"] for i in range(4)]


def test_boot_links_are_each_gpus_own_trained_link():
    facts = {
        "gpus": [{"bus_id": "0000:04:00.0", "link": {"current_width": 1, "current_gen": 3}, "effective": {"width": 1}}]
    }
    assert gpu_health.boot_links(facts) == {"0000:04:00.0": {"width": 1, "gen": 3}}
    assert gpu_health.boot_links(None) == {}


def test_quarantined_holds_the_watchs_take_outs_and_the_inventorys_list():
    findings = gpu_health.pass_findings({"gpus": [gpu(0), gpu(1, temperature_c=90, fans=[{"speed_pct": 0}])]}, None, {})
    state, _lines = gpu_health.watch_state(None, findings, "t1")
    state["previous"] = {"gpus": [gpu(i) for i in range(4)]}
    out = gpu_health.quarantined(state, [UUIDS[3], "GPU-of-another-node"])
    assert out[UUIDS[3]] == {"reason": "listed in gpu_health_quarantine", "since": None, "by": "inventory"}
    assert out[UUIDS[1]]["by"] == "watch" and out[UUIDS[1]]["since"] == "t1" and "fan 0%" in out[UUIDS[1]]["reason"]
    assert set(out) == {UUIDS[1], UUIDS[3]}
    released, _lines = gpu_health.release(state, UUIDS[1], "t2")
    assert gpu_health.quarantined(released) == {}


OUT = {UUIDS[2]: {"reason": "fan dead", "since": "t1", "by": "watch"}}


@pytest.mark.parametrize(
    ("nproc", "fixed", "action", "visible"),
    [
        (4, False, "start", [UUIDS[0], UUIDS[1], UUIDS[3]]),  # one rank per GPU in service
        (4, True, "hold", [UUIDS[0], UUIDS[1], UUIDS[3]]),  # a fixed size never runs on fewer
        (2, True, "start", UUIDS[:2]),  # GPUs 0 and 1 are all it uses
        (3, True, "hold", UUIDS[:2]),
    ],
)
def test_start_plan(nproc, fixed, action, visible):
    plan = gpu_health.start_plan(UUIDS, OUT, nproc, fixed)
    assert (plan["action"], plan["visible"]) == (action, visible)
    assert plan["nproc"] == len(visible)
    if action == "hold":
        assert plan["reason"] == f"nproc_per_node is fixed at {nproc} and {UUIDS[2]} quarantined since t1 (fan dead)"


def test_start_plan_holds_a_job_with_no_gpu_left_and_changes_nothing_when_none_is_out():
    every = {uuid: {"reason": "listed", "since": None} for uuid in UUIDS}
    plan = gpu_health.start_plan(UUIDS, every, 4, False)
    assert plan["action"] == "hold" and plan["reason"].startswith("no GPU left in service: ")
    assert gpu_health.start_plan(UUIDS, {}, 4, False) == {
        "action": "start",
        "nproc": 4,
        "visible": UUIDS,
        "left_out": [],
        "reason": "",
    }


# -- a running job when a GPU is taken out ------------------------------------------------------


def pass_state(state, sample, now, listed=()):
    """The state one watch pass writes (the script's run_pass, without its I/O)."""
    previous = (state or {}).get("previous")
    findings = gpu_health.pass_findings(sample, previous, {})
    state, _lines = gpu_health.watch_state(state, findings, now)
    state.update(previous=gpu_health.next_previous(sample, previous), updated=now)
    state["quarantine"] = gpu_health.quarantined(state, listed)
    return state


HOT_DEAD_FAN = {"temperature_c": 90, "fans": [{"speed_pct": 0, "target_pct": 80}]}
# Four job units: "gpu" jobs on every GPU and on GPUs 0-1, fixed ones on every GPU and on GPUs 0-1.
UNITS = {
    "budgetgpu-job-all.service": {"minors": {0, 1, 2, 3}, "fixed": ""},
    "budgetgpu-job-fixed4.service": {"minors": {0, 1, 2, 3}, "fixed": "nproc_per_node is fixed"},
    "budgetgpu-job-fixed2.service": {"minors": {0, 1}, "fixed": "nproc_per_node is fixed"},
    "budgetgpu-job-low.service": {"minors": {0, 1}, "fixed": ""},
}


def test_a_gpu_taken_out_restarts_the_gpu_jobs_that_hold_it_and_keeps_the_fixed_ones():
    state = pass_state(None, {"gpus": [gpu(i) for i in range(4)]}, "t0", listed=[UUIDS[3]])
    # The inventory's GPU 3 is nothing new to a running job: its launcher left it out at the start.
    assert gpu_health.job_restarts(state, UNITS) == []
    state = pass_state(state, {"gpus": [gpu(0), gpu(1), gpu(2, **HOT_DEAD_FAN), gpu(3)]}, "t1", listed=[UUIDS[3]])
    decisions = gpu_health.job_restarts(state, UNITS)
    assert [(d["unit"], d["action"]) for d in decisions] == [
        ("budgetgpu-job-all.service", "restart"),
        ("budgetgpu-job-fixed4.service", "keep"),
    ]
    assert decisions[0]["reason"].startswith(f"{UUIDS[2]} quarantined since t1 (GPU 2 (")
    assert "fan 0% (target 80%) at 90 C" in decisions[0]["reason"]
    assert decisions[0]["reason"].endswith("nproc_per_node is gpu: it restarts on the GPUs still in service")
    assert decisions[1]["reason"].endswith("nproc_per_node is fixed: it keeps running, and is held at its next start")
    # The next pass finds the GPU still out: the job restarted once, on the GPUs in service, and stays so.
    state = pass_state(state, {"gpus": [gpu(0), gpu(1), gpu(2, **HOT_DEAD_FAN), gpu(3)]}, "t2", listed=[UUIDS[3]])
    assert gpu_health.job_restarts(state, UNITS) == []
    # A release restarts nothing: the job is back at its full size at its next start.
    released, _lines = gpu_health.release(state, UUIDS[2], "t3")
    released = pass_state(released, {"gpus": [gpu(i) for i in range(4)]}, "t3", listed=[UUIDS[3]])
    assert gpu_health.job_restarts(released, UNITS) == []


def test_a_gpu_off_the_bus_is_found_by_its_remembered_minor_while_the_others_are_renumbered():
    state = pass_state(None, {"gpus": [gpu(i) for i in range(4)]}, "t0")
    # GPU 1 falls off: NVML numbers the three left 0, 1, 2; the job unit still holds minors 0-3.
    renumbered = [gpu(0), {**gpu(2), "index": 1}, {**gpu(3), "index": 2}]
    state = pass_state(state, {"gpus": renumbered}, "t1")
    assert set(gpu_health.newly_quarantined(state)) == {UUIDS[1]}
    units = {
        "budgetgpu-job-a.service": {"minors": {1}, "fixed": ""},
        "budgetgpu-job-b.service": {"minors": {3}, "fixed": ""},
    }
    assert [d["unit"] for d in gpu_health.job_restarts(state, units)] == ["budgetgpu-job-a.service"]
    assert gpu_health.job_restarts(None, units) == []


def test_a_job_runs_on_fewer_gpus_only_with_nproc_per_node_gpu_and_not_under_hsdp():
    assert gpu_health.fixed_size({"BUDGETGPU_NPROC_FIXED": "0", "BUDGETGPU_PARALLELISM": "fsdp"}) == ""
    assert gpu_health.fixed_size({"BUDGETGPU_NPROC_FIXED": "1"}) == "nproc_per_node is fixed"
    assert gpu_health.fixed_size({}) == "nproc_per_node is fixed"  # a unit the launcher leaves as it is
    # hsdp's mesh is nodes x ranks of a node: a node one rank short cannot form it.
    hsdp = {"BUDGETGPU_NPROC_FIXED": "0", "BUDGETGPU_PARALLELISM": "hsdp"}
    assert gpu_health.fixed_size(hsdp) == "hsdp needs as many ranks on every node"
