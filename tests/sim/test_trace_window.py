"""Windows on a trace: parsing `--window`, MoE layers counted by dispatches, and redrawing a
written trace from its file (what `dbo-sim run --window` does)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import dbo
from dbo.sim import SimDevice
from dbo.sim.records import COMM, COMPUTE, OpRecord
from dbo.sim.trace import (
    TraceRun,
    Window,
    WindowSpec,
    layer_starts,
    write_chrome_trace,
    write_chrome_trace_runs,
)
from dbo.sim.trace_read import runs_from_trace
from scenarios.cli import main
from scenarios.lib.trace_window import parse_window, write_windowed


def rec(
    seq: int,
    name: str,
    start: float,
    end: float,
    ubatch: int | None = 0,
    kind: str = COMPUTE,
    stream: str = "compute",
) -> OpRecord:
    return OpRecord(seq, name, kind, 0, ubatch, stream, start, start, end)


def layered_records() -> list[OpRecord]:
    """Three MoE layers per ubatch: dispatches of ubatch 0 at 10, 30, 50."""
    out = []
    for layer, t in enumerate((10.0, 30.0, 50.0)):
        out.append(rec(4 * layer, "aten::mm", t - 10, t))
        out.append(rec(4 * layer + 1, "comm::dispatch", t, t + 5, kind=COMM, stream="comm"))
        out.append(
            rec(4 * layer + 2, "comm::dispatch", t + 5, t + 9, ubatch=1, kind=COMM, stream="comm")
        )
        out.append(rec(4 * layer + 3, "aten::mm", t + 5, t + 10, ubatch=1))
    return out


def test_a_time_window_parses_in_microseconds():
    spec = parse_window("100:250.5")
    assert spec.resolve([]) == Window(100.0, 250.5)


@pytest.mark.parametrize("text", ["100", "a:b", "5:5", "layers=2:1", "layers=x:2"])
def test_a_malformed_window_is_refused_with_the_expected_forms(text):
    with pytest.raises(ValueError, match="window"):
        parse_window(text)


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("100:400", WindowSpec(100.0, 400.0, "us")),
        ("-5:1e3", WindowSpec(-5.0, 1000.0, "us")),
        (" 1:2 ", WindowSpec(1.0, 2.0, "us")),
        ("layers=0:2", WindowSpec(0, 2, "layers")),
        ("layers=3:61", WindowSpec(3, 61, "layers")),
    ],
)
def test_a_window_parses_into_the_simulators_window_spec(text, spec):
    parsed = parse_window(text)
    assert parsed == spec
    assert type(parsed.start) is type(spec.start)  # layers stay whole numbers


# The parser checks microsecond bounds without importing `Window` (and torch); these pairs
# hold its refusals to Window's own, word for word, and its acceptances to Window's.
BOUNDS = "5:1 5:5 -1:-2 0:0.0 1:2 -3:0 1e-9:2e-9 2.5:2.25 inf:5 5:inf -inf:0 nan:1 1:nan 1e400:2"


@pytest.mark.parametrize("text", BOUNDS.split())
def test_the_parsers_bounds_checks_are_windows_own(text):
    start, end = (float(bound) for bound in text.split(":"))
    try:
        expected = Window(start, end)
    except ValueError as error:
        with pytest.raises(ValueError) as refused:
            parse_window(text)
        assert str(refused.value) == str(error)
    else:
        assert parse_window(text).resolve([]) == expected


def test_layers_are_counted_by_the_first_ubatchs_dispatches():
    records = layered_records()
    assert layer_starts(records) == [10.0, 30.0, 50.0]
    assert parse_window("layers=1:2").resolve(records) == Window(30.0, 50.0)
    assert parse_window("layers=2:9").resolve(records) == Window(50.0, 60.0)  # to the end


def test_a_window_past_the_last_layer_says_how_many_there_are():
    with pytest.raises(ValueError, match="3 MoE layer"):
        parse_window("layers=3:4").resolve(layered_records())


def test_a_written_trace_reads_back_as_its_runs(tmp_path):
    device = SimDevice()
    with dbo.use_device(device), device.thread_scope(None), torch.profiler.record_function("block"):
        torch.ones(4, 4) @ torch.ones(4, 4)
    path = write_chrome_trace_runs(
        tmp_path / "t.json",
        [
            TraceRun("serial", device.timeline, ranges=device.host_ranges),
            TraceRun("DBO", layered_records()),
        ],
    )
    serial, ubatched = runs_from_trace(json.loads(path.read_text()))
    assert (serial.label, ubatched.label) == ("serial", "DBO")
    assert [(r.name, r.start_us, r.end_us, r.stream) for r in serial.records] == [
        (r.name, r.start_us, r.end_us, r.stream) for r in device.timeline
    ]
    assert [g.name for g in serial.ranges] == ["block"]
    assert len(ubatched.records) == len(layered_records())


def test_write_windowed_adds_a_window_trace_and_png_beside_the_full_ones(tmp_path):
    full = write_chrome_trace(tmp_path / "moe.trace.json", layered_records())
    result = SimpleNamespace(scenario="moe", trace=str(full))
    written = write_windowed([result], parse_window("layers=0:1"))
    assert sorted(p.rsplit("/", 1)[-1] for p in written) == [
        "moe.window.png",
        "moe.window.trace.json",
    ]
    trace = json.loads((tmp_path / "moe.window.trace.json").read_text())
    assert trace["otherData"]["window_us"] == [10.0, 30.0]
    assert all(e["ts"] <= 30.0 for e in trace["traceEvents"] if e["ph"] == "X")


def test_run_refuses_a_bad_window_before_running_anything(capsys):
    assert main(["run", "moe-prefill-ht", "--window", "later"]) == 2
    assert "layers=A:B" in capsys.readouterr().err
