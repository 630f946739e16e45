"""SimDevice clocks: hand-computed schedules on a profile with round numbers."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

import dbo.streams
from dbo.sim import H200, HANDOFF, SYNC, SimDevice, profile_from_name
from dbo.sim.options import ProfileOverrides, SimOptions
from dbo.sim.state import PlannedOp

# launch 1 us, no fixed kernel time, handoff 10 us: every time below is exact arithmetic.
ROUND = replace(H200, name="round", launch_us=1.0, kernel_fixed_us=0.0, handoff_us=10.0)


def make() -> SimDevice:
    return SimDevice(SimOptions(ROUND))


def test_default_device_is_sim_h200() -> None:
    device = SimDevice()
    assert device.kind == "sim" and device.profile is H200
    assert device.torch_device == torch.device("cpu")
    assert isinstance(dbo.devices.resolve_device("sim"), SimDevice)


def test_two_streams_overlap_without_wait() -> None:
    d = make()
    s1, s2 = d.Stream("a"), d.Stream("b")
    a = d.place_op(PlannedOp("A", 10.0, track=s1.track))
    b = d.place_op(PlannedOp("B", 10.0, track=s2.track))
    assert (a.issue_us, a.start_us, a.end_us) == (0.0, 1.0, 11.0)
    assert (b.issue_us, b.start_us, b.end_us) == (1.0, 2.0, 12.0)
    assert d.host_time_us == 2.0


def test_wait_event_orders_streams() -> None:
    d = make()
    s1, s2 = d.Stream("a"), d.Stream("b")
    d.place_op(PlannedOp("A", 10.0, track=s1.track))
    e = s1.record_event()
    assert e.time_us == 11.0
    s2.wait_event(e)
    b = d.place_op(PlannedOp("B", 10.0, track=s2.track))
    assert (b.start_us, b.end_us) == (11.0, 21.0)
    # work recorded after the event is not waited for
    d.place_op(PlannedOp("A2", 100.0, track=s1.track))
    c = d.place_op(PlannedOp("C", 1.0, track=s2.track))
    assert c.start_us == 21.0


def test_same_stream_is_in_order() -> None:
    d = make()
    s = d.Stream("a")
    d.place_op(PlannedOp("A", 10.0, track=s.track))
    b = d.place_op(PlannedOp("B", 5.0, track=s.track))
    assert (b.start_us, b.end_us) == (11.0, 16.0)


def test_host_sync_advances_host_and_is_recorded() -> None:
    d = make()
    s = d.Stream("a")
    d.place_op(PlannedOp("A", 10.0, track=s.track))
    s.synchronize()
    assert d.host_time_us == 11.0 and s.query()
    sync = d.timeline[-1]
    assert (
        sync.kind == SYNC and sync.stream == "host" and (sync.start_us, sync.end_us) == (1.0, 11.0)
    )
    b = d.place_op(PlannedOp("B", 1.0, track=s.track))
    assert (b.issue_us, b.start_us) == (11.0, 12.0)
    # a second sync waits for nothing and records nothing
    n = len(d.timeline)
    d.place_op(PlannedOp("C", 5.0, track=s.track))
    d.synchronize()
    d.synchronize()
    assert sum(r.kind == SYNC for r in d.timeline[n:]) == 1


def test_event_synchronize_and_query() -> None:
    d = make()
    s = d.Stream("a")
    e = d.Event()
    assert e.query()  # never recorded: nothing to wait for
    e.synchronize()
    assert d.host_time_us == 0.0
    d.place_op(PlannedOp("A", 10.0, track=s.track))
    e.record(s)
    d.place_op(PlannedOp("B", 10.0, track=s.track))
    assert not e.query()
    e.synchronize()
    assert d.host_time_us == 11.0 and e.query() and not s.query()


def test_wait_on_unrecorded_event_is_noop() -> None:
    d = make()
    s = d.Stream("a")
    s.wait_event(d.Event())
    assert d.place_op(PlannedOp("A", 1.0, track=s.track)).start_us == 1.0


def test_handoff_costs_host_time() -> None:
    d = make()
    s = d.Stream("a")
    with d.thread_scope(1):
        d.on_handoff()
    h = d.timeline[-1]
    assert h.kind == HANDOFF and h.ubatch == 1 and (h.start_us, h.end_us) == (0.0, 10.0)
    assert d.place_op(PlannedOp("A", 1.0, track=s.track)).start_us == 11.0


@pytest.mark.timeout(30)
def test_current_stream_is_per_thread() -> None:
    d = make()
    s = d.Stream("mine")
    d.set_stream(s)
    seen: list = []
    t = threading.Thread(target=lambda: seen.append(d.current_stream()))
    t.start()
    t.join()
    assert d.current_stream() is s and seen == [d.default_stream()]
    with dbo.streams.stream_context(d.default_stream()):
        assert d.current_stream() is d.default_stream()
    assert d.current_stream() is s


def test_stream_names_unique_and_checked() -> None:
    d = make()
    assert d.Stream("x").name == "x" and d.Stream("x").name == "x#2"
    with pytest.raises(TypeError):
        d.set_stream(SimDevice(SimOptions(ROUND)).Stream("other"))
    with pytest.raises(TypeError):
        d.Stream("y").wait_event(SimDevice(SimOptions(ROUND)).Event())


def test_mark_since_elapsed_and_reset() -> None:
    d = make()
    s = d.Stream("a")
    d.place_op(PlannedOp("warm", 5.0, track=s.track))
    d.synchronize()
    m = d.mark()
    d.place_op(PlannedOp("A", 10.0, track=s.track))
    d.synchronize()
    assert [r.name for r in d.since(m)] == ["A", "host-sync"]
    assert d.elapsed_us(m) == 11.0
    e = s.record_event()
    d.reset()
    assert d.timeline == [] and d.host_time_us == 0.0 and not e.recorded
    assert d.place_op(PlannedOp("B", 1.0, track=s.track)).start_us == 1.0


def test_profiles_by_name() -> None:
    assert profile_from_name("H100-SXM").name == "h100"
    with pytest.raises(ValueError, match="b200, h100, h200, h800"):
        profile_from_name("a100")
    d = SimDevice(
        SimOptions("h800", overrides=ProfileOverrides(launch_us=7.0, handoff_us=3.0, comm_sms=20))
    )
    assert (d.profile.launch_us, d.profile.handoff_us, d.profile.comm_sms) == (7.0, 3.0, 20)
    with pytest.raises(ValueError, match="tensor_device"):
        SimDevice(SimOptions(tensor_device="cuda"))


@pytest.mark.timeout(30)
def test_many_threads_place_consistently() -> None:
    d = make()
    streams = [d.Stream(f"s{i}") for i in range(4)]
    n_threads, n_ops = 8, 200

    def work(i: int) -> None:
        s = streams[i % 4]
        with d.thread_scope(i):
            d.set_stream(s)
            for _ in range(n_ops):
                d.place_op(PlannedOp("op", 1.0))
                e = s.record_event()
                streams[(i + 1) % 4].wait_event(e)
                d.on_handoff()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seqs = [r.seq for r in d.timeline]
    assert seqs == list(range(len(seqs)))
    assert sum(r.name == "op" for r in d.timeline) == n_threads * n_ops
    assert d.host_time_us == n_threads * n_ops * (1.0 + 10.0)
    for s in streams:  # each stream's ops are in order and never overlap
        ops = [r for r in d.timeline if r.stream == s.name]
        assert all(a.end_us <= b.start_us for a, b in zip(ops, ops[1:]))


@pytest.mark.timeout(30)
def test_each_yield_and_exit_of_a_ubatched_step_costs_one_handoff_of_host_time() -> None:
    """Two ubatches, one op (5 us) before and after a dbo_yield, launch 1 us, handoff 10 us:
    the baton passes four times (two yields, two exits), each on the host clock."""
    d = make()

    def fn(u: int) -> None:
        d.place_op(PlannedOp(f"A{u}", 5.0))
        dbo.dbo_yield()
        d.place_op(PlannedOp(f"B{u}", 5.0))

    dbo.run_ubatches(fn, [0, 1], device=d)
    got = [(r.name, r.ubatch, r.stream, r.issue_us, r.start_us, r.end_us) for r in d.timeline]
    assert got == [
        ("A0", 0, "compute", 0.0, 1.0, 6.0),
        ("handoff", 0, "host", 1.0, 1.0, 11.0),
        ("A1", 1, "compute", 11.0, 12.0, 17.0),  # launched after ubatch 0's handoff
        ("handoff", 1, "host", 12.0, 12.0, 22.0),
        ("B0", 0, "compute", 22.0, 23.0, 28.0),
        ("handoff", 0, "host", 23.0, 23.0, 33.0),  # ubatch 0 exits: the baton moves on
        ("B1", 1, "compute", 33.0, 34.0, 39.0),
        ("handoff", 1, "host", 34.0, 34.0, 44.0),
    ]
    assert [r.kind for r in d.timeline if r.stream == "host"] == [HANDOFF] * 4


def test_records_carry_the_device_rank() -> None:
    d = SimDevice(SimOptions(ROUND, rank=3))
    x = torch.ones(4)
    with d.thread_scope(1):
        x + x
        d.synchronize()  # the host waits for the add: a sync record
        d.on_handoff()
    assert [(r.kind, r.rank, r.ubatch) for r in d.timeline] == [
        ("compute", 3, 1),
        (SYNC, 3, 1),
        (HANDOFF, 3, 1),
    ]


def test_event_query_true_orders_later_host_work_after_the_event() -> None:
    d = SimDevice(SimOptions(ROUND))
    a, b = d.Stream("a"), d.Stream("b")
    x = torch.zeros(8)
    with d.thread_scope(0):
        d.set_stream(a)
        x.fill_(1)
        e = a.record_event()
        while not e.query():
            pass
        d.set_stream(b)
        x.sum()  # the host saw the write done: ordered, as after e.synchronize()
    assert d.races == []


def test_polling_query_advances_the_host_clock_until_done() -> None:
    d = make()
    s = d.Stream("a")
    d.place_op(PlannedOp("A", 10.0, track=s.track))  # done at 11 us
    e = s.record_event()
    polls = 0
    while not e.query():
        polls += 1
    assert polls == 10 and d.host_time_us == 11.0  # one launch's host time per poll
    d.place_op(PlannedOp("B", 10.0, track=s.track))
    while not s.query():
        pass
    assert d.host_time_us >= d.streams[-1].free_at_us


def test_baton_passes_are_in_the_timeline_at_their_issue_positions() -> None:
    d = make()
    x = torch.ones(4)
    with d.thread_scope(0):
        x = x + 1
        d.on_handoff()
        x = x * 2
        d.on_handoff()
    records = d.timeline
    assert [r.kind for r in records] == ["compute", HANDOFF, "compute", HANDOFF]
    assert [r.seq for r in records] == sorted(r.seq for r in records)
    handoff = records[1]
    assert (handoff.ubatch, handoff.stream, handoff.dur_us) == (0, "host", 10.0)
    assert records[0].issue_us < handoff.start_us < records[2].issue_us


def test_the_timeline_is_one_list_that_later_passes_join() -> None:
    d = make()
    held = d.timeline
    d.on_handoff()
    d.synchronize()
    assert d.timeline is held and [r.kind for r in held] == [HANDOFF]
    d.reset()
    assert d.timeline == []


def test_a_device_without_a_timeline_keeps_no_host_records() -> None:
    d = SimDevice(SimOptions(ROUND, record_timeline=False))
    d.on_handoff()
    assert d.timeline == [] and d.host_time_us == 10.0
