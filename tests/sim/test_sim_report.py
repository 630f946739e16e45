"""Tests for dbo.sim reports (summary, Chrome trace, PNG timeline): from hand-made records, and
one trace of a ubatched step run on the simulated device."""

from __future__ import annotations

import json
import math

import pytest
import torch

import dbo
from dbo.sim import SimDevice
from dbo.sim.options import SimOptions
from dbo.sim.records import COMM, COMPUTE, HANDOFF, SYNC, OpRecord, OpSite, RaceReport
from dbo.sim.report import (
    StepSummary,
    chrome_trace,
    clip_intervals,
    format_summary,
    intersect_intervals,
    merge_traces,
    plot_timeline,
    summarize,
    total_length,
    union_intervals,
    write_chrome_trace,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

_seq = iter(range(10**9))


def op(
    kind: str,
    start: float,
    end: float,
    *,
    stream: str | None = None,
    ubatch: int | None = 0,
    rank: int = 0,
    name: str | None = None,
    issue: float | None = None,
    **kw,
) -> OpRecord:
    default_stream = {COMPUTE: "compute", COMM: "comm"}.get(kind, "host")
    return OpRecord(
        seq=next(_seq),
        name=name or f"op-{kind}",
        kind=kind,
        rank=rank,
        ubatch=ubatch,
        stream=stream or default_stream,
        issue_us=start if issue is None else issue,
        start_us=start,
        end_us=end,
        **kw,
    )


def two_stream_schedule() -> list[OpRecord]:
    """compute [0, 6) as two ops, comm [4, 8): comm is 4 us, 2 of them under compute."""
    return [
        op(COMPUTE, 0, 3, ubatch=0),
        op(COMPUTE, 3, 6, ubatch=0),
        op(COMM, 4, 8, ubatch=1),
    ]


def race(op_name: str = "op-comm", ubatch: int = 1, stream: str = "comm") -> RaceReport:
    first = OpSite("aten::mm", 0, "compute", 0, 256, True, ("model.py:10:forward",))
    second = OpSite(op_name, ubatch, stream, 128, 512, False, ("moe.py:20:dispatch",))
    return RaceReport(storage=0xBEEF, first=first, second=second)


# --- interval arithmetic -----------------------------------------------------------------------


def test_union_merges_overlapping_intervals():
    assert union_intervals([(0, 2), (1, 3), (5, 6)]) == [(0, 3), (5, 6)]


def test_union_absorbs_nested_interval():
    assert union_intervals([(0, 10), (2, 3)]) == [(0, 10)]


def test_union_joins_touching_intervals():
    assert union_intervals([(1, 2), (0, 1)]) == [(0, 2)]


def test_union_of_nothing_and_of_empty_intervals_is_empty():
    assert union_intervals([]) == []
    assert union_intervals([(3, 3), (5, 4)]) == []


def test_intersection_of_partly_overlapping_unions():
    a = union_intervals([(0, 4), (6, 10)])
    b = union_intervals([(2, 7), (9, 12)])
    assert intersect_intervals(a, b) == [(2, 4), (6, 7), (9, 10)]


def test_intersection_drops_touching_contacts_and_handles_empty():
    assert intersect_intervals([(0, 1)], [(1, 2)]) == []
    assert intersect_intervals([], [(0, 1)]) == []


def test_intersection_with_nested_interval_is_the_inner_one():
    assert intersect_intervals([(0, 10)], [(2, 3), (4, 5)]) == [(2, 3), (4, 5)]


def test_clip_cuts_to_window_and_drops_outside():
    assert clip_intervals([(-2, 1), (3, 4), (5, 9)], 0, 6) == [(0, 1), (3, 4), (5, 6)]


def test_total_length_of_union_counts_overlap_once():
    assert total_length(union_intervals([(0, 2), (1, 3), (10, 11)])) == 4.0


# --- summary -------------------------------------------------------------------------------------


def test_overlap_fraction_is_exactly_half_on_two_stream_schedule():
    s = summarize(two_stream_schedule())
    assert s.comm_us == 4.0
    assert s.compute_us == 6.0
    assert s.overlap_fraction == 0.5


def test_exposed_comm_is_comm_not_under_compute():
    s = summarize(two_stream_schedule())
    assert s.hidden_comm_us == 2.0
    assert s.exposed_comm_us == 2.0


def test_overlap_fraction_is_zero_without_comm():
    s = summarize([op(COMPUTE, 0, 5)])
    assert s.comm_us == 0.0
    assert s.overlap_fraction == 0.0


def test_step_time_runs_from_earliest_issue_to_latest_end():
    s = summarize([op(COMPUTE, 2, 5, issue=1), op(COMM, 4, 9)])
    assert s.step_us == 8.0


def test_busy_per_stream_is_union_of_that_streams_ops():
    recs = two_stream_schedule() + [op(HANDOFF, 8, 9)]
    s = summarize(recs)
    assert dict(s.busy_us_per_stream) == {"compute": 6.0, "comm": 4.0, "host": 1.0}


def test_host_bound_fraction_is_share_of_step_with_no_device_work():
    # Device busy [1, 3) and [7, 10) within a 10 us step from issue 0: [0, 1) and [3, 7) idle,
    # 5 of 10 us. The host sync at [3, 7) is host time and must not count as device work.
    recs = [
        op(COMPUTE, 1, 3, issue=0),
        op(SYNC, 3, 7),
        op(COMM, 7, 9),
        op(COMPUTE, 9, 10),
    ]
    s = summarize(recs)
    assert s.step_us == 10.0
    assert s.host_bound_fraction == 0.5


def test_fully_busy_device_is_not_host_bound():
    s = summarize([op(COMPUTE, 0, 5), op(COMM, 5, 8)])
    assert s.host_bound_fraction == 0.0


def test_step_time_is_the_slowest_ranks():
    recs = [
        op(COMPUTE, 0, 10, rank=0),
        op(COMPUTE, 0, 25, rank=1),
        op(COMM, 0, 4, rank=1),
        op(COMPUTE, 0, 7, rank=2),
    ]
    s = summarize(recs)
    assert s.step_us == 25.0
    assert s.slowest_rank == 1
    assert [r.rank for r in s.ranks] == [0, 1, 2]
    assert [r.step_us for r in s.ranks] == [10.0, 25.0, 7.0]
    # Time fields follow the slowest rank; counts cover every rank.
    assert s.comm_us == 4.0
    assert s.num_ops == 4


def test_window_clips_ops_and_fixes_step():
    s = summarize(two_stream_schedule(), window=(2, 6))
    assert s.step_us == 4.0
    assert s.compute_us == 4.0
    assert s.comm_us == 2.0
    assert s.overlap_fraction == 1.0


def test_summary_counts_races_and_keeps_workspace_peak():
    s = summarize(two_stream_schedule(), races=[race(), race()], workspace_peak_bytes=3 << 20)
    assert s.num_races == 2
    assert s.workspace_peak_bytes == 3 << 20
    assert s.num_ops == 3


def test_summary_of_no_records_is_all_zero():
    s = summarize([])
    assert (s.step_us, s.comm_us, s.overlap_fraction, s.host_bound_fraction, s.num_ops) == (
        0.0,
        0.0,
        0.0,
        0.0,
        0,
    )


def test_summary_to_dict_is_json_round_trippable():
    s = summarize(two_stream_schedule() + [op(COMPUTE, 0, 1, rank=1)], races=[race()])
    d = json.loads(json.dumps(s.to_dict(), allow_nan=False))
    assert d["overlap_fraction"] == 0.5
    assert d["busy_us_per_stream"]["comm"] == 4.0
    assert [r["rank"] for r in d["ranks"]] == [0, 1]


def test_summary_is_frozen():
    s = summarize(two_stream_schedule())
    assert isinstance(s, StepSummary)
    with pytest.raises(AttributeError):
        s.step_us = 0.0  # type: ignore[misc]


def test_non_finite_record_time_is_rejected():
    with pytest.raises(ValueError, match="end_us"):
        summarize([op(COMPUTE, 0, math.inf)])


def test_format_summary_names_the_key_figures():
    text = format_summary(summarize(two_stream_schedule(), races=[race()]))
    assert "step time" in text and "8.0 us" in text
    assert "overlap  50.0%" in text
    assert "exposed comm" in text and "2.0 us" in text
    assert "host-bound" in text
    assert "races" in text and "1" in text


# --- Chrome trace --------------------------------------------------------------------------------


def _events(trace: dict, ph: str) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == ph]


