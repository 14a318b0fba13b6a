# Copyright: budgetgpu maintainers
# Apache License 2.0 (see galaxy.yml)
# ruff: noqa: E402 (the plugin's imports follow DOCUMENTATION, as ansible's own do)
"""ansible.builtin.host_group_vars, with a YAML error's file and line kept in the message."""

from __future__ import annotations

DOCUMENTATION = """
    name: group_vars
    short_description: host_group_vars that names file and line on a YAML error
    requirements:
        - Enabled in configuration (ansible.cfg of budgetgpu, in place of ansible.builtin.host_group_vars)
    description:
        - The same files, the same precedence and the same options as M(ansible.builtin.host_group_vars), whose
          code it runs.
        - ansible-core 2.19's plugin re-raises a YAML error in C(group_vars/all.yml) as "YAML parsing failed" without
          the file; this one re-raises the original error, whose message names the file, line and column.
    options:
      stage:
        ini:
          - key: stage
            section: vars_host_group_vars
        env:
          - name: ANSIBLE_VARS_PLUGIN_STAGE
      _valid_extensions:
        default: [".yml", ".yaml", ".json"]
        description:
          - "Check all of these extensions when looking for 'variable' files which should be YAML or JSON."
        env:
          - name: ANSIBLE_YAML_FILENAME_EXT
        ini:
          - key: yaml_valid_extensions
            section: defaults
        type: list
        elements: string
    extends_documentation_fragment:
      - vars_plugin_staging
"""

from ansible.errors import AnsibleError, AnsibleParserError
from ansible.plugins.vars.host_group_vars import VarsModule as HostGroupVars


class _Hidden:
    """An attribute that reads as absent: ansible warns about REQUIRES_ENABLED (inherited from the
    builtin) on a collection's vars plugin, which is enabled by name instead."""

    def __get__(self, obj, owner=None):
        raise AttributeError("REQUIRES_ENABLED")


class VarsModule(HostGroupVars):
    REQUIRES_ENABLED = _Hidden()

    def get_vars(self, loader, path, entities, cache=True):
        try:
            return super().get_vars(loader, path, entities, cache=cache)
        except AnsibleParserError as err:
            # The builtin raises a new error from str(original): the original (its context) has the origin.
            original = err.__context__
            if isinstance(original, AnsibleError):
                raise original from None
            raise
