"""Reports on a simulated step: the one import point for summary, Chrome trace and PNG timeline.

Each job lives in its own module (`summary`, `trace`, `plot`); this module only gathers their
public API so callers write `from dbo.sim.report import summarize, write_chrome_trace, ...`.
All of it reads `OpRecord`/`RaceReport` lists only and never the simulator's internals.
"""

from __future__ import annotations

from dbo.sim.plot import plot_runs, plot_timeline
from dbo.sim.summary import (
    RankSummary,
    StepSummary,
    clip_intervals,
    format_summary,
    intersect_intervals,
    summarize,
    total_length,
    union_intervals,
)
from dbo.sim.trace import (
    TraceRun,
    Window,
    chrome_trace,
    chrome_trace_runs,
    merge_traces,
    write_chrome_trace,
    write_chrome_trace_runs,
)

__all__ = [
    "RankSummary",
    "StepSummary",
    "TraceRun",
    "Window",
    "chrome_trace",
    "chrome_trace_runs",
    "clip_intervals",
    "format_summary",
    "intersect_intervals",
    "merge_traces",
    "plot_runs",
    "plot_timeline",
    "summarize",
    "total_length",
    "union_intervals",
    "write_chrome_trace",
    "write_chrome_trace_runs",
]
