"""`dbo-sim verify MODULE:FORWARD --inputs MODULE:FACTORY`: `dbo.verify` from the command line.

MODULE is a dotted module name (found from the current folder, as `python -m` finds it) or a
path to a .py file; the part after the colon is an attribute path in it. FORWARD is the step
(`forward(batch) -> output`), FACTORY a callable with no arguments that returns the batch;
with `--ranks N` the step runs on N gloo rank processes (`dbo.verify_ranks`) and FACTORY takes
`(rank, world_size)` and returns that rank's batch.
Exit status: 0 when the report is ok, 1 when it is not (or the serial forward raised), 2 on a
bad command line (one line, `dbo-sim: <why>`), before any work.

The parser is here; the work, and torch with it, is `scenarios.tools.verify_run`, imported
by `run`, so `--help` and a refused option answer at once.
"""

from __future__ import annotations

import argparse
import math

from scenarios.lib.choices import RACE_ORDERS
from scenarios.lib.trace_window import window_type

__all__ = ["DESCRIPTION", "add_arguments", "run"]


DESCRIPTION = __doc__.split("\n\n")[0]


def _ubatches(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be >= 2 (DBO needs two ubatches), got {value}")
    return value


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _ranks(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be >= 2 (one rank is plain verify), got {value}")
    return value


def _seconds(text: str) -> float:
    value = _tolerance(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "forward",
        metavar="MODULE:FORWARD",
        help="the step to verify: forward(batch) -> output (MODULE: dotted name or .py path)",
    )
    p.add_argument(
        "--inputs",
        required=True,
        metavar="MODULE:FACTORY",
        help="a callable with no arguments that returns the batch",
    )
    p.add_argument("-n", "--ubatches", type=_ubatches, default=2, help="ubatches (default 2)")
    p.add_argument(
        "--ranks",
        type=_ranks,
        default=None,
        metavar="N",
        help="verify on N gloo rank processes, every collective checked across them; FACTORY "
        "then takes (rank, world_size) and returns that rank's batch",
    )
    p.add_argument(
        "--device",
        choices=["sim", "cuda"],
        default="sim",
        help="simulated GPU (default) or real CUDA streams",
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="write a Chrome trace and a PNG of both runs here",
    )
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument(
        "--window",
        type=window_type,
        default=None,
        metavar="START:END|layers=A:B",
        help="draw only virtual microseconds START to END, or MoE layers A to B-1 (with --out)",
    )
    p.add_argument("--atol", type=_tolerance, default=0.0, help="absolute tolerance (default 0)")
    p.add_argument("--rtol", type=_tolerance, default=0.0, help="relative tolerance (default 0)")
    p.add_argument(
        "--timeout",
        type=_seconds,
        default=60.0,
        help="seconds before a stuck serial or ubatched step is ended (default 60)",
    )
    p.add_argument(
        "--race-order",
        choices=RACE_ORDERS,
        default="issue",
        help="adversarial: also re-execute the ubatched step in a legal order that runs each "
        "race the other way round, and report the values it changes (default: issue)",
    )


def run(args: argparse.Namespace) -> int:
    from scenarios.tools import verify_run  # torch and the work: only now

    return verify_run.run(args)