def _thread_names(trace: dict, pid: int) -> list[str]:
    meta = [e for e in _events(trace, "M") if e["name"] == "thread_name" and e["pid"] == pid]
    return [e["args"]["name"] for e in sorted(meta, key=lambda e: e["tid"])]


def test_trace_file_parses_as_json(tmp_path):
    path = tmp_path / "t" / "trace.json"
    assert write_chrome_trace(path, two_stream_schedule(), metadata={"n": 1}) == path
    trace = json.loads(path.read_text())
    assert trace["displayTimeUnit"] == "ns"
    assert trace["otherData"]["n"] == 1
    assert len(_events(trace, "X")) == 3


def test_trace_has_one_process_per_rank():
    recs = [op(COMPUTE, 0, 1, rank=0), op(COMPUTE, 0, 1, rank=1), op(COMM, 1, 2, rank=1)]
    trace = chrome_trace(recs)
    procs = [e for e in _events(trace, "M") if e["name"] == "process_name"]
    assert sorted(e["args"]["name"] for e in procs) == ["rank 0", "rank 1"]
    assert len({e["pid"] for e in procs}) == 2
    assert {e["pid"] for e in _events(trace, "X")} == {e["pid"] for e in procs}


def test_trace_thread_names_put_host_first_then_streams_in_first_seen_order():
    recs = [
        op(COMM, 0, 1, stream="comm"),
        op(COMPUTE, 0, 2),
        op(HANDOFF, 2, 3),
        op(COMM, 3, 4, stream="link:nvlink"),
    ]
    trace = chrome_trace(recs)
    pid = _events(trace, "X")[0]["pid"]
    assert _thread_names(trace, pid) == ["host", "comm", "compute", "link:nvlink"]


