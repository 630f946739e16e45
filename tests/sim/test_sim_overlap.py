"""Kernels on two streams that the simulated GPU runs in turn, and what a profile's measured
overlap rates charge for running them side by side instead."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dbo.sim import H100, H200, SimDevice
from dbo.sim.options import SimOptions
from dbo.sim.records import COMM, COMPUTE
from dbo.sim.state import PlannedOp

# Compute progresses at half its solo rate beside a full-grid kernel, which crawls at a quarter.
RATES = {"compute": 0.5, "full_grid": 0.25}


def _device(rates: dict[str, float]) -> SimDevice:
    return SimDevice(SimOptions(replace(H200, overlap_rates=rates), check_races=False))


def _compute(device: SimDevice, stream, us: float, **kw):
    return device.place_op(PlannedOp("gemm", us, COMPUTE, stream.track, launch=False, **kw))


def _full_grid(device: SimDevice, stream, us: float, **kw):
    op = PlannedOp("comm::combine", us, COMM, stream.track, launch=False, full_grid=True, **kw)
    return device.place_op(op)


def test_two_kernels_ready_together_on_two_streams_end_as_if_run_side_by_side() -> None:
    device = _device(RATES)
    a, b = device.Stream("compute"), device.Stream("comm")
    gemm = _compute(device, a, 100.0)
    combine = _full_grid(device, b, 50.0)
    # Side by side from t=0: the GEMM's 100 us at rate 0.5 and the combine's 50 us at rate
    # 0.25 both finish at t=200, where turns would end at 150.
    assert gemm.end_us == pytest.approx(100.0)
    assert combine.start_us == pytest.approx(100.0)
    assert combine.end_us == pytest.approx(200.0)
    assert combine.args["overlap_slowdown_us"] == pytest.approx(50.0)


def test_the_kernel_that_finishes_first_beside_the_other_bounds_the_shared_time() -> None:
    device = _device(RATES)
    a, b = device.Stream("compute"), device.Stream("comm")
    _full_grid(device, b, 10.0)
    gemm = _compute(device, a, 100.0)
    # Beside each other the combine's 10 us takes 40 us, in which the GEMM does 20 us of its
    # work; the pair loses (1 - 0.75) * 40 = 10 us against turns (10 + 100).
    assert gemm.end_us == pytest.approx(120.0)


def test_kernels_on_one_stream_are_not_slowed() -> None:
    device = _device(RATES)
    stream = device.Stream("compute")
    _compute(device, stream, 100.0)
    combine = _full_grid(device, stream, 50.0)
    assert combine.end_us == pytest.approx(150.0)
    assert "overlap_slowdown_us" not in combine.args


def test_kernels_that_do_not_overlap_are_not_slowed() -> None:
    device = _device(RATES)
    a, b = device.Stream("compute"), device.Stream("comm")
    _compute(device, a, 100.0)
    combine = _full_grid(device, b, 50.0, not_before=150.0)
    assert (combine.start_us, combine.end_us) == pytest.approx((150.0, 200.0))


def test_two_compute_kernels_are_not_charged() -> None:
    device = _device(RATES)
    a, b = device.Stream("a"), device.Stream("b")
    _compute(device, a, 100.0)
    other = _compute(device, b, 50.0)
    assert other.end_us == pytest.approx(50.0)


def test_a_profile_without_overlap_rates_keeps_free_turns() -> None:
    for device in (_device({}), SimDevice(SimOptions(H100, check_races=False))):
        a, b = device.Stream("compute"), device.Stream("comm")
        _compute(device, a, 100.0)
        combine = _full_grid(device, b, 50.0)
        assert combine.end_us == pytest.approx(150.0)


def test_rates_that_sum_to_one_cost_nothing_beyond_turns() -> None:
    device = _device({"compute": 0.7, "full_grid": 0.3})
    a, b = device.Stream("compute"), device.Stream("comm")
    _compute(device, a, 100.0)
    assert _full_grid(device, b, 50.0).end_us == pytest.approx(150.0)


def test_the_h200_profile_takes_its_overlap_rates_from_its_table_and_others_have_none() -> None:
    assert set(H200.overlap_rates) == {"compute", "full_grid"}
    assert all(0 < v <= 1 for v in H200.overlap_rates.values())
    assert H100.overlap_rates == {}


@pytest.mark.parametrize(
    "rates",
    [{"compute": 0.5}, {"compute": 0.5, "full_grid": 0.0}, {"compute": 1.5, "full_grid": 0.5}],
)
def test_overlap_rates_need_both_kinds_each_in_0_to_1(rates) -> None:
    with pytest.raises(ValueError, match="overlap_rates"):
        replace(H200, overlap_rates=rates)
