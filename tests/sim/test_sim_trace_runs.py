"""What the trace and the PNG add for reading an answer: runs stacked on one time axis, flow
arrows from an event's record to its waits, named host ranges, races on both ops, a window."""

from __future__ import annotations

import pytest
import torch

import dbo
from dbo.sim import SimDevice
from dbo.sim.plot import legend_handles, plot_lanes, plot_runs
from dbo.sim.records import OpSite, RaceReport
from dbo.sim.trace import TraceRun, Window, chrome_trace, chrome_trace_runs


def events(trace: dict, ph: str) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == ph]


def thread_names(trace: dict) -> dict[tuple[int, int], str]:
    return {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events(trace, "M")
        if e["name"] == "thread_name"
    }


def two_stream_run(device: SimDevice) -> None:
    """compute: a = x @ x; event recorded; comm waits on it, then b = a * 2 on comm."""
    compute, comm = device.Stream("compute"), device.Stream("comm")
    x = torch.ones(8, 8)
    with dbo.use_device(device), device.thread_scope(None):
        device.set_stream(compute)
        a = x @ x
        done = device.Event()
        done.record(compute)
        comm.wait_event(done)
        device.set_stream(comm)
        a * 2


def test_a_stream_wait_is_a_flow_arrow_from_the_recorded_op_to_the_next_op():
    device = SimDevice()
    two_stream_run(device)
    trace = chrome_trace(device.timeline, waits=device.event_waits)
    (start,), (finish,) = events(trace, "s"), events(trace, "f")
    assert start["id"] == finish["id"] and finish["bp"] == "e"
    names = thread_names(trace)
    assert names[(start["pid"], start["tid"])] == "compute"
    assert names[(finish["pid"], finish["tid"])] == "comm"
    mm = next(e for e in events(trace, "X") if e["name"] == "aten::mm")
    mul = next(e for e in events(trace, "X") if e["name"] == "aten::mul")
    assert (start["ts"], finish["ts"]) == (mm["ts"], mul["ts"])


def test_a_low_latency_arrival_flows_from_the_link_track():
    device = SimDevice()
    compute = device.Stream("compute")
    x = torch.ones(8, 8)
    with dbo.use_device(device), device.thread_scope(0):
        device.set_stream(compute)
        with device.comm_region("dispatch", nbytes=1 << 20, mode="ll", ep_size=8) as handle:
            y = x * 1
        compute.wait_event(handle.event)
        y + 1
    trace = chrome_trace(device.timeline, waits=device.event_waits)
    (start,) = events(trace, "s")
    assert thread_names(trace)[(start["pid"], start["tid"])] == "link"


def test_record_function_and_nvtx_ranges_land_on_the_host_track():
    device = SimDevice()
    with (
        dbo.use_device(device),
        device.thread_scope(None),
        torch.profiler.record_function("attention"),
    ):
        torch.ones(4, 4) @ torch.ones(4, 4)
        with torch.cuda.nvtx.range("inner"):
            torch.ones(4) + 1
    trace = chrome_trace(device.timeline, ranges=device.host_ranges)
    ranges = {e["name"]: e for e in events(trace, "X") if e["cat"].startswith("range.")}
    assert ranges["attention"]["cat"] == "range.record_function"
    assert ranges["inner"]["cat"] == "range.nvtx"
    names = thread_names(trace)
    for e in ranges.values():
        assert names[(e["pid"], e["tid"])].startswith("host")
    outer, inner = ranges["attention"], ranges["inner"]
    assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA build has real NVTX")
def test_nvtx_outside_a_simulated_scope_still_calls_the_real_function():
    with pytest.raises(RuntimeError, match="NVTX"):
        torch.cuda.nvtx.range_push("outside")


def test_reset_forgets_waits_and_ranges():
    device = SimDevice()
    two_stream_run(device)
    device.reset()
    assert device.event_waits == [] and device.host_ranges == []


