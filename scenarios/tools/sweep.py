"""Where DBO pays: simulated speedup against tokens per device, for decode and prefill.

Each point runs the DeepSeek-V3-size workload (`meta`, shapes only) serially and with DBO on
the simulated device and records the ratio of step times, and the DBO run's communication
against its compute time (`comm_compute_ratio`): the vLLM maintainers' rule is that DBO pays
only when communication outweighs the GEMMs it could hide under. Small decode batches are
host-launch and latency bound, so overlap cannot pay for its handoffs there; large prefill
batches move enough bytes for the comm stream to hide under compute. `pays_from` reads off
where a phase's gain turns positive; the PNG plots the gain against tokens per device (one
panel per phase) and against the comm/compute ratio.

Decode points are one-token requests over a `context_len`-token KV cache each, by default the
same context as the `dsv3-decode-ll` scenario, so the sweep's 256-token point is that
scenario's step; prefill points are 4096-token prompts (the last one shorter when the count is
not a multiple; a count below 4096 is one prompt), and `describe_prefill` says which for the
points a sweep runs. `CsvSink` writes each point as it finishes, so an interrupted sweep keeps the
points it computed; a point whose step fails (a step past `--timeout`, the serial one included)
is a FAILED row, and the sweep goes on to the next point.

The parser is here; the work, and torch with it, is `scenarios.tools.sweep_run`, imported
by `run`, so `--help` and a refused option answer at once.
"""

from __future__ import annotations

import argparse

from scenarios.lib.usage import int_in
from scenarios.tools.common import add_run_options
from scenarios.tools.sweep_args import (
    DECODE_CONTEXT,
    FULL_LAYERS,
    MAX_CONTEXT,
    MAX_TOKENS_PER_DEVICE,
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
    from scenarios.tools import sweep_run  # torch and the work: only now

    return sweep_run.run(args)
