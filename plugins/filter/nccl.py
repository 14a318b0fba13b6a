"""budgetgpu NCCL network filters: role nccl_network's plan, reachability check and comm test report, each one
call over plugins/plugin_utils/nccl.py (documented in nccl_*.yml)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils import nccl as _nccl
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.filter_errors import as_filter


def nccl_network_plan(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Return role nccl_network's plan on one node: {absent, recorded, member_records, member_addresses,
    member_lines, firewall_ports, absent_report, problems}. inputs: those of nccl_network_problems but absent,
    member_records and recorded, those of nccl_firewall_ports (jobs, groups, user, test_ports,
    allowed_sources), and hostvars, play_hosts_all, play_hosts, record (the text of this node's firewall
    file, empty when it was not read)."""
    members, hostvars = list(inputs.get("members") or []), inputs.get("hostvars")
    absent = _nccl.nccl_absent_members(members, hostvars, inputs.get("play_hosts_all"), inputs.get("play_hosts"))
    recorded = _nccl.nccl_recorded_members(inputs.get("record"))
    records = _nccl.nccl_member_records(members, hostvars, inputs.get("subnet"), recorded)
    kept_in = inputs.get("firewall_file") if inputs.get("firewall") else ""
    return {
        "absent": absent,
        "recorded": recorded,
        "member_records": records,
        "member_addresses": _nccl.nccl_record_addresses(records),
        "member_lines": _nccl.nccl_member_lines(records),
        "firewall_ports": _nccl.nccl_firewall_ports(inputs, records),
        "absent_report": _nccl.nccl_absent_report(absent, records, kept_in or ""),
        "problems": _nccl.nccl_network_problems(
            {**inputs, "absent": absent, "member_records": records, "recorded": recorded}
        ),
    }


def nccl_network_reachability(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Return {listen, connect, problems} for reachability.py on node `host` (nccl_reachability_plan);
    given the probe's `results`, problems also names each target it did not reach. inputs: members,
    hostvars, host, jobs, groups, probe_port, decision (this node's), results."""
    host = inputs.get("host")
    plan = _nccl.nccl_reachability_plan(
        list(inputs.get("members") or []),
        inputs.get("hostvars"),
        host,
        inputs.get("jobs") or [],
        inputs.get("groups") or {},
        int(inputs.get("probe_port")),
    )
    missed = [
        _nccl.nccl_unreached_message(result, host, inputs.get("decision") or {})
        for result in inputs.get("results") or []
        if not result.get("ok")
    ]
    return {"listen": plan["listen"], "connect": plan["connect"], "problems": plan["errors"] + missed}


def nccl_network_report(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Return the comm test's {report, table}: the verdict (nccl_comm_report against nccl_busbw_floor,
    with duration_s, iperf3_streams and each node's interface summary) and its table. inputs: results
    (the master's JSON), iperf (the iperf3 loop's results), decisions ({host: nccl_network_decision}
    in node order), floor_fraction, floor_fraction_virtual, floor_gbps, duration_s, iperf3_streams."""
    decisions = dict(inputs.get("decisions") or {})
    iperf = _nccl.nccl_iperf_results(inputs.get("iperf") or [])
    floor = _nccl.nccl_busbw_floor(
        _nccl.nccl_line_rates(list(decisions.values())),
        [pair["gbs"] for pair in iperf],
        float(inputs.get("floor_fraction")),
        float(inputs.get("floor_fraction_virtual")),
        inputs.get("floor_gbps"),
    )
    report = {
        **_nccl.nccl_comm_report(inputs.get("results") or {}, iperf, floor),
        "duration_s": inputs.get("duration_s"),
        "iperf3_streams": int(inputs.get("iperf3_streams")),
        "interfaces": {host: decision["summary"] for host, decision in decisions.items()},
    }
    return {"report": report, "table": _nccl.nccl_report_table(report)}


class FilterModule:
    """budgetgpu NCCL network filters."""

    def filters(self) -> dict[str, Any]:
        return {
            "nccl_env": _nccl.nccl_env,
            "nccl_env_file": as_filter(_nccl.nccl_env_file),
            "nccl_network_plan": nccl_network_plan,
            "nccl_network_reachability": nccl_network_reachability,
            "nccl_network_report": nccl_network_report,
        }
