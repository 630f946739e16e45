"""`dbo-sim race-check`: seeded race programs judged by our checker and by torch's CSAN.

Each program is written once against the `dbo.streams.Device` interface and the dbo
primitives, so the same code runs on the simulated device (our verdict) and, where CUDA is
present, on real streams under torch's CUDA sanitizer (CSAN). CSAN's dispatch mode is
thread-local, and the ubatch threads are outside its view when it is enabled as usual; here
one sanitizer (one event handler) is entered in every thread that issues work, through the
device's `thread_scope`, and its errors are collected instead of raised. The table shows,
per program, the expected verdict and both verdicts side by side (the number of races each
reported); a row where a checker disagrees with the expectation is marked.

The programs: the four seeded DBO bugs of the project's tests with their correct twins, and
the cases where histories by memory matter (memory reuse, list ops, a second storage over the
same memory, strided views, overlapping views at different starts, allocator reuse with and
without `record_stream`).

The parser is here; the work, and torch with it, is `scenarios.tools.race_check_run`, imported
by `run`, so `--help` and a refused option answer at once.
"""

from __future__ import annotations

import argparse

__all__ = ["DESCRIPTION", "add_arguments", "run"]


DESCRIPTION = (
    "Run seeded race programs on the simulated device and, where CUDA is present, under "
    "torch's CUDA sanitizer entered in every ubatch thread; print both verdicts side by side."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", default=None, help="run programs whose name contains this")
    parser.add_argument("--list", action="store_true", help="list the programs and exit")


def run(args: argparse.Namespace) -> int:
    from scenarios.tools import race_check_run  # torch and the work: only now

    return race_check_run.run(args)
