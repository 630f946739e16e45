"""The one scenario registry: a scenario's one-process and rank halves meet under one name."""

from __future__ import annotations

import pytest

from scenarios import registry
from scenarios.registry import ScenarioResult, across_ranks, rank_scenario, scenario


@pytest.fixture(autouse=True)
def _empty_registry(monkeypatch):
    monkeypatch.setattr(registry, "SCENARIOS", {})


def _run(opts):
    return ScenarioResult("x", passed=True)


def _rank(env, opts):
    return None


def test_both_halves_of_a_scenario_are_one_entry_listed_where_its_process_half_stands():
    scenario("first", "one process only")(_run)
    rank_scenario("both")(_rank)  # the rank half may register before its process half
    scenario("both", "both halves")(_run)
    assert list(registry.SCENARIOS) == ["first", "both"]
    both = registry.SCENARIOS["both"]
    assert both.run is _run and both.rank is _rank and both.summary == "both halves"
    assert across_ranks() == ["both"]


def test_a_scenario_registered_twice_is_refused():
    scenario("twice", "a")(_run)
    with pytest.raises(ValueError, match="registered twice"):
        scenario("twice", "b")(_run)
    rank_scenario("twice")(_rank)
    with pytest.raises(ValueError, match="two rank halves"):
        rank_scenario("twice")(_rank)


def test_halves_that_disagree_on_negative_are_refused():
    rank_scenario("fault", negative=True)(_rank)
    with pytest.raises(ValueError, match="disagree on negative"):
        scenario("fault", "a fault")(_run)


def test_a_result_reports_non_finite_numbers_as_null():
    result = ScenarioResult("x", passed=True, speedup=float("inf"), max_abs_diff=float("nan"))
    assert result.to_dict()["speedup"] is None and result.to_dict()["max_abs_diff"] is None
