"""Shared fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dbo.sim import SimDevice
from workspace import reset_workspace_manager


@pytest.fixture
def device() -> SimDevice:
    """A fresh simulated H200 (each test gets its own clocks, streams and race history)."""
    return SimDevice()


@pytest.fixture(autouse=True)
def _no_workspace_between_tests() -> Iterator[None]:
    """The workspace manager is process-wide: a test that leaves one (locked, sized for its own
    batch) would otherwise be another test's starting state."""
    yield
    reset_workspace_manager()
