"""Concurrent slot access: many ubatch threads hammer the workspace while another locks and unlocks.

The parser is here; the work, and torch with it, is `scenarios.tools.stress_run`, which
says how it is done; `run` imports it, so `--help` and a refused option answer at once.
"""

from __future__ import annotations

import argparse

from scenarios.lib.usage import int_in, positive_int, timeout_seconds

__all__ = ["MAX_LANES", "MAX_THREADS", "add_arguments", "run"]


MAX_THREADS = 1024


MAX_LANES = 64  # slots are threads x lanes; vLLM's engines use a handful of lanes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--threads",
        type=int_in(1, MAX_THREADS),
        default=8,
        help="ubatch threads (default 8)",
    )
    p.add_argument("--iterations", type=positive_int, default=2000, help="requests per thread")
    p.add_argument(
        "--lanes",
        type=int_in(1, MAX_LANES),
        default=1,
        help="workspace lanes each thread spreads its requests over (default 1)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--timeout",
        type=timeout_seconds,
        default=120.0,
        help="seconds for the whole run, thread start and stop included; a run cut short by "
        "it fails (default 120)",
    )
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from scenarios.tools import stress_run  # torch and the work: only now

    return stress_run.run(args)
