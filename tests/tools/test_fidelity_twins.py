"""The replay beside the one-rank formula: each all-ranks fidelity row against its twin."""

from __future__ import annotations

import pytest

from scenarios.lib.fidelity_rows import FidelityReport, pp_row, range_pp_row, rel_row
from scenarios.tools.fidelity_run import format_table, twin_comparisons


def _pair(one: float, all_ranks: float, **kw) -> list:
    return [
        rel_row("k", "DeepEP LL combine, EP 8", 100.0, 100.0 + one, "us", "A", "src", **kw),
        rel_row(
            "scale-k", "…, all ranks", 100.0, 100.0 + all_ranks, "us", "B", "src", twin="k", **kw
        ),
    ]


def test_a_replay_row_further_off_than_its_twin_is_worse() -> None:
    (pair,) = twin_comparisons(_pair(1.0, -3.0))
    assert (pair.key, pair.twin) == ("scale-k", "k")
    assert (pair.one_rank, pair.all_ranks) == (pytest.approx(1.0), pytest.approx(-3.0))
    assert not pair.no_worse


def test_a_tie_is_no_worse() -> None:
    (pair,) = twin_comparisons(_pair(2.0, -2.0))
    assert pair.no_worse


def test_inside_a_published_range_both_rows_miss_by_nothing() -> None:
    rows = [
        range_pp_row("g", "gain", 27.0, 35.0, 38.0, "A", "src"),
        range_pp_row("scale-g", "gain, all ranks", 27.0, 35.0, 30.0, "B", "src", twin="g"),
    ]
    (pair,) = twin_comparisons(rows)
    assert (pair.one_rank, pair.all_ranks, pair.no_worse) == (pytest.approx(3.0), 0.0, True)


def test_a_calibration_pair_is_left_out_of_the_comparison() -> None:
    assert twin_comparisons(_pair(1.0, 5.0, calibration=True)) == []


def test_a_twin_that_names_no_row_is_refused() -> None:
    rows = [pp_row("scale-d", "decode, all ranks", -27.0, -17.0, "B", "src", twin="missing")]
    with pytest.raises(ValueError, match="'missing'"):
        twin_comparisons(rows)


def test_the_table_names_the_figures_the_replay_is_further_off_on() -> None:
    table = format_table(FidelityReport(_pair(1.0, -3.0), {}, False))
    assert "on the 1 figures both score: no further off on 0; further off on:" in table
    assert "DeepEP LL combine, EP 8: -3.0 against +1.0 %" in table
