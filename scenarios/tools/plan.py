"""`dbo-sim plan`: should DBO be on for *this* deployment, with how many ubatches, from which
token count, and how does the answer move with expert-load skew?

One job: the verb's options and its run. The whole command line is checked first
(`scenarios.tools.plan_args`, one line and exit status 2 for anything wrong) before torch,
the model or the simulator is imported, so a refusal or `--help` is immediate; then
`scenarios.tools.plan_sim` simulates the EP group and prints the answer (docs/plan.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from scenarios.lib.usage import int_in
from scenarios.tools.plan_args import (
    DEFAULT_SKEWS,
    MAX_EP,
    MAX_SEED,
    MAX_TOKENS,
    MAX_WORKERS,
    MAX_ZIPF,
    parse_args,
)

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--preset", default="deepseek-v3", help="model preset: deepseek-v3 (default) or tiny")
    a(
        "--config",
        type=Path,
        help="JSON of ModelConfig fields overriding the preset's, e.g. "
        '{"num_experts": 128, "dtype": "bfloat16"}',
    )
    a("--profile", default="h800", help="hardware profile: h200, h100, h800 (default), b200")
    a("--ep", default="64", help="EP sizes, comma-separated, 2 or more; the first is the answer's")
    a("--dp", type=int_in(1, MAX_EP), help="DP attention ranks: 1 or the EP size (default: EP)")
    a("--gpus-per-node", type=int_in(1, MAX_EP), help="GPUs per node (default: the profile's)")
    a(
        "--phase",
        choices=("decode", "prefill", "both"),
        default="both",
        help="decode (DeepEP low-latency, CUDA graphs), prefill (normal kernels, eager), or both",
    )
    a(
        "--tokens",
        help=f"tokens per device: 16,32,64 or 16:512 (doubling), each 1..{MAX_TOKENS}; "
        "default per phase",
    )
    a(
        "--dp-spread",
        default="0",
        metavar="F",
        help="DP ranks' real tokens drawn uniformly in [(1-F) T, T], F in [0, 1), seeded",
    )
    a(
        "--skew",
        default=DEFAULT_SKEWS,
        help=f"routing skews: balanced, zipf:S (S in 0..{MAX_ZIPF:g}), dirichlet:A (A > 0); "
        "the first is the answer's",
    )
    a("--histogram", type=Path, help="measured tokens per expert per MoE layer (CSV or JSON)")
    a("--placement", default="contiguous", help="contiguous, or eplb:N (N redundant experts)")
    a("--ubatches", default="2,3,4", help="ubatch counts to try, comma-separated, 2..4")
    a("--seed", type=int_in(0, MAX_SEED), default=0, help="seed of skews and the DP spread")
    a("--out", type=Path, help="write plan.csv, plan.png and the answer's trace here")
    a("--json", action="store_true", help="print the answers and points as one JSON document")
    a(
        "--workers",
        type=int_in(1, MAX_WORKERS),
        help=f"processes recording and replaying steps (default: the local cores, at most "
        f"{MAX_WORKERS}); recordings are kept in $DBO_SIM_CACHE or ~/.cache/dbo-sim",
    )


def run(args: argparse.Namespace) -> int:
    parsed = parse_args(args)
    from scenarios.tools import plan_sim  # torch, the model and the simulator: only now

    return plan_sim.run_plan(parsed)