def test_runs_stack_one_above_the_other_on_one_time_axis():
    serial, ubatched = SimDevice(), SimDevice()
    two_stream_run(serial)
    two_stream_run(ubatched)
    trace = chrome_trace_runs(
        [TraceRun("serial", serial.timeline), TraceRun("DBO", ubatched.timeline)]
    )
    procs = {e["args"]["name"]: e["pid"] for e in events(trace, "M") if e["name"] == "process_name"}
    assert procs["serial · rank 0"] < procs["DBO · rank 0"]
    starts = {
        e["pid"]: min(x["ts"] for x in events(trace, "X") if x["pid"] == e["pid"])
        for e in events(trace, "M")
        if e["name"] == "process_name"
    }
    assert len(set(starts.values())) == 1  # both begin at their reset, at the same time


def racy_records() -> tuple[list, RaceReport]:
    device = SimDevice()
    two_stream_run(device)
    mm = next(r for r in device.timeline if r.name == "aten::mm")
    mul = next(r for r in device.timeline if r.name == "aten::mul")
    race = RaceReport(
        0xBEEF,
        OpSite(mm.name, mm.ubatch, mm.stream, 0, 8, True, ("a.py:1:f",)),
        OpSite(mul.name, mul.ubatch, mul.stream, 0, 8, False, ("a.py:2:f",)),
    )
    return device.timeline, race


def test_a_race_is_carried_in_the_args_of_both_its_ops():
    records, race = racy_records()
    trace = chrome_trace(records, races=[race])
    marked = {e["name"] for e in events(trace, "X") if "races" in e["args"]}
    assert marked == {"aten::mm", "aten::mul"}
    assert all(
        e["args"]["races"] == [race.describe()] for e in events(trace, "X") if "races" in e["args"]
    )


def test_a_window_keeps_only_what_overlaps_it():
    records, _ = racy_records()
    mm = next(r for r in records if r.name == "aten::mm")
    trace = chrome_trace(records, window=Window(mm.start_us, mm.end_us))
    kept = {e["name"] for e in events(trace, "X")}
    assert "aten::mm" in kept and "aten::mul" not in kept
    assert trace["otherData"]["window_us"] == [mm.start_us, mm.end_us]


def test_a_window_must_end_after_it_starts():
    with pytest.raises(ValueError, match="after its start"):
        Window(5.0, 5.0)


def test_the_png_stacks_runs_marks_races_and_explains_the_link_track(tmp_path):
    records, race = racy_records()
    device = SimDevice()
    with (
        dbo.use_device(device),
        device.thread_scope(0),
        device.comm_region("dispatch", nbytes=1 << 20, mode="ll", ep_size=8),
    ):
        torch.ones(4) * 1
    runs = [TraceRun("serial", records), TraceRun("DBO", device.timeline, [race])]
    path = plot_runs(tmp_path / "runs.png", runs, title="two runs")
    assert path.read_bytes()[:4] == b"\x89PNG"
    lanes = plot_lanes(runs)
    assert (lanes[0][1], lanes[-1][1]) == ("serial", "DBO")
    labels = [h.get_label() for h in legend_handles(runs, lanes)]
    assert any(label.startswith("link: low-latency transfers") for label in labels)
    assert "race: the two unordered ops" in labels


def test_each_rank_s_ranges_land_on_its_own_host_track():
    from dbo.sim.records import COMPUTE, HostRange, OpRecord

    records = [OpRecord(r, "op", COMPUTE, r, None, "compute", 0.0, 0.0, 1.0) for r in (0, 1)]
    ranges = [
        HostRange(1, None, "on-rank-1", 0.0, 2.0, "nvtx"),
        HostRange(0, None, "on-rank-0", 0.0, 2.0, "nvtx"),
    ]
    trace = chrome_trace(records, ranges=ranges)
    pid_of = {
        e["args"]["name"]: e["pid"] for e in events(trace, "M") if e["name"] == "process_name"
    }
    placed = {e["name"]: e["pid"] for e in events(trace, "X") if e["cat"] == "range.nvtx"}
    assert placed == {"on-rank-0": pid_of["rank 0"], "on-rank-1": pid_of["rank 1"]}
