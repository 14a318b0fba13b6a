# Copyright: budgetgpu maintainers
# Apache License 2.0 (see galaxy.yml)
"""Action plugin of budgetgpu.cluster.install_files: reads each C(src) on the control node (a role's
files/ first, as ansible.builtin.copy does) and sends it as content, so the node gets every file in
one module call."""

from __future__ import annotations

import base64

from ansible.errors import AnsibleActionFail, AnsibleError
from ansible.plugins.action import ActionBase


class ActionModule(ActionBase):
    TRANSFERS_FILES = False

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        args = dict(self._task.args)
        files = args.get("files")
        if not isinstance(files, list) or not all(isinstance(spec, dict) for spec in files):
            raise AnsibleActionFail(f"install_files: files must be a list of dicts, got {type(files).__name__}")
        prepared = []
        for spec in files:
            spec = dict(spec)
            src = spec.pop("src", None)
            if src is not None:
                if "content" in spec:
                    raise AnsibleActionFail(f"install_files: {spec.get('dest')}: give src or content, not both")
                try:
                    path = self._find_needle("files", src)
                    with open(path, "rb") as handle:
                        spec["content_b64"] = base64.b64encode(handle.read()).decode("ascii")
                except (AnsibleError, OSError) as err:
                    raise AnsibleActionFail(f"install_files: {spec.get('dest')}: cannot read src {src}: {err}") from err
            prepared.append(spec)
        args["files"] = prepared
        result.update(self._execute_module(module_name=self._task.action, module_args=args, task_vars=task_vars))
        return result