def test_trace_puts_sync_and_handoff_on_the_host_track():
    recs = [op(COMPUTE, 0, 1), op(SYNC, 1, 2, stream="compute"), op(HANDOFF, 2, 3)]
    trace = chrome_trace(recs)
    pid = _events(trace, "X")[0]["pid"]
    names = dict(
        (e["tid"], e["args"]["name"])
        for e in _events(trace, "M")
        if e["name"] == "thread_name" and e["pid"] == pid
    )
    host_kinds = {e["cat"] for e in _events(trace, "X") if names[e["tid"]] == "host"}
    assert host_kinds == {SYNC, HANDOFF}


def test_trace_events_carry_ubatch_and_record_args():
    recs = [op(COMPUTE, 1, 4, ubatch=1, flops=2e9, bytes=4e6, args={"shape": (8, 16)})]
    (e,) = _events(chrome_trace(recs), "X")
    assert e["name"] == "op-compute" and e["cat"] == COMPUTE
    assert e["args"]["ubatch"] == 1
    assert e["args"]["flops"] == 2e9 and e["args"]["bytes"] == 4e6
    assert e["args"]["issue_us"] == 1.0 and e["args"]["replayed"] is False
    assert e["args"]["shape"] == [8, 16]


def test_trace_durations_equal_record_durations():
    recs = two_stream_schedule() + [op(COMM, 8.25, 9.5)]
    xs = sorted(_events(chrome_trace(recs), "X"), key=lambda e: e["args"]["seq"])
    assert [(e["ts"], e["dur"]) for e in xs] == [(r.start_us, r.dur_us) for r in recs]


def test_trace_spills_overlapping_ops_of_one_stream_onto_extra_track():
    recs = [op(COMM, 0, 4, stream="link"), op(COMM, 2, 5, stream="link")]
    trace = chrome_trace(recs)
    pid = _events(trace, "X")[0]["pid"]
    assert _thread_names(trace, pid) == ["link", "link #2"]
    assert len({e["tid"] for e in _events(trace, "X")}) == 2


def test_race_appears_as_global_instant_event_at_its_op():
    recs = two_stream_schedule()
    trace = chrome_trace(recs, races=[race(op_name="op-comm", ubatch=1, stream="comm")])
    (inst,) = _events(trace, "i")
    assert inst["s"] == "g"
    assert inst["ts"] == 4.0
    assert "race on storage 0xbeef" in inst["args"]["description"]


