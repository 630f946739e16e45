"""The placement arithmetic of `dbo.sim.timeline`: pure functions of when an op is ready and
what else holds the GPU."""

from __future__ import annotations

import pytest

from dbo.sim.timeline import (
    GpuLoad,
    Kernel,
    Turns,
    contention_us,
    hold_sms,
    place_span,
    slowdown_args,
    stretch,
    taken_from,
)

RATES = {"compute": 0.5, "full_grid": 0.25}


def _span(ready: float, cost: float, **kw):
    options = dict(compute=True, full_grid=False, turns=Turns(), busy=(), max_share=0.9, rates=None)
    options.update(kw)
    kernel = Kernel(cost, options["compute"], options["full_grid"], options.get("reserved_sms"))
    load = GpuLoad(options["turns"], options["busy"], options["max_share"], options["rates"])
    return place_span(ready, kernel, load)


def test_compute_beside_a_comm_kernel_holding_half_the_sms_runs_at_half_rate() -> None:
    # 4 us of overlap at rate 0.5 do 2 us of work; the other 8 run alone.
    assert stretch([(0.0, 4.0, 0.5)], 0.0, 10.0, max_share=0.9) == pytest.approx(12.0)


def test_the_comm_sm_share_is_capped_so_compute_never_starves() -> None:
    assert stretch([(0.0, 100.0, 1.0)], 0.0, 1.0, max_share=0.9) == pytest.approx(10.0)


def test_contention_is_the_lost_work_of_the_time_spent_side_by_side() -> None:
    # Side by side for min(10 / 0.25, 100 / 0.5) = 40 us, losing 1 - 0.5 - 0.25 of it.
    assert contention_us(RATES, False, 10.0, 100.0) == pytest.approx(10.0)
    assert contention_us(None, False, 10.0, 100.0) == 0.0


def test_compute_waits_for_a_full_grid_kernel_and_carries_the_contention() -> None:
    span = _span(0.0, 100.0, turns=Turns(grid_end=10.0), rates=RATES)
    assert (span.ready, span.start) == (0.0, 10.0)
    assert span.end == pytest.approx(120.0) and span.contention == pytest.approx(10.0)
    assert slowdown_args(span, compute=True) == {"overlap_slowdown_us": pytest.approx(10.0)}


def test_a_gemm_on_reserved_sms_is_scaled_and_never_stretched() -> None:
    span = _span(0.0, 10.0, busy=[(0.0, 100.0, 0.5)], reserved_sms=(132, 66))
    assert span.cost_us == pytest.approx(20.0) and span.end == pytest.approx(20.0)


def test_a_held_sm_share_drops_what_ended_before_the_host_clock() -> None:
    span = _span(5.0, 4.0)
    assert hold_sms([(0.0, 2.0, 0.3), (0.0, 8.0, 0.3)], span, 0.5, horizon=3.0) == [
        (0.0, 8.0, 0.3),
        (5.0, 9.0, 0.5),
    ]


def test_compute_placed_before_a_comm_kernel_loses_the_sms_it_holds_on_other_tracks() -> None:
    held = _span(2.0, 4.0)  # a comm kernel over [2, 6)
    placed = [(0.0, 10.0, 0), (5.0, 8.0, 1), (6.0, 9.0, 1), (0.0, 10.0, 2)]
    # track 0: 4 us beside a half-SM holder, worth 4 us more; track 1: 1 us; track 2 is its own
    assert taken_from(placed, held, 0.5, own=2) == pytest.approx({0: 4.0, 1: 1.0})


def test_a_comm_kernel_holding_no_sms_takes_nothing() -> None:
    assert taken_from([(0.0, 10.0, 0)], _span(2.0, 4.0), 0.0, own=1) == {}
