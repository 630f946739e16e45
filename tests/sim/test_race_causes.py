"""Race reports grouped by cause: one entry per op pair and missing edge, counting its byte
ranges, with the fix spelled as the user writes it."""

from __future__ import annotations

import pytest
import torch

import dbo
from dbo.race_causes import group_races
from dbo.sim import SimDevice
from dbo.sim.options import SimOptions
from dbo.sim.records import OpSite, RaceReport


def site(op: str, stream: str, ubatch: int | None, start: int, end: int, write: bool) -> OpSite:
    return OpSite(op, ubatch, stream, start, end, write, (f"model.py:{len(op)}:forward",))


def race(ubatch: int, start: int, end: int, freed: tuple[str, ...] | None = None) -> RaceReport:
    return RaceReport(
        storage=0x1000 + start,
        first=site("aten::mm", "compute", ubatch, start, end, True),
        second=site("comm::dispatch", "comm", ubatch, start, end, False),
        freed_allocation=freed,
    )


def test_one_missing_wait_over_many_ranges_and_ubatches_is_one_cause():
    (cause,) = group_races([race(0, 0, 64), race(0, 64, 128), race(1, 0, 32)])
    assert cause.ranges == 3 and cause.nbytes == 160
    assert cause.ubatches == [0, 1]
    assert cause.missing == "stream 'comm' does not wait for stream 'compute'"
    assert "make stream 'comm' wait on it before comm::dispatch" in cause.fix


def test_different_op_pairs_are_different_causes():
    other = RaceReport(
        storage=1,
        first=site("aten::add", "compute", 0, 0, 8, True),
        second=site("comm::combine", "comm", 0, 0, 8, False),
    )
    assert len(group_races([race(0, 0, 8), other, race(1, 0, 8)])) == 2


def test_memory_reused_after_free_is_fixed_by_record_stream():
    (cause,) = group_races([race(0, 0, 8, freed=("model.py:3:forward",))])
    assert cause.reused_after_free
    assert "dbo.record_stream(tensor, stream) with stream 'compute'" in cause.fix
    assert "allocated at model.py:3:forward" in cause.fix


def test_a_buffer_two_ubatches_share_suggests_a_slot_each():
    shared = RaceReport(
        storage=1,
        first=site("comm::dispatch", "comm", 1, 0, 8, True),
        second=site("aten::mm", "compute", 0, 0, 8, False),
    )
    (cause,) = group_races([shared])
    assert "give each ubatch its own buffer" in cause.fix


@pytest.mark.timeout(30)
def test_a_free_without_record_stream_on_the_simulator_is_grouped_with_the_same_fix():
    device = SimDevice(SimOptions("h200", tensor_device="cpu"))
    x = torch.randn(1 << 16)
    with device.thread_scope(0):
        compute, comm = device.Stream("compute"), device.Stream("comm")
        device.set_stream(compute)
        y = x * 2
        comm.wait_event(compute.record_event())
        device.set_stream(comm)
        y.sum()
        device.set_stream(compute)
        del y
        z = x + 1
        del z
    (cause,) = group_races(device.races)
    assert cause.reused_after_free and "dbo.record_stream(tensor, stream)" in cause.fix
    assert "dbo.record_stream(tensor, stream)" in str(device.races[0])
    assert dbo.record_stream  # the call the fix names exists under that name
