"""Where DBO pays: simulated speedup against tokens per device, for decode and prefill.

The parser is here; the work, and torch with it, is `scenarios.tools.sweep_run`, which
says how it is done; `run` imports it, so `--help` and a refused option answer at once.
"""

from __future__ import annotations

import argparse

from scenarios.lib.usage import UsageError, int_in
from scenarios.tools.common import add_run_options
from scenarios.tools.sweep_args import (
    DECODE_CONTEXT,
    DECODE_TOKENS,
    FULL_LAYERS,
    MAX_CONTEXT,
    MAX_TOKENS_PER_DEVICE,
    PREFILL_TOKENS,
    check_points,
)

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_options(p)
    tokens = int_in(1, MAX_TOKENS_PER_DEVICE)
    p.add_argument("--decode", type=tokens, nargs="+", help="decode tokens per device to try")
    p.add_argument("--prefill", type=tokens, nargs="+", help="prefill tokens per device to try")
    p.add_argument(
        "--context",
        type=int_in(1, MAX_CONTEXT),
        default=DECODE_CONTEXT,
        help=f"KV-cache tokens per decode request (default {DECODE_CONTEXT}, as dsv3-decode-ll)",
    )
    p.add_argument(
        "--layers",
        type=int_in(1, FULL_LAYERS),
        default=None,
        help=f"fewer layers than DeepSeek-V3's {FULL_LAYERS} (1 to {FULL_LAYERS}; faster); "
        "dense and MoE layers kept in proportion",
    )


def run(args: argparse.Namespace) -> int:
    decode = args.decode or DECODE_TOKENS
    prefill = args.prefill or PREFILL_TOKENS
    problem = check_points(decode, prefill, args.ubatches)
    if problem is not None:
        raise UsageError(problem)
    from scenarios.tools import sweep_run  # torch and the work: only now

    return sweep_run.run(args)
