"""Import Python files that are not modules of a package: gpu_sim's files, scripts without .py."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path


def load_file_module(name: str, path: Path, register: bool = False):
    """Import a Python file by path as a fresh module; `register` puts it in sys.modules under `name`
    first (dataclasses look their module up there); the caller pops it when done."""
    loader = importlib.machinery.SourceFileLoader(name, str(path))
    spec = importlib.util.spec_from_loader(name, loader)
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    loader.exec_module(module)
    return module
