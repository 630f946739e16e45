"""A trace with malformed events, deep nesting or an impossible step count: the analysis skips
and counts what it cannot read, and refuses a file only with `TraceError`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from malformed_trace import MALFORMED, trace_text  # tests/, on the path through its conftest

import dbo
from dbo.analysis import TraceError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def write_trace(path: Path, *extra: Any) -> Path:
    path.write_text(trace_text(*extra))
    return path


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_a_malformed_event_is_skipped_and_counted_in_the_notes(tmp_path, kind):
    report = dbo.analyze_trace(write_trace(tmp_path / "t.json", MALFORMED[kind]))
    assert any(n.startswith("skipped 1 malformed event(s)") for n in report.notes)
    # The step is the good events': first launch at 90 us to the last kernel's end at 290 us.
    assert report.steps[0].figures.summary.step_us == pytest.approx(200.0)


def test_a_trace_nested_100000_deep_raises_trace_error(tmp_path):
    path = tmp_path / "t.json"
    write_trace(path)
    text = path.read_text().replace("[", "[" + "[" * 100_000 + "]" * 100_000 + ",", 1)
    path.write_text(text)
    with pytest.raises(TraceError, match="nested too deeply"):
        dbo.analyze_trace(path)


def test_more_steps_than_device_ops_raises_trace_error_at_once(tmp_path):
    with pytest.raises(TraceError, match="cannot cut a trace of 4 device op"):
        dbo.analyze_trace(write_trace(tmp_path / "t.json"), steps=100_000_000)


def test_a_thread_that_recorded_only_a_profiler_step_is_untraced_not_a_cpu_op(tmp_path):
    step = {
        "ph": "X",
        "cat": "user_annotation",
        "name": "ProfilerStep#0",
        "pid": 1,
        "tid": 200,
        "ts": 80.0,
        "dur": 400.0,
    }
    figures = dbo.analyze_trace(write_trace(tmp_path / "t.json", step)).steps[0].figures
    host = figures.host_in_idle["thread 200"]
    assert host["untraced"] > 0 and host.get("cpu_op", 0.0) == 0.0


@pytest.mark.timeout(120)
def test_a_dbo_step_is_compared_with_the_serial_trace_by_how_much_slower():
    from dbo.analysis.against import against_serial

    dbo_report = dbo.analyze_trace(FIXTURES / "prefill-dbo.json.gz", steps=2)
    serial = dbo.analyze_trace(FIXTURES / "prefill-serial.json.gz", steps=2)
    comparison = against_serial(dbo_report, -1, serial)
    assert comparison.change_pct > 0  # on one GPU the DBO prefill step was slower
    assert "SLOWER than serial by" in comparison.words()


def test_a_dbo_trace_is_refused_as_the_serial_one(tmp_path):
    from dbo.analysis.against import against_serial

    dbo_report = dbo.analyze_trace(FIXTURES / "decode-dbo.json.gz", steps=2)
    with pytest.raises(TraceError, match="ubatch threads; give a serial"):
        against_serial(dbo_report, -1, dbo_report)


def test_the_png_of_a_real_trace_names_the_profilers_clock(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from scenarios.tools.analyze_run import write_artifacts

    labels: list[str] = []
    monkeypatch.setattr(
        Figure, "savefig", lambda fig, *a, **k: labels.extend(ax.get_xlabel() for ax in fig.axes)
    )
    report = dbo.analyze_trace(write_trace(tmp_path / "t.json"))
    write_artifacts(report, report.timeline.steps[0], tmp_path, None)
    assert labels and all("virtual" not in label for label in labels)


def test_a_window_past_the_step_is_clipped_to_it(capsys):
    from scenarios.cli import main

    argv = ["analyze", str(FIXTURES / "decode-dbo.json.gz"), "--no-artifacts", "--json"]
    assert main([*argv, "--window", "0:1e308"]) == 0
    whole = json.loads(capsys.readouterr().out)["steps"][0]["step_us"]
    assert main(argv) == 0
    assert whole == json.loads(capsys.readouterr().out)["steps"][0]["step_us"]


def test_a_window_that_starts_outside_the_step_is_refused(capsys):
    from scenarios.cli import main

    argv = ["analyze", str(FIXTURES / "decode-dbo.json.gz"), "--no-artifacts"]
    assert main([*argv, "--window=-5:10"]) == 2
    assert "give START:END with 0 <= START <" in capsys.readouterr().err


def test_an_event_whose_category_is_not_a_string_is_no_crash(tmp_path):
    meta = {"ph": "M", "cat": {"a": 1}, "name": "process_name", "pid": 0, "tid": 0, "args": {}}
    report = dbo.analyze_trace(write_trace(tmp_path / "t.json", meta))
    assert report.steps[0].figures.summary.step_us == pytest.approx(200.0)


def test_a_cut_step_whose_work_ended_before_the_previous_one_does_not_end_before_it_starts(
    tmp_path,
):
    events = []
    for k, (ts, dur) in enumerate([(100.0, 500.0), (110.0, 500.0), (120.0, 10.0), (130.0, 10.0)]):
        events.append(
            {
                "ph": "X",
                "cat": "kernel",
                "name": "nvjet_gemm",
                "pid": 0,
                "tid": 7,
                "ts": ts,
                "dur": dur,
                "args": {"stream": 7, "correlation": k + 1},
            }
        )
        events.append(
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": "cudaLaunchKernel",
                "pid": 1,
                "tid": 100,
                "ts": 90.0 + k,
                "dur": 1.0,
                "args": {"correlation": k + 1},
            }
        )
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    steps = dbo.analyze_trace(path, steps=2).steps
    assert len(steps) == 2 and all(s.figures.step_us >= 0 for s in steps)
