"""`--window` for `dbo-sim run`: a readable slice of each scenario's trace and timeline.

A full-size step (61 layers, tens of thousands of ops) draws as a barcode; the window redraws
each written trace from the file, keeping only the ops that overlap a time range
(`START:END`, virtual microseconds) or a run of MoE layers (`layers=A:B`, counted by the
dispatches of the first ubatch), into `NAME.nN.rR.window.trace.json` and `.window.png` beside
the full ones.

The option and its parsing import nothing heavy (a parser built for `--help` stays free of
torch); the simulator's trace and plot modules are imported when a value is parsed or a
window drawn.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dbo.sim.trace import WindowSpec

__all__ = ["add_argument", "window_type", "write_windowed"]


def window_type(text: str) -> WindowSpec:
    """argparse type: a `WindowSpec`, or the reason it is not one."""
    from dbo.sim.trace import parse_window

    try:
        return parse_window(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--window",
        type=window_type,
        default=None,
        metavar="START:END|layers=A:B",
        help="also write NAME.nN.rR.window.{trace.json,png}: only virtual microseconds START "
        "to END, or MoE layers A to B-1",
    )


def write_windowed(results: Sequence[Any], spec: WindowSpec | None) -> list[str]:
    """For each result with a trace, the windowed trace and PNG; returns the paths written.
    A window that names layers a run does not have is reported and skipped, not fatal."""
    if spec is None:
        return []
    from dbo.sim.plot import plot_runs
    from dbo.sim.trace import write_chrome_trace_runs
    from dbo.sim.trace_read import runs_from_trace

    written: list[str] = []
    for result in results:
        trace_path = getattr(result, "trace", None)
        if not trace_path:
            continue
        path = Path(trace_path)
        runs = runs_from_trace(json.loads(path.read_text(encoding="utf-8")))
        records = [r for run in runs for r in run.records]
        if not records:
            continue
        try:
            window = spec.resolve(records)
        except ValueError as error:
            print(f"{result.scenario}: no window drawn: {error}", file=sys.stderr)
            continue
        stem = path.name.removesuffix(".trace.json")
        trace = write_chrome_trace_runs(
            path.with_name(f"{stem}.window.trace.json"),
            runs,
            window=window,
            metadata={"scenario": result.scenario},
        )
        png = plot_runs(
            path.with_name(f"{stem}.window.png"),
            runs,
            window=window,
            title=f"{result.scenario}: {window.start_us:.1f} to {window.end_us:.1f} us",
        )
        written += [str(trace), str(png)]
    return written
