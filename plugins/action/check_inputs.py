# Copyright: budgetgpu maintainers
# Apache License 2.0 (see galaxy.yml)
"""Action plugin of budgetgpu.cluster.check_inputs: checks, on the control node and without a call
to the node, every input the inventory sets for the host against every role's argument spec
(plugin_utils/inputs.py), and the checks that need no change: the cluster subnet on an interface of
the node, the wheelhouse on the control node."""

from __future__ import annotations

import os
from pathlib import Path

from ansible.errors import AnsibleError
from ansible.plugins.action import ActionBase
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inputs import check_inputs, is_input_name, load_specs
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.nodes import fact, inventory_vars

ROLES_DIR = str(Path(__file__).resolve().parents[2] / "roles")


def _addresses(net: dict) -> str:
    return ", ".join(
        f"{iface.get('name')} {entry.get('address')}/{entry.get('prefixlen')}"
        for iface in net.get("interfaces") or []
        for entry in iface.get("addresses") or []
    )


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _requires_connection = False

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        host = task_vars["inventory_hostname"]
        options, known = load_specs(ROLES_DIR)
        variables, untemplated = self._inputs(host, task_vars)
        problems = check_inputs(host, variables, options, known) + self._node_problems(host, variables, task_vars)
        result.update(
            changed=False,
            failed=bool(problems),
            problems=problems,
            checked=sorted(variables),
            not_templated=untemplated,
            msg="; ".join(problems) if problems else f"{host}: {len(variables)} inputs checked",
        )
        return result

    def _set_by_the_run(self, host: str) -> set[str]:
        """Names that facts, registered results and include_vars of this run (or the fact cache) put
        in hostvars: not the inventory's. The variable manager keeps them apart; no public API."""
        manager = self._task.get_variable_manager()
        names: set[str] = set()
        for cache in ("_fact_cache", "_nonpersistent_fact_cache", "_vars_cache"):
            try:
                names.update(getattr(manager, cache, {}).get(host) or {})
            except (KeyError, TypeError):
                continue
        return names

    def _inputs(self, host: str, task_vars: dict) -> tuple[dict, list[str]]:
        """The host's variables with an input's name, templated, as the inventory (and --extra-vars)
        set them: hostvars hold neither role defaults nor play vars. A value that cannot be templated
        yet (it names a fact gathered later) is left to the role's own check."""
        raw = inventory_vars(task_vars["hostvars"], host)
        names = [name for name in raw if is_input_name(name) and name not in self._set_by_the_run(host)]
        variables, untemplated = {}, []
        for name in names:
            try:
                variables[name] = self._templar.template(raw[name])
            except AnsibleError:
                untemplated.append(name)
        return variables, untemplated

    def _node_problems(self, host: str, variables: dict, task_vars: dict) -> list[str]:
        """Checks of this node's probe answers and the control node that need no change."""
        problems = []
        net = fact(task_vars["hostvars"], host, "budgetgpu_net") or {}
        if net.get("cluster_subnet") and net.get("cluster_interface") is None:
            problems.append(
                f"{host}: budgetgpu_cluster_subnet: expected an interface of the node with an address in "
                f"{net['cluster_subnet']}, found none (addresses: {_addresses(net) or 'none'})"
            )
        wheelhouse = variables.get("python_env_wheelhouse") or ""
        if isinstance(wheelhouse, str) and wheelhouse:
            # As python_env reads it: a relative path is under the playbook's directory.
            path = os.path.normpath(os.path.join(task_vars.get("playbook_dir", ""), wheelhouse))
            if not os.path.isdir(path):
                problems.append(
                    f"{host}: python_env_wheelhouse '{wheelhouse}' is not a directory on the control node (looked at "
                    f'{path}): run scripts/fill-wheelhouse, or set it to "" to install from the package index'
                )
        return problems
