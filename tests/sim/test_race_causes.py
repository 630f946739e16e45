"""Race reports grouped by cause: one entry per op pair and missing edge, counting its byte
ranges, with the fix spelled as the user writes it."""

from __future__ import annotations

import sys

import pytest
import torch

import dbo
import dbo.switch_notes
from dbo.sim import SimDevice
from dbo.sim.options import SimOptions
from dbo.sim.records import OpSite, RaceReport
from dbo.verification.race_causes import group_races


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


def _forward_with_a_plain_switch(lines: list[int]):
    def forward(x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        dbo.dbo_yield()
        lines.append(sys._getframe().f_lineno + 1)
        dbo.dbo_switch_to_comm()  # the bug: the comm stream does not wait for h
        with dbo.current_device().comm_region("dispatch", nbytes=h.numel() * 4, ep_size=8):
            out = h + 1
        dbo.dbo_switch_to_compute_sync()
        return out

    return forward


@pytest.mark.timeout(30)
def test_a_missing_wait_names_the_plain_switch_as_its_origin():
    lines: list[int] = []
    report = dbo.verify(_forward_with_a_plain_switch(lines), torch.randn(8, 4))
    (cause,) = group_races(report.races)
    switch = f"dbo_switch_to_comm() at test_race_causes.py:{lines[0]}:forward"
    assert cause.origin == switch
    assert "make dbo_switch_to_comm() there dbo_switch_to_comm_sync()" in cause.fix
    detail = cause.describe().splitlines()[1]  # the first line after the op pair
    assert detail.strip().startswith(f"origin:  {switch}")


@pytest.mark.timeout(30)
def test_an_ordered_switch_clears_the_plain_switch_note(device):
    def fn(ordered: bool):
        dbo.dbo_switch_to_comm()
        if ordered:
            dbo.dbo_switch_to_compute_sync()
            dbo.dbo_switch_to_comm_sync()
        return dbo.switch_notes.last_plain_switch()

    plain, cleared = dbo.run_ubatches(fn, [False, True], device=device, timeout=20)
    assert plain.call == "dbo_switch_to_comm" and plain.stream == "comm"
    assert cleared is None


@pytest.mark.timeout(30)
def test_a_race_report_in_full_names_the_plain_switch_first():
    lines: list[int] = []
    report = dbo.verify(_forward_with_a_plain_switch(lines), torch.randn(8, 4))
    text = str(report.races[0]).splitlines()
    assert text[1].startswith(f"  Origin: dbo_switch_to_comm() at test_race_causes.py:{lines[0]}:")
    assert "origin: dbo_switch_to_comm()" in report.races[0].describe()
