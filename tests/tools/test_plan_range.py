"""`plan`'s token range grows to find the crossover: halving below the first count, doubling
above the last, until the crossover is inside or a bound stops it, and says so."""

from __future__ import annotations

from scenarios.tools.plan_args import MAX_TOKENS
from scenarios.tools.plan_range import MAX_EXTENSIONS, RangeState, next_tokens, range_note

GIVEN = (2048, 4096, 8192, 16384)


def test_a_crossover_at_the_first_count_halves_the_range_down():
    assert next_tokens(RangeState(GIVEN, GIVEN, 2048, True)) == 1024


def test_a_crossover_inside_the_range_adds_nothing_and_says_nothing():
    state = RangeState(GIVEN, GIVEN, 4096, True)
    assert next_tokens(state) is None and range_note(state) == ""


def test_a_crossover_found_below_the_range_says_how_far_it_grew():
    state = RangeState(GIVEN, (256, 512, 1024, *GIVEN), 512, True)
    assert next_tokens(state) is None
    assert range_note(state) == "range extended down from 2048 to 256 tokens"


def test_never_paying_doubles_the_range_up():
    assert next_tokens(RangeState(GIVEN, GIVEN, None, True)) == 32768


def test_paying_only_at_the_last_count_doubles_the_range_up():
    assert next_tokens(RangeState(GIVEN, GIVEN, 16384, True)) == 32768


def test_the_search_down_stops_after_its_halvings_and_says_the_bound():
    lo = 2048 >> MAX_EXTENSIONS
    state = RangeState(GIVEN, (lo, *GIVEN), lo, True)
    assert next_tokens(state) is None
    assert f"bound reached ({MAX_EXTENSIONS} halvings)" in range_note(state)


def test_the_search_down_stops_at_one_token():
    state = RangeState((1, 2), (1, 2), 1, True)
    assert next_tokens(state) is None
    assert "may lie below it" in range_note(state)


def test_the_search_up_stops_at_a_count_that_does_not_fit_in_memory():
    state = RangeState(GIVEN, (*GIVEN, 32768), None, False)
    assert next_tokens(state) is None
    assert "32768 tokens does not fit in memory" in range_note(state)


def test_the_search_up_never_passes_the_largest_count():
    state = RangeState((MAX_TOKENS,), (MAX_TOKENS,), None, True)
    assert next_tokens(state) is None
    assert f"bound reached ({MAX_TOKENS} tokens)" in range_note(state)
