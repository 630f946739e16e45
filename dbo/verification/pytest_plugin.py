"""A pytest plugin for testing your own model under DBO, installed with the package.

The `pytest11` entry point loads it into every pytest run of an environment where dbo-sim is
installed (or load it by hand: `pytest -p dbo.verification.pytest_plugin`). Fixtures:

- `sim_device`: a fresh simulated H200 (its own clocks, streams and race history);
- `dbo_workspace`: a workspace manager initialised for N ubatches (2, or the value of an
  indirect parametrization), reset after the test;
- `dbo_verify`: `dbo.verify` that fails the test with the report's `describe()` (races
  grouped by cause, each with its fix) and the first race in full when the report is not
  ok, and returns the report when it is;
- `dbo_verify_ranks`: `dbo.verify_ranks` (the step on N gloo rank processes, every collective
  checked across them), failing the test with the group report's `describe()` when not ok.

    def test_my_model_overlaps_correctly(dbo_verify):
        dbo_verify(MyModel().forward, torch.randn(64, 128))
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import workspace
from dbo.checks import as_int
from dbo.sim import SimDevice
from dbo.verification.driver import verify
from dbo.verification.ranks import RanksReport, verify_ranks
from dbo.verification.report import VerifyReport

__all__ = ["dbo_verify", "dbo_verify_ranks", "dbo_workspace", "sim_device"]

DEFAULT_NUM_UBATCHES = 2


@pytest.fixture
def sim_device() -> SimDevice:
    """A fresh simulated H200: each test gets its own clocks, streams and race history."""
    return SimDevice()


@pytest.fixture
def dbo_workspace(request: pytest.FixtureRequest) -> Iterator[workspace.WorkspaceManager]:
    """The process-wide workspace manager for N ubatches (default 2; parametrize indirectly
    to change it), on the CPU tensors the simulated device computes with; reset after."""
    num = getattr(request, "param", DEFAULT_NUM_UBATCHES)
    as_int("dbo_workspace's ubatch count", num, minimum=1)
    workspace.reset_workspace_manager()  # a test never inherits another test's manager
    manager = workspace.init_workspace_manager("cpu", num)
    try:
        yield manager
    finally:
        workspace.reset_workspace_manager()


@pytest.fixture
def dbo_verify() -> Callable[..., VerifyReport]:
    """`dbo.verify`, failing the test with the report's description when it is not ok."""

    @functools.wraps(verify)
    def verify_or_fail(*args: Any, **kwargs: Any) -> VerifyReport:
        report = verify(*args, **kwargs)
        if not report.ok:
            pytest.fail(_failure(report), pytrace=False)
        return report

    return verify_or_fail


@pytest.fixture
def dbo_verify_ranks() -> Callable[..., RanksReport]:
    """`dbo.verify_ranks`, failing the test with the group report when it is not ok.

    def test_idle_rank_keeps_step(dbo_verify_ranks):
        dbo_verify_ranks(step, lambda rank, world: batch_for(rank), num_ranks=2)
    """

    @functools.wraps(verify_ranks)
    def verify_ranks_or_fail(*args: Any, **kwargs: Any) -> RanksReport:
        report = verify_ranks(*args, **kwargs)
        if not report.ok:
            pytest.fail(report.describe(), pytrace=False)
        return report

    return verify_ranks_or_fail


def _failure(report: VerifyReport) -> str:
    """The description, then the first race with its stacks: the grouped causes say what is
    missing, the full report where each access was issued from."""
    text = report.describe()
    if report.races:
        text += f"\n\nThe first race in full:\n{report.races[0]}"
    return text
