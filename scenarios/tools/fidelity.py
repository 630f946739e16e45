"""Fidelity: the simulator against published DBO/TBO and DeepEP measurements, side by side.

The parser is here; the work, and torch with it, is `scenarios.tools.fidelity_run`, which
says how it is done; `run` imports it, so `--help` and a refused option answer at once.
"""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="fewer layers and points (seconds, for CI)"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    from scenarios.tools import fidelity_run  # torch and the work: only now

    return fidelity_run.run(args)
