"""Fixtures of the tests that run the server."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def kernels_built_before_servers(cpu_kernels_built: None) -> None:
    """The kernels built before any test here starts a server process (see ``cpu_kernels_built``)."""
