"""`dbo-sim plan`: should DBO be on for *this* deployment, with how many ubatches, from which
token count, and how does the answer move with expert-load skew?

For each phase (decode: DeepEP low-latency kernels, steps replayed as CUDA graphs; prefill:
DeepEP normal kernels, eager), each tokens-per-device point and each skew, one rank's step is
recorded serially and with 2..4 ubatches and replayed for the whole EP group
(`scenarios.lib.cluster_step`, `dbo.sim.cluster`): the step time is the slowest rank's, so
imbalance, stragglers, the SMs DeepEP's normal kernels hold and DP padding all count. The
gain of N ubatches is serial step / N-ubatch step - 1. DBO "pays from" the smallest token
count from which the best gain stays positive over the rest of the range; that count is
printed as the engine flags to set.

Out (`--out DIR`): `plan.csv` (one row per phase, EP, skew, tokens, ubatch count),
`plan.png` (gain against tokens per device, a line per EP size and skew), and the replayed
EP group at the answer's point as `plan.trace.json` / `plan.timeline.png` (a process per rank).
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from dbo.sim.cluster import ClusterResult
from dbo.sim.hardware import HardwareProfile, profile_from_name
from dbo.sim.routing import Placement, Routing
from scenarios.lib.cluster_step import (
    DPAgreement,
    StepSpec,
    cluster_step,
    dp_agreement,
    placement_from_spec,
    routing_from_spec,
)
from scenarios.lib.progress import advance, progress_bar
from scenarios.lib.usage import UsageError, writable_dir
from scenarios.model import PRESETS, ModelConfig, preset
from scenarios.tools.plan_output import PhaseAnswer, PlanPoint, report, write_outputs

__all__ = ["PlanInputs", "add_arguments", "run", "plan_phase", "check_inputs"]

DEFAULT_TOKENS = {"decode": "16,32,64,128,256,512", "prefill": "2048,4096,8192,16384"}
DEFAULT_SKEWS = "balanced,zipf:0.2,zipf:0.4"


def _parse_tokens(text: str) -> list[int]:
    try:
        if ":" in text:
            lo, hi = (int(v) for v in text.split(":"))
            values, t = [], lo
            while t <= hi:
                values.append(t)
                t *= 2
        else:
            values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise UsageError(
            f"--tokens {text!r}: give counts per device like 16,32,64 or a range 16:512 "
            "(doubling), all >= 1"
        )
    return sorted(set(values))


def _parse_ints(text: str, flag: str, lo: int, hi: int) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        values = []
    if not values or values[0] < lo or values[-1] > hi:
        raise UsageError(f"{flag} {text!r}: give integers in {lo}..{hi}, comma-separated")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--preset", default="deepseek-v3", help="model preset (default deepseek-v3)")
    a("--config", type=Path, help="JSON of ModelConfig fields overriding the preset's")
    a("--profile", default="h800", help="hardware profile (default h800)")
    a("--ep", default="64", help="EP size(s), comma-separated; the first is the answer's")
    a("--dp", type=int, help="DP attention ranks: 1 or the EP size (default: the EP size)")
    a("--gpus-per-node", type=int, default=8, help="GPUs per node (NVLink domain), default 8")
    a("--phase", choices=("decode", "prefill", "both"), default="both")
    a("--tokens", help="tokens per device: 16,32,64 or 16:512 (default per phase)")
    a(
        "--dp-spread",
        type=float,
        default=0.0,
        help="DP ranks' real tokens drawn uniformly in [(1-F) T, T], seeded (default 0)",
    )
    a(
        "--skew",
        default=DEFAULT_SKEWS,
        help="routing skews: balanced, zipf:S, dirichlet:A; the first is the answer's",
    )
    a("--histogram", type=Path, help="measured tokens per expert per MoE layer (CSV/JSON)")
    a("--placement", default="contiguous", help="contiguous or eplb:N (N redundant experts)")
    a("--ubatches", default="2,3,4", help="ubatch counts to try (2..4)")
    a("--seed", type=int, default=0, help="seed of the skewed routings and the DP spread")
    a("--out", type=Path, help="write plan.csv, plan.png and the answer's trace here")
    a("--json", action="store_true", help="print the answers and points as JSON")


@dataclass(frozen=True)
class PlanInputs:
    """The command line, checked: everything `plan_phase` reads, each from one place."""

    config: ModelConfig
    profile: HardwareProfile
    eps: list[int]
    gpus_per_node: int
    phases: list[str]
    tokens: dict[str, list[int]]
    skews: list[str]
    ubatches: list[int]
    placement: str
    redundant: int
    seed: int = 0  # of the skewed routings and the DP spread
    histogram: Path | None = None  # measured tokens per expert per layer
    dp: int | None = None  # DP ranks deciding ubatching (None: the EP size)
    dp_spread: float = 0.0


def _config(args: argparse.Namespace) -> ModelConfig:
    if args.preset not in PRESETS:
        raise UsageError(
            f"unknown preset {args.preset!r}; choose one of {', '.join(sorted(PRESETS))}"
        )
    config = preset(args.preset)
    if args.config is None:
        return config
    try:
        fields = json.loads(Path(args.config).read_text())
        return config.with_(**fields)
    except (OSError, ValueError, TypeError) as error:
        raise UsageError(f"--config {args.config}: {error}") from None


def check_inputs(args: argparse.Namespace) -> PlanInputs:
    """Everything the command line says, checked before any step is simulated."""
    config = _config(args)
    try:
        profile = profile_from_name(args.profile)
    except ValueError as error:
        raise UsageError(str(error)) from None
    eps = _parse_ints(args.ep, "--ep", 1, 4096)
    redundant = 0
    if args.placement != "contiguous":
        name, _, value = args.placement.partition(":")
        if name != "eplb" or not value.isdigit():
            raise UsageError(f"--placement {args.placement!r}: give contiguous or eplb:N")
        redundant = int(value)
    for ep in eps:
        if (config.num_experts + redundant) % ep:
            raise UsageError(
                f"--ep {ep} does not divide the {config.num_experts + redundant} experts of "
                f"{config.name}; choose an EP size that does (or --placement eplb:N)"
            )
    if args.dp is not None and args.dp not in (1, *eps):
        raise UsageError(f"--dp {args.dp}: give 1 or the EP size (DP attention over the EP group)")
    if args.gpus_per_node < 1:
        raise UsageError(f"--gpus-per-node {args.gpus_per_node}: give a positive count")
    if not 0.0 <= args.dp_spread < 1.0:
        raise UsageError(f"--dp-spread {args.dp_spread}: give a fraction in [0, 1)")
    phases = ["decode", "prefill"] if args.phase == "both" else [args.phase]
    tokens = {p: _parse_tokens(args.tokens or DEFAULT_TOKENS[p]) for p in phases}
    skews = ["histogram"] if args.histogram else [s for s in args.skew.split(",") if s]
    for s in skews:
        try:
            routing_from_spec(s, config, seed=args.seed, histogram=args.histogram)
        except ValueError as error:
            raise UsageError(f"--{'histogram' if args.histogram else 'skew'}: {error}") from None
    ubatches = _parse_ints(args.ubatches, "--ubatches", 2, 4)
    if args.out is not None:
        writable_dir(args.out)
    return PlanInputs(
        config,
        profile,
        eps,
        args.gpus_per_node,
        phases,
        tokens,
        skews,
        ubatches,
        args.placement,
        redundant,
        seed=args.seed,
        histogram=args.histogram,
        dp=args.dp,
        dp_spread=args.dp_spread,
    )


def _dp_tokens(tokens: int, ranks: int, spread: float, seed: int) -> list[int]:
    if spread <= 0 or ranks <= 1:
        return [tokens] * ranks
    rng = np.random.default_rng(seed)
    lo = max(1, int(round(tokens * (1 - spread))))
    real = rng.integers(lo, tokens + 1, size=ranks)
    real[0] = tokens  # the largest rank sets the padded count
    return [int(t) for t in real]


def _point(
    spec: StepSpec,
    routing: Routing,
    placement: Placement,
    skew: str,
    serial_us: float,
    dp: DPAgreement,
) -> tuple[PlanPoint, ClusterResult]:
    """One replayed step; a step the DP ranks agreed not to split gains nothing."""
    result = cluster_step(spec, routing, placement)
    step = result.step_us
    slow = int(np.argmax(step))
    n = spec.num_ubatches or 1
    gain = (serial_us / float(step[slow]) - 1.0) * 100.0 if spec.num_ubatches else 0.0
    point = PlanPoint(
        spec.phase,
        spec.config.ep_size,
        skew,
        spec.tokens,
        n,
        float(step[slow]),
        gain,
        slow,
        float(result.peer_wait_us[slow]),
        float(result.exposed_comm_us[slow]),
        dp.padded_tokens,
        dp.padding_share,
        dp.split,
    )
    return point, result


def plan_phase(
    inputs: PlanInputs,
    phase: str,
    ep: int,
    skew: str,
    on_point: Callable[[str], None] | None = None,
) -> tuple[list[PlanPoint], PhaseAnswer, dict[tuple[int, int], ClusterResult]]:
    """Every token count and ubatch count of one phase, EP size and skew: the points, the
    answer, and the replayed group at the answer's point. `on_point(what)` hears each token
    count as it finishes."""
    config = inputs.config.with_(ep_size=ep)
    record_config = config.with_(num_experts=config.num_experts + inputs.redundant)
    routing = routing_from_spec(skew, config, seed=inputs.seed, histogram=inputs.histogram)
    placement = placement_from_spec(
        inputs.placement if inputs.redundant else "contiguous", config, routing
    )
    dp_ranks = ep if inputs.dp is None else inputs.dp
    points, results = [], {}
    for tokens in inputs.tokens[phase]:
        real = _dp_tokens(tokens, dp_ranks, inputs.dp_spread, inputs.seed)
        base = StepSpec(record_config, phase, tokens, None, inputs.profile, inputs.gpus_per_node)
        serial, _ = _point(base, routing, placement, skew, 0.0, dp_agreement(real, 2))
        points.append(serial)
        for n in inputs.ubatches:
            dp = dp_agreement(real, n)
            spec = replace(base, tokens=dp.padded_tokens, num_ubatches=n if dp.split else None)
            point, result = _point(spec, routing, placement, skew, serial.step_us, dp)
            points.append(replace(point, num_ubatches=n))
            results[(tokens, n)] = result
        if on_point is not None:
            on_point(f"{phase} EP {ep} {skew} {tokens} tokens")
    return points, _answer(phase, ep, skew, points), results


def _answer(phase: str, ep: int, skew: str, points: list[PlanPoint]) -> PhaseAnswer:
    best: dict[int, PlanPoint] = {}
    for p in points:
        if p.num_ubatches > 1 and (p.tokens not in best or p.gain_pct > best[p.tokens].gain_pct):
            best[p.tokens] = p
    tokens = sorted(best)
    pays_from = None
    for i, t in enumerate(tokens):
        if all(best[u].gain_pct > 0 for u in tokens[i:]):
            pays_from = t
            break
    top = max(best.values(), key=lambda p: p.gain_pct, default=None)
    at = best.get(pays_from) if pays_from is not None else None
    return PhaseAnswer(
        phase,
        ep,
        skew,
        pays_from,
        at.num_ubatches if at else None,
        top.gain_pct if top else 0.0,
        top.tokens if top else None,
    )


def run(args: argparse.Namespace) -> int:
    inputs = check_inputs(args)
    all_points, answers, shown = [], [], {}
    total = sum(len(inputs.tokens[p]) for p in inputs.phases) * len(inputs.eps) * len(inputs.skews)
    with progress_bar(total, "plan", quiet=args.json, unit="point") as bar:
        for phase, ep, skew in itertools.product(inputs.phases, inputs.eps, inputs.skews):
            points, answer, results = plan_phase(inputs, phase, ep, skew, advance(bar))
            all_points += points
            answers.append(answer)
            if ep == inputs.eps[0] and skew == inputs.skews[0]:
                shown[phase] = (answer, results)
    print(report(inputs, answers, all_points, shown, as_json=args.json))
    if args.out is not None:
        for path in write_outputs(args.out, all_points, shown):
            print(f"wrote {path}")
    return 0
