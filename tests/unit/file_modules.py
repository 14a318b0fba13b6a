"""Import Python files that are not modules of a package: gpu_sim's files, scripts without .py."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path


def load_file_module(name: str, path: Path):
    """Import a Python file by path as a fresh module."""
    loader = importlib.machinery.SourceFileLoader(name, str(path))
    spec = importlib.util.spec_from_loader(name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
