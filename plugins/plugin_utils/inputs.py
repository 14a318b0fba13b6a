# Copyright: budgetgpu maintainers
# Apache License 2.0 (see galaxy.yml)
"""The inventory's inputs against every role's argument spec, in one place (preflight's
check_inputs action). A role's own argument spec runs only when the role runs on a node; the
driver role is skipped on simulated nodes and the comm test's floor is read by comm_test.yml
alone, so their bad values got through. Here every role's spec is checked for every host, and a
prefixed name that no role knows is named with the nearest known one."""

from __future__ import annotations

import difflib
import functools
import ipaddress
from pathlib import Path

import yaml
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
from ansible_collections.budgetgpu.cluster.plugins.module_utils.gpu_power import caps_shape_ok

# libyaml's loader where there is one: each forked worker reads the specs once, and the pure-Python
# loader takes several times as long.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _read_yaml(path: Path):
    return yaml.load(path.read_text(), Loader=_LOADER)  # noqa: S506 (a safe loader)


# The prefixes that mark a variable as an input of this collection (roles, then the cluster's).
ROLE_PREFIXES = (
    "nvidia_driver_",
    "cuda_",
    "container_runtime_",
    "python_env_",
    "nccl_network_",
    "torchrun_",
    "probe_",
    "preflight_",
    "reprovision_",
    "gpu_sim_",
    "inference_",
    "gpu_power_",
    "gpu_health_",
    "node_exporter_",
    "prometheus_",
    "slurm_",
    "alertmanager_",
)
CLUSTER_PREFIX = "budgetgpu_"

# Inputs that no role's argument spec holds, with their specs: the cluster-wide ones
# (docs/inputs-and-paths.md; each role maps them to a prefixed variable of its own)
# and the few read with a default where they are used.
OTHER_INPUTS = {
    "budgetgpu_cluster_subnet": {"type": "str"},
    "budgetgpu_cluster_interface": {"type": "str"},
    "budgetgpu_user": {"type": "str"},
    # the group of the GPU device files (filter gpu_group; default module_utils/device_allow.py GPU_GROUP) and the
    # users made its members (Slurm's users): roles nvidia_driver, torchrun, inference, gpu_health, slurm
    "budgetgpu_gpu_group": {"type": "str"},
    "budgetgpu_gpu_users": {"type": "list", "elements": "str"},
    # the time servers every node keeps its clock to (role probe's clock.yml)
    "budgetgpu_ntp_servers": {"type": "list", "elements": "str"},
    "budgetgpu_simulated": {"type": "bool"},
    "budgetgpu_sysfs_root": {"type": "path"},
    "budgetgpu_safe_mode": {"type": "bool"},
    # the one control-node directory the playbooks write to (nccl_network_report_dir, reprovision_log_dir)
    "budgetgpu_state_dir": {"type": "path"},
    "budgetgpu_cuda_repo_url": {"type": "str"},
    "budgetgpu_cuda_repo_key_url": {"type": "str"},
    # price and currency of the energy figures (plugins/module_utils/energy.py holds the defaults)
    "budgetgpu_electricity_price_per_kwh": {"type": "float"},
    "budgetgpu_currency": {"type": "str"},
    # what a node draws beside its GPUs, an estimate (energy.DEFAULT_NODE_BASE_WATTS, the guide's 200 W)
    "budgetgpu_node_base_watts": {"type": "float"},
    # node exporter's port and textfile directory (roles node_exporter, prometheus, gpu_health;
    # plugin_utils/monitoring.py NODE_EXPORTER_PORT, TEXTFILE_DIR)
    "budgetgpu_node_exporter_port": {"type": "int"},
    "budgetgpu_node_exporter_textfile_dir": {"type": "path"},
    # scripts/nightly-reprovision --force; read by the probe role (probe_force)
    "reprovision_force": {"type": "bool"},
    # a host's node rank in a static rendezvous (torchrun_jobs' node_ranks)
    "torchrun_node_rank": {"type": "int"},
}
# Facts the roles set (set_fact / ansible_facts): present in hostvars once a play has run.
# tests/unit/plugins/plugin_utils/test_inputs.py greps the roles for new ones.
ROLE_FACTS = frozenset(
    {
        "budgetgpu_gpus",
        "budgetgpu_pcie",
        "budgetgpu_net",
        "budgetgpu_pending",
        "budgetgpu_jobs_active",
        "budgetgpu_disruption_allowed",
        "budgetgpu_probed_this_run",
        "node_venv_ready",
        "budgetgpu_driver",
        "budgetgpu_driver_reboot_pending",
        "budgetgpu_cuda",
        "budgetgpu_nccl",
        "budgetgpu_python_env",
        "budgetgpu_torchrun",
        "budgetgpu_device_allow",
        "budgetgpu_jobs",
        "budgetgpu_job_images",
        "budgetgpu_inference_services",
        "budgetgpu_preflight_scripts",
        "budgetgpu_preflight_jobs_digest",
        "budgetgpu_gpu_quarantine",
        "budgetgpu_energy_reading",
    }
)
# Lists whose items' fields preflight checks, naming job or service and field (cluster_check,
# inference_services_normalize and inference_check): here only their shape.
JOB_LISTS = frozenset({"torchrun_jobs", "inference_services"})
# Inputs that were renamed: the old name is refused with the new one.
RENAMED = {
    "nccl_network_interface": "budgetgpu_cluster_interface",
    # Settings that had to agree across roles, now one cluster-wide input each.
    "node_exporter_port": "budgetgpu_node_exporter_port",
    "prometheus_node_exporter_port": "budgetgpu_node_exporter_port",
    "node_exporter_textfile_dir": "budgetgpu_node_exporter_textfile_dir",
    "gpu_health_textfile_dir": "budgetgpu_node_exporter_textfile_dir",
}


