"""budgetgpu NCCL network filters: thin wrappers over plugins/plugin_utils/nccl.py (documented in nccl_*.yml)."""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleFilterError
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils import nccl as _nccl


def nccl_env_file(env: dict[str, str]) -> str:
    try:
        return _nccl.nccl_env_file(env)
    except ValueError as exc:
        raise AnsibleFilterError(str(exc)) from exc


class FilterModule:
    """budgetgpu NCCL network filters."""

    def filters(self) -> dict[str, Any]:
        return {
            "nccl_env": _nccl.nccl_env,
            "nccl_env_file": nccl_env_file,
            "nccl_absent_members": _nccl.nccl_absent_members,
            "nccl_recorded_members": _nccl.nccl_recorded_members,
            "nccl_member_lines": _nccl.nccl_member_lines,
            "nccl_member_records": _nccl.nccl_member_records,
            "nccl_record_addresses": _nccl.nccl_record_addresses,
            "nccl_absent_report": _nccl.nccl_absent_report,
            "nccl_line_rates": _nccl.nccl_line_rates,
            "nccl_iperf_results": _nccl.nccl_iperf_results,
            "nccl_reachability_plan": _nccl.nccl_reachability_plan,
            "nccl_unreached_message": _nccl.nccl_unreached_message,
            "nccl_busbw_floor": _nccl.nccl_busbw_floor,
            "nccl_comm_report": _nccl.nccl_comm_report,
            "nccl_report_table": _nccl.nccl_report_table,
            "nccl_network_problems": _nccl.nccl_network_problems,
        }
