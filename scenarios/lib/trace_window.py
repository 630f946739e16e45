"""`--window` for `dbo-sim run` and `verify`: a readable slice of a trace and its timeline.

A full-size step (61 layers, tens of thousands of ops) draws as a barcode; the window redraws
each written trace from the file, keeping only the ops that overlap a time range
(`START:END`, virtual microseconds) or a run of MoE layers (`layers=A:B`, counted by the
dispatches of the first ubatch), into `NAME.nN.rR.window.trace.json` and `.window.png` beside
the full ones.

The option's syntax is the CLI's, so its parser is here (`analyze --window` reads the same
syntax): every check of a value runs before the simulator is imported, so `--help` and a
malformed value answer without torch; a well-formed value imports `dbo.sim.window` to become
its `WindowSpec`, and drawing a window imports the trace and plot modules.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dbo.sim.window import WindowSpec

__all__ = ["add_argument", "parse_window", "window_type", "write_windowed"]


def parse_window(text: str) -> WindowSpec:
    """`START:END` in virtual microseconds, or `layers=A:B` (MoE layers A to B-1, from 0)."""
    start, end, unit = _bounds(text)
    from dbo.sim.window import WindowSpec  # only for a value that passed every check

    return WindowSpec(start, end, unit)


def _bounds(text: str) -> tuple[float, float, str]:
    """(start, end, unit) of a well-formed window, else a ValueError saying what is wrong."""
    body, unit = text, "us"
    if text.startswith("layers="):
        body, unit = text[len("layers=") :], "layers"
    start, sep, end = body.partition(":")
    try:
        if not sep:
            raise ValueError
        a, b = (int(start), int(end)) if unit == "layers" else (float(start), float(end))
    except ValueError:
        raise ValueError(
            f"window {text!r}: expected START:END in microseconds (e.g. 100:400) or "
            f"layers=A:B (e.g. layers=0:2)"
        ) from None
    if unit == "layers" and not 0 <= a < b:
        raise ValueError(f"window {text!r}: layers A:B needs 0 <= A < B")
    if unit == "us":
        _check_time_bounds(a, b)
    return a, b, unit


def _check_time_bounds(start: float, end: float) -> None:
    """`dbo.sim.window.Window`'s own checks, in its words, made without importing it (and
    torch with it); tests/sim/test_trace_window.py holds the two equal."""
    if not (math.isfinite(start) and math.isfinite(end)):
        raise ValueError(f"window bounds must be finite, got {start}:{end}")
    if end <= start:
        raise ValueError(f"window end ({end}) must be after its start ({start})")


def window_type(text: str) -> WindowSpec:
    """argparse type: a `WindowSpec`, or the reason it is not one."""
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
