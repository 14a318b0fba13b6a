"""Shared fixtures for the unit tests."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]



@pytest.fixture
def repo_root() -> Path:
    return REPO
