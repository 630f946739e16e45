"""A negative scenario says what caught its fault: in its result (`caught`), as the last cell
of its `run` table row, and in its PNG's title."""

from __future__ import annotations

import pytest

from scenarios.harness import RunOptions, artifact_title
from scenarios.registry import SCENARIOS, ScenarioResult
from scenarios.tools.run_table import Table

# One process each and quick; dp-disagreement (two processes) is covered by tests/comm.
ONE_PROCESS = ["missing-wait-race", "yield-mismatch", "exception-in-ubatch", "locked-growth"]
CAUGHT_AS = {
    "missing-wait-race": "race",
    "yield-mismatch": "YieldMismatchError",
    "exception-in-ubatch": "UBatchError",
    "locked-growth": "WorkspaceLockedError",
}


def test_the_list_covers_every_one_process_negative_scenario():
    negatives = {s.name for s in SCENARIOS.values() if s.negative and s.run is not None}
    assert negatives - set(ONE_PROCESS) == {"dp-disagreement"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ONE_PROCESS)
def test_a_negative_scenario_names_what_caught_its_fault(name):
    result = SCENARIOS[name].run(RunOptions(timeout_s=30.0))
    assert result.passed, result.error
    assert result.caught is not None and CAUGHT_AS[name] in result.caught
    assert "\n" not in result.caught


def test_the_table_row_of_a_negative_scenario_ends_with_what_caught_it():
    caught = ScenarioResult("x", passed=True, negative=True, caught="UBatchError: ubatch 1 raised")
    plain = ScenarioResult("y", passed=True)
    table = Table(["x", "y"])
    assert "caught" in table.header().splitlines()[0]
    assert table.row(caught).endswith("UBatchError: ubatch 1 raised")
    assert table.row(plain).endswith("-")


def test_the_png_title_says_what_was_caught():
    title = artifact_title("yield-mismatch", RuntimeError("x"), "YieldMismatchError: 3 vs 4")
    assert "fault caught: YieldMismatchError: 3 vs 4" in title
