"""Every benchmark of `dbo-sim bench`, imported in run order for its `@benchmark`
registration, and the verb's work (`report.run`) over them.
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
from scenarios.tools.bench.registry import benchmark_names, registered
from scenarios.tools.bench.report import run

# The benchmarks every run (quick or full) reports; each figure names the one it belongs to.
BENCHMARKS: tuple[str, ...] = benchmark_names()

__all__ = ["BENCHMARKS", "registered", "run"]
