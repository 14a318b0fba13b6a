"""Inference service filters, thin wrappers over the service model (plugins/plugin_utils/inference/):
fill the services with their defaults, plan a service on a node (its workers on GPUs, its gateway), check
the placement (preflight), render a worker's command. Bad input fails the task with the model's
message (ValueError -> AnsibleFilterError).

Each filter is documented beside this file (<filter>.yml, ``ansible-doc -t filter``).
"""

from __future__ import annotations

from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.filter_errors import as_filter
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference import (
    checks,
    engines,
    gateway,
    gguf_header,
    keys,
    placement,
    plan,
    services,
)


class FilterModule:
    """Inference service filters."""

    def filters(self) -> dict[str, Any]:
        return {
            "inference_services_normalize": as_filter(services.inference_services_normalize),
            "inference_plan": as_filter(plan.inference_plan),
            "inference_gateway_host": as_filter(placement.inference_gateway_host),
            "inference_check": as_filter(checks.inference_check),
            "inference_memory_split": as_filter(checks.inference_memory_split),
            "inference_gguf_header": as_filter(gguf_header.gguf_header),
            "inference_binary_problems": as_filter(checks.inference_binary_problems),
            "inference_worker_command": as_filter(engines.inference_worker_command),
            "inference_rpc_server_command": as_filter(engines.inference_rpc_server_command),
            "inference_rpc_wait_command": as_filter(engines.inference_rpc_wait_command),
            "inference_head_rpc": as_filter(engines.llamacpp_head_rpc),
            "inference_gateway_allow": as_filter(gateway.inference_gateway_allow),
            "inference_firewall_ports": as_filter(gateway.inference_firewall_ports),
            "inference_gateway_keys": as_filter(keys.inference_gateway_keys),
            "inference_user_problems": as_filter(services.inference_user_problems),
            "inference_vllm_venvs": as_filter(checks.inference_vllm_venvs),
            "inference_vllm_wheelhouses": as_filter(checks.inference_vllm_wheelhouses),
            "inference_extra_requirements": as_filter(checks.inference_extra_requirements),
        }
