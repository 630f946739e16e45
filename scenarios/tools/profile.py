"""Profile a GPU into a kernel table the simulator loads (`HardwareProfile(kernel_table=...)`).

The parser is here; the work, and torch with it, is `scenarios.tools.profile_run`, which
says how it is done; `run` imports it, so `--help` and a refused option answer at once.
"""

from __future__ import annotations

import argparse

from scenarios.lib.choices import CONFIG_NAMES, DECODE_CONTEXT, GPU_CHECK, PREFILL_REQUESTS
from scenarios.lib.usage import UsageError

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out",
        default="kernels.csv",
        help="table to write (default kernels.csv; host costs go to <stem>-host.json)",
    )
    p.add_argument(
        "--config",
        default=GPU_CHECK,
        help=f"model to record: {', '.join(CONFIG_NAMES)} (default {GPU_CHECK})",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="model layers to record (default: the dense layers and one MoE layer; distinct "
        "shapes repeat per layer)",
    )
    p.add_argument("--hidden", type=int, help="override the model's hidden size")
    p.add_argument("--experts", type=int, help="override the number of routed experts")
    p.add_argument("--top-k", type=int, help="override the experts each token is routed to")
    p.add_argument(
        "--tokens",
        type=int,
        help=f"tokens per step (prefill: {PREFILL_REQUESTS} equal prompts; decode: one per "
        f"request, {DECODE_CONTEXT} tokens of context); default: gpu_check's batches",
    )
    p.add_argument("--mode", default="both", choices=("prefill", "decode", "both"))
    p.add_argument("--reps", type=int, default=5, help="timed graph replays per shape (median)")
    p.add_argument(
        "--host-from-trace",
        nargs="+",
        metavar="TRACE",
        help="derive host costs from these profiler traces (names with 'dbo' are the DBO ones) "
        "instead of timing kernels",
    )
    p.add_argument(
        "--bare-op-us",
        type=float,
        default=None,
        help="unprofiled host time of one tiny eager op (calibrate_host), for --host-from-trace",
    )


def run(args: argparse.Namespace) -> int:
    if args.reps < 1:  # the one refusal that needs no torch; the work checks the rest first
        raise UsageError("--reps must be >= 1")
    from scenarios.tools import profile_run  # torch and the work: only now

    return profile_run.run(args)
