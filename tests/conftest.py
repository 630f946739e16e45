"""Shared fixtures."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from dbo.sim import SimDevice
from workspace import reset_workspace_manager

# A shell starts a background job with SIGINT ignored, and an ignored signal stays ignored in
# every process started from it; the tests that press Ctrl-C (in-process and in children) need
# Python's own handler, whatever shell ran pytest.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


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


@pytest.fixture(autouse=True, scope="session")
def _recordings_cached_for_this_session_only(tmp_path_factory) -> Iterator[None]:
    """`plan` keeps recordings on disk (`scenarios.tools.plan_cache`): the suite keeps them in
    its own folder, shared by its tests and never the user's ~/.cache."""
    before = os.environ.get("DBO_SIM_CACHE")
    os.environ["DBO_SIM_CACHE"] = str(tmp_path_factory.mktemp("dbo-sim-cache"))
    yield
    if before is None:
        os.environ.pop("DBO_SIM_CACHE", None)
    else:
        os.environ["DBO_SIM_CACHE"] = before
