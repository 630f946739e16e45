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
`@benchmark(...)` function in one of those modules; this package imports them in run order.
"""

from __future__ import annotations

# Imported for their @benchmark registrations: the import order is the run order (the cheap
# workspace figures first, the long steps last), so the sorter must leave it alone.
# isort: off
from scenarios.tools.bench import workspace  # noqa: F401
from scenarios.tools.bench import baton  # noqa: F401
from scenarios.tools.bench import simulator  # noqa: F401
from scenarios.tools.bench import races  # noqa: F401
from scenarios.tools.bench import cluster  # noqa: F401
from scenarios.tools.bench import plan  # noqa: F401
from scenarios.tools.bench import scaling  # noqa: F401

# isort: on
from scenarios.tools.bench.baselines import PerCallWorkspace
from scenarios.tools.bench.figures import Figure, Stats, Target
from scenarios.tools.bench.registry import FULL, QUICK, Plan, benchmark, benchmark_names
from scenarios.tools.bench.report import add_arguments, format_table, run, run_benchmarks

# The benchmarks every run (quick or full) reports; each figure names the one it belongs to.
BENCHMARKS: tuple[str, ...] = benchmark_names()

__all__ = [
    "BENCHMARKS",
    "Stats",
    "Target",
    "Figure",
    "Plan",
    "FULL",
    "QUICK",
    "PerCallWorkspace",
    "benchmark",
    "run_benchmarks",
    "format_table",
    "add_arguments",
    "run",
]
