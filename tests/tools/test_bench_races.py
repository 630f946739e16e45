"""bench_races: the checker-overhead benchmark runs a race-free mix and reports per-op times."""

from __future__ import annotations

import pytest

from scenarios.tools.bench.races import bench_races


@pytest.mark.parametrize("list_op", [False, True])
def test_bench_reports_positive_per_op_times_for_a_race_free_mix(list_op: bool) -> None:
    result = bench_races(rounds=2, reps=1, list_op=list_op)
    assert result.plain_ns > 0 and result.unchecked_ns > 0 and result.checked_ns > 0
    assert result.ratio == result.checked_ns / result.unchecked_ns
    assert result.list_op is list_op


def test_the_description_gives_the_ratio_and_the_checkers_share() -> None:
    out = bench_races(rounds=2, reps=1).describe()
    assert "checked/unchecked" in out and "checker" in out


def test_bad_sizes_are_refused_before_any_work() -> None:
    with pytest.raises(ValueError, match="rounds and reps must be positive"):
        bench_races(rounds=0)
