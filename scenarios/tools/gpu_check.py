"""GPU check: one MoE step measured on real CUDA streams and simulated on the H200 profile.

The parser is here; the work, and torch with it, is `scenarios.tools.gpu_check_run`, which
says how it is done; `run` imports it, so `--help` and a refused option answer at once.
"""

from __future__ import annotations

import argparse

from scenarios.lib.usage import UsageError

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out", default="out/gpu_check.json", help="JSON report path (default out/gpu_check.json)"
    )
    p.add_argument(
        "--reps", type=int, default=10, help="timed repetitions per variant (median reported)"
    )
    p.add_argument("--warmup", type=int, default=3, help="untimed runs before timing")
    p.add_argument("--layers", type=int, default=8, help="model layers (default 8)")
    p.add_argument("--only", choices=["prefill", "decode"], help="run one case")
    p.add_argument(
        "--sim-only", action="store_true", help="the simulated half alone (no GPU needed)"
    )
    p.add_argument(
        "--against",
        metavar="FILE",
        help="score the simulation against a stored gpu_check JSON (default with --sim-only: "
        "the shipped H200 one, when --layers matches)",
    )


def run(args: argparse.Namespace) -> int:
    # The refusals that need no torch, before importing it; the work checks the GPU and --out.
    if args.reps < 1 or args.warmup < 0 or args.layers < 1:
        raise UsageError("--reps and --layers must be >= 1, --warmup >= 0")
    if not args.sim_only and args.against:
        raise UsageError("--against needs --sim-only (on a GPU, it measures itself)")
    from scenarios.tools import gpu_check_run  # torch and the work: only now

    return gpu_check_run.run(args)
