"""The node package under the name the node venv gives it (role node_venv), for the tests: `make venv` puts
.venv/node-packages, a folder holding a link budgetgpu_node -> plugins/module_utils, on .venv's path (a .pth).
NODE_PACKAGES names that folder; PYTHONPATH carries it to the scripts the tests start with another python
(a test that builds its own environment adds it)."""

from __future__ import annotations

import os
from pathlib import Path

try:
    import budgetgpu_node
except ImportError as err:  # pragma: no cover - a checkout without `make venv`
    raise ImportError("no budgetgpu_node on this python's path: run `make venv` (.venv/node-packages)") from err

NODE_PACKAGES = Path(next(iter(budgetgpu_node.__path__))).parent
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(NODE_PACKAGES), os.environ.get("PYTHONPATH")]))