def _nonnegative_number(value) -> bool:
    if isinstance(value, bool):
        return False
    try:
        return float(value) >= 0
    except (TypeError, ValueError):
        return False


def _cidr(value) -> bool:
    try:
        ipaddress.ip_network(value, strict=False)
    except (TypeError, ValueError):
        return False
    return "/" in str(value)


# What an argument spec cannot say: variable -> (expected, test of the templated value).
RULES = {
    "budgetgpu_cluster_subnet": (
        "a CIDR such as 192.168.1.0/24, or empty",
        lambda value: value in ("", None) or _cidr(value),
    ),
    "nccl_network_busbw_floor_gbps": (
        "auto or a number of GB/s >= 0",
        lambda value: value == "auto" or _nonnegative_number(value),
    ),
    # Which GPU each key names, and the cards' ranges, preflight checks on the probe's answers.
    "gpu_power_limit_watts": (
        "watts above 0, or a mapping of all, GPU model, UUID or bus id to watts",
        caps_shape_ok,
    ),
}


def is_input_name(name: str) -> bool:
    """Whether a variable's name marks it as one of this collection's inputs."""
    return name.startswith(ROLE_PREFIXES) or name.startswith(CLUSTER_PREFIX)


@functools.lru_cache(maxsize=4)
def load_specs(roles_dir: str) -> tuple[dict[str, dict], frozenset[str]]:
    """Every role's options (all entry points, merged) by variable name, and every name a role
    knows (its options and its defaults). Read once per process: the files are the collection's."""
    options: dict[str, dict] = {}
    known: set[str] = set()
    for role in sorted(Path(roles_dir).iterdir()):
        spec_file = role / "meta" / "argument_specs.yml"
        if spec_file.is_file():
            entry_points = (_read_yaml(spec_file) or {}).get("argument_specs") or {}
            for entry in entry_points.values():
                for name, spec in (entry.get("options") or {}).items():
                    options.setdefault(name, spec)
        defaults = role / "defaults" / "main.yml"
        if defaults.is_file():
            known.update(_read_yaml(defaults) or {})
    options.update(OTHER_INPUTS)
    return options, frozenset(known | set(options))


def describe(spec: dict) -> str:
    """What an option expects, in words: type, elements, choices."""
    text = spec.get("type", "str")
    if spec.get("elements"):
        text += f" of {spec['elements']}"
    if spec.get("choices"):
        text += f" (one of {', '.join(str(choice) for choice in spec['choices'])})"
    return text


def _shape(value) -> str:
    return "a mapping" if isinstance(value, dict) else "a string" if isinstance(value, str) else type(value).__name__


def _spec_problem(name: str, value, spec: dict) -> str | None:
    if spec.get("type") == "list" and spec.get("elements") == "dict":
        # A string where a list of mappings belongs is never meant: ansible would split it at commas.
        if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
            return f"expected a YAML list of mappings, found {_shape(value)} {value!r}"
        # The jobs' fields: preflight's cluster check names job, field and node (one place).
        if name in JOB_LISTS:
            return None
    # .errors is an exception object (always true); its list is .errors.errors.
    errors = ArgumentSpecValidator({name: spec}).validate({name: value}).errors.errors
    if errors:
        details = "; ".join(error.msg for error in errors)
        return f"expected {describe(spec)}, found {value!r} ({details})"
    return None


def unknown_problem(name: str, known: frozenset[str]) -> str:
    """The message for a prefixed name that no role knows."""
    if name in RENAMED:
        return f"renamed to {RENAMED[name]}"
    # Compared after the shared prefix: on whole names every budgetgpu_* name looks alike.
    prefix = next((p for p in (*ROLE_PREFIXES, CLUSTER_PREFIX) if name.startswith(p)), "")
    rests = [other[len(prefix) :] for other in known if other.startswith(prefix)]
    nearest = difflib.get_close_matches(name[len(prefix) :], rests, n=1, cutoff=0.6)
    hint = f"did you mean {prefix}{nearest[0]}?" if nearest else "check its spelling against the roles' argument specs"
    return f"no role knows this variable: {hint}"


def check_inputs(host: str, variables: dict, options: dict[str, dict], known: frozenset[str]) -> list[str]:
    """Problems of one host's inputs (templated values), each naming host, variable, expected and
    found. `variables` holds only the names is_input_name accepts."""
    known = known | ROLE_FACTS
    problems = []
    for name in sorted(variables):
        value = variables[name]
        if name in options:
            problem = _spec_problem(name, value, options[name])
        elif name in RENAMED or name not in known:
            problem = unknown_problem(name, known)
        else:
            problem = None
        if problem is None and name in RULES and not RULES[name][1](value):
            problem = f"expected {RULES[name][0]}, found {value!r}"
        if problem:
            problems.append(f"{host}: {name}: {problem}")
    return problems