def test_unplaceable_race_goes_to_end_of_trace():
    trace = chrome_trace(two_stream_schedule(), races=[race(op_name="nowhere")])
    (inst,) = _events(trace, "i")
    assert inst["ts"] == 8.0


def test_trace_keeps_non_finite_and_odd_args_as_valid_json():
    recs = [op(COMPUTE, 0, 1, args={"x": float("nan"), "dtype": object(), "seq": 7})]
    text = json.dumps(chrome_trace(recs), allow_nan=False)
    (e,) = _events(json.loads(text), "X")
    assert e["args"]["x"] == "nan"
    assert e["args"]["record.seq"] == 7  # a clashing record arg is kept, not overwritten


def test_merge_traces_keys_processes_by_record_rank():
    r0 = [op(COMPUTE, 0, 1, rank=0)]
    r1 = [op(COMPUTE, 0, 2, rank=1)]
    trace = merge_traces([r0, r1])
    procs = sorted(e["args"]["name"] for e in _events(trace, "M") if e["name"] == "process_name")
    assert procs == ["rank 0", "rank 1"]


def test_merge_traces_rejects_the_same_rank_in_two_lists():
    with pytest.raises(ValueError, match="rank 0"):
        merge_traces([[op(COMPUTE, 0, 1)], [op(COMPUTE, 0, 1)]])


@pytest.mark.timeout(30)
def test_trace_of_a_simulated_ubatched_step_has_a_track_per_stream_and_ubatch_ids(tmp_path):
    d = SimDevice(SimOptions("h200", rank=2))
    xs = [torch.randn(16), torch.randn(16)]

    def fn(u: int) -> None:
        y = xs[u] * 2
        dbo.dbo_yield_and_switch_from_compute_to_comm()
        with dbo.current_device().comm_region("dispatch", nbytes=64, ep_size=8):
            y.clone()
        dbo.dbo_yield_and_switch_from_comm_to_compute()

    dbo.run_ubatches(fn, [0, 1], device=d)
    path = write_chrome_trace(tmp_path / "step.json", d.timeline, races=d.races)
    trace = json.loads(path.read_text())
    (proc,) = [e for e in _events(trace, "M") if e["name"] == "process_name"]
    assert proc["args"]["name"] == "rank 2"
    assert _thread_names(trace, proc["pid"]) == ["host", "compute", "comm"]
    names = {e["tid"]: e["args"]["name"] for e in _events(trace, "M") if e["name"] == "thread_name"}
    seen = {(names[e["tid"]], e["name"], e["args"]["ubatch"]) for e in _events(trace, "X")}
    for u in (0, 1):
        assert ("compute", "aten::mul", u) in seen
        assert ("comm", "comm::dispatch", u) in seen
        assert ("host", "handoff", u) in seen
    assert all(e["args"]["rank"] == 2 for e in _events(trace, "X"))


# --- PNG timeline --------------------------------------------------------------------------------


def test_plot_writes_a_png(tmp_path):
    recs = two_stream_schedule() + [op(HANDOFF, 6, 7), op(COMPUTE, 0, 5, rank=1, ubatch=None)]
    path = plot_timeline(tmp_path / "timeline.png", recs, title="two streams")
    data = path.read_bytes()
    assert len(data) > 1000
    assert data.startswith(PNG_SIGNATURE)


def test_plot_of_no_records_still_writes_a_png(tmp_path):
    path = plot_timeline(tmp_path / "empty.png", [])
    assert path.read_bytes().startswith(PNG_SIGNATURE)


def test_plot_of_20000_records_completes(tmp_path):
    recs: list[OpRecord] = []
    t = 0.0
    for i in range(5000):
        ub = i % 2
        recs.append(op(COMPUTE, t, t + 3.0, ubatch=ub))
        recs.append(op(COMM, t + 0.5, t + 2.5, ubatch=1 - ub))
        recs.append(op(HANDOFF, t + 3.0, t + 3.2, ubatch=ub))
        recs.append(op(COMPUTE, t, t + 3.1, ubatch=ub, rank=1))
        t += 3.2
    assert len(recs) == 20000
    path = plot_timeline(tmp_path / "big.png", recs)
    assert path.read_bytes().startswith(PNG_SIGNATURE)
