"""Shared fixtures."""

from __future__ import annotations

import pytest

from dbo.sim import SimDevice


@pytest.fixture
def device() -> SimDevice:
    """A fresh simulated H200 (each test gets its own clocks, streams and race history)."""
    return SimDevice()
