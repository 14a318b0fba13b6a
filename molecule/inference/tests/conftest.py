"""The inference scenario's fixtures, for test_inference.py and test_llamacpp.py."""

from __future__ import annotations

import pytest
from test_inference import GATEWAY, NODES, address


@pytest.fixture(name="addresses", scope="session")
def fixture_addresses() -> dict[str, str]:
    """Each node's address on the scenario's network."""
    return {node: address(node) for node in NODES}


@pytest.fixture(name="gateway", scope="session")
def fixture_gateway(addresses: dict[str, str]) -> str:
    """The gateway node's address."""
    return addresses[GATEWAY]
