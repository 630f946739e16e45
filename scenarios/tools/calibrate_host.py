"""Measure this host's launch and handoff costs, the two host numbers of a hardware profile.

The parser is here; the work, and torch with it, is `scenarios.tools.calibrate_host_run`, which
says how it is done; `run` imports it, so `--help` and a refused option answer at once.
"""

from __future__ import annotations

import argparse

__all__ = ["DEFAULT_OUT", "DESCRIPTION", "add_arguments", "run"]


DESCRIPTION = __doc__.splitlines()[0] + " Needs a CUDA GPU unless --device sim."


DEFAULT_OUT = "out/host-costs.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        choices=["cuda", "sim"],
        default="cuda",
        help="where to measure: cuda (default; needs a GPU) or sim (the handoff alone)",
    )
    parser.add_argument("--quick", action="store_true", help="fewer calls (a smoke run)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument(
        "--out", default=DEFAULT_OUT, help=f"JSON file the result is written to ({DEFAULT_OUT})"
    )


def run(args: argparse.Namespace) -> int:
    from scenarios.tools import calibrate_host_run  # torch and the work: only now

    return calibrate_host_run.run(args)
