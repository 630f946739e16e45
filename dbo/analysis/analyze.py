"""`analyze_trace`: read a profiler trace and report what DBO did in each step.

One job: run the phases in order (read the file, normalise it, cut it into steps, compute
each step's figures, side-by-side slowdowns, layers and verdict) and hand back one
`TraceReport`. Every refusal (not a trace, no GPU activity, a damaged file) is a `TraceError`
raised by the reading phases, before any figure is computed.
"""

from __future__ import annotations

import time
from pathlib import Path

from dbo.analysis.events import slim_event
from dbo.analysis.layers import layer_figures
from dbo.analysis.metrics import step_figures
from dbo.analysis.reader import TraceError, read_trace
from dbo.analysis.report import StepReport, TraceReport, verdict
from dbo.analysis.sidebyside import side_by_side
from dbo.analysis.timeline import DeviceTimeline, Step, build_timeline, split_steps

__all__ = ["analyze_timeline", "analyze_trace", "load_timeline", "step_report"]


def load_timeline(path: str | Path) -> tuple[DeviceTimeline, float]:
    """The normalised timeline of the trace at `path`, and the seconds reading it took."""
    began = time.perf_counter()
    timeline = build_timeline(read_trace(path, slim_event))
    return timeline, time.perf_counter() - began


def step_report(
    timeline: DeviceTimeline, step: Step, window: tuple[float, float] | None = None
) -> StepReport:
    """One step's report, over `window` (trace microseconds) when given."""
    figures = step_figures(timeline, step, window)
    records = [
        r
        for r in timeline.step_records(step)
        if r.end_us >= figures.start_us and r.start_us <= figures.end_us
    ]
    sbs = side_by_side(records)
    layers = layer_figures(records, figures.start_us, figures.end_us)
    ubatches = sum(1 for t in figures.threads if t.label.startswith("ubatch"))
    return StepReport(figures, sbs, layers, verdict(figures, sbs, ubatches))


def analyze_timeline(
    timeline: DeviceTimeline, path: str | Path, read_s: float = 0.0, *, steps: int | None = None
) -> TraceReport:
    """The report of an already normalised timeline; `steps` cuts it into that many equal
    steps (for a trace of several identical steps with no marker between them)."""
    notes = list(timeline.notes)
    if steps is not None:
        try:
            timeline.steps = split_steps(timeline, steps)
        except ValueError as error:
            raise TraceError(f"{path}: {error}") from None
        notes.append(f"cut into {steps} equal steps by launch order (--steps)")
    elif len(timeline.steps) == 1 and timeline.source == "torch.profiler":
        notes.append(
            "no step markers (ProfilerStep#N, or a synchronize between steps): the trace is "
            "one step; pass steps=N (--steps N) if it holds N identical steps"
        )
    threads = [
        {
            "label": f"ubatch {t.ubatch}" if t.ubatch is not None else "other",
            "tid": t.tid,
            "launches": t.launches,
        }
        for t in timeline.threads
    ]
    return TraceReport(
        path=Path(path),
        source=timeline.source,
        device_name=timeline.device_name,
        total_events=timeline.total_events,
        read_s=read_s,
        streams=timeline.streams,
        threads=threads,
        steps=[step_report(timeline, s) for s in timeline.steps],
        timeline=timeline,
        notes=notes,
    )


def analyze_trace(path: str | Path, *, steps: int | None = None) -> TraceReport:
    """Read the Chrome trace at `path` (`torch.profiler`'s `export_chrome_trace`, `.json` or
    `.json.gz`, or a trace `dbo-sim` wrote) and report each step: busy time per stream,
    overlap, exposed comm, idle gaps and what the host did then, kernels side by side,
    layers and a verdict. Raises `TraceError` (a ValueError), and only that, for a file that
    is not a profiler trace, holds no GPU activity, is cut short or nested too deeply, or
    for `steps` outside 1..the trace's device ops. Single malformed events are skipped and
    counted in the report's notes."""
    timeline, read_s = load_timeline(path)
    return analyze_timeline(timeline, path, read_s, steps=steps)
