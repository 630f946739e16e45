"""`dbo-sim race-check`: seeded race programs judged by our checker and by torch's CSAN.

The parser is here; the work, and torch with it, is `scenarios.tools.race_check_run`, which
says how it is done; `run` imports it, so `--help` and a refused option answer at once.
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
