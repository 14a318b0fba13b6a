# Copyright: budgetgpu maintainers
# Apache License 2.0 (see galaxy.yml)
"""Lookup collection_files: files of the collection itself, by a pattern relative to its root."""

# ruff: noqa: E402 (Ansible plugins import after DOCUMENTATION, EXAMPLES and RETURN)

from __future__ import annotations

DOCUMENTATION = r"""
name: collection_files
author: budgetgpu maintainers (!UNKNOWN)
short_description: Files of budgetgpu.cluster itself, by a pattern relative to the collection's root
description:
  - The absolute paths of the collection's own files that match each term, a glob pattern relative to the root of
    budgetgpu.cluster (where C(galaxy.yml) or C(MANIFEST.json) lies), sorted; C(.) is the root itself.
  - How a role reaches what belongs to the collection rather than to one role (the node package,
    C(plugins/module_utils); the nightly script), without going up out of its own folder.
options:
  _terms:
    description: Glob patterns relative to the collection's root.
    required: true
    type: list
    elements: str
"""

EXAMPLES = r"""
- name: Name the node package's files
  ansible.builtin.debug:
    msg: "{{ query('budgetgpu.cluster.collection_files', 'plugins/module_utils/*.py') }}"
"""

RETURN = r"""
_raw:
  description: The matching files' absolute paths, sorted, for each term in turn.
  type: list
  elements: str
"""

import glob
import os
from pathlib import Path

from ansible.plugins.lookup import LookupBase

# plugins/lookup/collection_files.py -> the collection's root.
ROOT = Path(__file__).resolve().parents[2]


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):
        return [os.path.normpath(path) for term in terms for path in sorted(glob.glob(str(ROOT / term)))]
