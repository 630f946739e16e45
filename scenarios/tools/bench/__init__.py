"""`dbo-sim bench`: time what dbo-sim exists to make fast, each figure a ratio.

Every figure sets our code against a baseline timed in the same process, interleaved with it
(A, B, A, B, ...), because the machines this runs on are small, shared and noisy: an absolute
time means little, a ratio taken in the same minutes means something. Each figure keeps its
samples (median, min, max, and the values), the ratio (the median of per-repetition ratios,
each repetition sampling ours and the baseline back to back), and, where the project has one,
a target and whether it was met.

The parts: `figures` (the records), `timing` (how a sample is taken), `baselines` (the plain
per-call workspace, a do-nothing device), `registry` (the one list of benchmarks, `@benchmark`), the
benchmarks themselves (`workspace`, `baton`, `simulator`, `races`, `cluster`, `plan`, `scaling`),
and `report` (running them, the table and `bench.json`). A new benchmark is one
`@benchmark(...)` function in one of those modules; `suite` imports them in run order.

This package is the verb's parser; `run` imports the suite (and torch with it), so `--help`
and a refused option answer at once.
"""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a short smoke run (CI)")
    parser.add_argument("--out", default="out", help="folder for bench.json")
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from scenarios.tools.bench import suite  # every benchmark, torch with them: only now

    return suite.run(args)
