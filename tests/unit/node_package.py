"""The node package under the name the node venv gives it (role node_venv), for the tests: a folder
holding a link budgetgpu_node -> plugins/module_utils, on this process's path and, through PYTHONPATH,
on the path of the scripts the tests start (a test that builds its own environment adds it)."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NODE_PACKAGES = Path(tempfile.mkdtemp(prefix="budgetgpu-node-"))
atexit.register(shutil.rmtree, NODE_PACKAGES, True)
(NODE_PACKAGES / "budgetgpu_node").symlink_to(REPO / "plugins" / "module_utils")
sys.path.append(str(NODE_PACKAGES))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(NODE_PACKAGES), os.environ.get("PYTHONPATH")]))
