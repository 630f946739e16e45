"""Run scenarios and print one verdict row per scenario as it finishes.

`dbo-sim run [NAMES]` runs the default scenarios (or the named ones) serially and under DBO,
in this process or across local rank processes (`--ranks N`, or a torchrun launch). The table
starts with what the simulated clock rests on (measured kernels or the roofline alone); each
row is printed and flushed as its scenario finishes, so Ctrl-C keeps the finished rows, and a
failed scenario is a FAIL row with its reason below the table, never a traceback.

The parser is here; the work, and torch with it, is `scenarios.tools.run_scenarios`, imported
by `run`, so `--help` and a refused option answer at once.
"""

from __future__ import annotations

import argparse

from scenarios.lib import trace_window
from scenarios.lib.usage import positive_int
from scenarios.tools.common import add_run_options

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("names", nargs="*", help="scenario names (see `list`)")
    add_run_options(p)
    p.add_argument(
        "--ranks",
        type=positive_int,
        default=1,
        help="run across this many local processes (gloo on 127.0.0.1), one rank each; "
        "torchrun sets the ranks itself",
    )
    trace_window.add_argument(p)


def run(args: argparse.Namespace) -> int:
    from scenarios.tools import run_scenarios  # torch and the work: only now

    return run_scenarios.run(args)
