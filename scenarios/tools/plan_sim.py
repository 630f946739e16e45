"""What `dbo-sim plan` simulates, once `scenarios.tools.plan` has checked the command line.

For each phase (decode: DeepEP low-latency kernels, steps replayed as CUDA graphs; prefill:
DeepEP normal kernels, eager), each tokens-per-device point and each skew, one rank's step is
recorded serially and with 2..4 ubatches and replayed for the whole EP group
(`scenarios.lib.cluster_step`, `dbo.sim.cluster`): the step time is the slowest rank's, so
imbalance, stragglers, the SMs DeepEP's normal kernels hold and DP padding all count. The
gain of N ubatches is serial step / N-ubatch step - 1. DBO "pays from" the smallest token
count from which the best gain stays positive over the rest of the range; that count is
printed as the engine flags to set.

Before the first step, the checks that need the model: the preset, the profile, the
configuration as a whole, the EP sizes against the experts, the histogram against the layers.

Out (`--out DIR`): `plan.csv` (one row per phase, EP, skew, tokens, ubatch count),
`plan.png` (gain against tokens per device, a line per EP size and skew), and the replayed
EP group at the answer's point as `plan.<phase>.trace.json` / `plan.<phase>.timeline.png`.
"""

from __future__ import annotations

import itertools
import sys
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
    moe_layers,
    placement_from_spec,
    record_step,
    routing_from_spec,
)
from scenarios.lib.progress import advance, progress_bar
from scenarios.lib.usage import UsageError, one_line
from scenarios.model import ModelConfig
from scenarios.model_presets import PRESETS, preset, torch_dtypes
from scenarios.tools.plan_args import PlanArgs
from scenarios.tools.plan_output import PhaseAnswer, PlanPoint, report, write_outputs

__all__ = ["PlanInputs", "check_inputs", "plan_phase", "run_plan"]


@dataclass(frozen=True)
class PlanInputs:
    """The command line, checked against the model: everything `plan_phase` reads, each
    from one place."""

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


def _config(parsed: PlanArgs) -> ModelConfig:
    if parsed.preset not in PRESETS:
        raise UsageError(
            f"unknown preset {parsed.preset!r}; choose one of {', '.join(sorted(PRESETS))}"
        )
    try:
        config = preset(parsed.preset, **torch_dtypes(parsed.config_changes))
    except ValueError as error:  # the fields together (top_k against num_experts, ...)
        raise UsageError(f"--config: {error}") from None
    if moe_layers(config) < 2:
        raise UsageError(
            f"--config: {config.name} has {moe_layers(config)} MoE layer(s) (num_layers - "
            f"num_dense_layers); plan needs 2 or more to find the repeating layer"
        )
    return config


def check_inputs(parsed: PlanArgs) -> PlanInputs:
    """What needs the model, checked before any step is simulated: the preset and the
    configuration as a whole, the profile, the EP sizes against the experts, the routing."""
    config = _config(parsed)
    try:
        profile = profile_from_name(parsed.profile)
    except ValueError as error:
        raise UsageError(str(error)) from None
    experts = config.num_experts + parsed.redundant
    for ep in parsed.eps:
        if experts % ep:
            raise UsageError(
                f"--ep {ep} does not divide the {experts} experts of {config.name}; choose an "
                f"EP size that does (or --placement eplb:N)"
            )
    for s in parsed.skews:
        try:
            routing_from_spec(s, config, seed=parsed.seed, histogram=parsed.histogram)
        except ValueError as error:
            raise UsageError(f"--{'histogram' if parsed.histogram else 'skew'}: {error}") from None
    _check_recordable(config, profile, parsed)
    return PlanInputs(
        config,
        profile,
        parsed.eps,
        parsed.gpus_per_node,
        parsed.phases,
        parsed.tokens,
        parsed.skews,
        parsed.ubatches,
        parsed.placement,
        parsed.redundant,
        seed=parsed.seed,
        histogram=parsed.histogram,
        dp=parsed.dp,
        dp_spread=parsed.dp_spread,
    )


def _check_recordable(config: ModelConfig, profile: HardwareProfile, parsed: PlanArgs) -> None:
    """Record each phase's first serial step (cached: the sweep replays it) so that a model
    torch cannot run on meta tensors (an activation dtype its grouped GEMM lacks) is refused
    in one line, not with a traceback after the first points."""
    ep = parsed.eps[0]
    shaped = config.with_(ep_size=ep, num_experts=config.num_experts + parsed.redundant)
    for phase in parsed.phases:
        spec = StepSpec(shaped, phase, parsed.tokens[phase][0], None, profile, parsed.gpus_per_node)
        try:
            record_step(spec)
        except (RuntimeError, NotImplementedError) as error:
            dtype = str(config.dtype).removeprefix("torch.")
            raise UsageError(
                f"{config.name} with dtype {dtype} cannot be recorded on meta tensors, as plan "
                f'records a step ({one_line(str(error), 160)}); give a --config with "dtype": '
                f'"bfloat16"'
            ) from None


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


def run_plan(parsed: PlanArgs) -> int:
    """Simulate every point and print the answer; with --json one JSON document on stdout
    and every other line (progress, the files written) on stderr."""
    inputs = check_inputs(parsed)
    all_points, answers, shown = [], [], {}
    total = sum(len(inputs.tokens[p]) for p in inputs.phases) * len(inputs.eps) * len(inputs.skews)
    with progress_bar(total, "plan", quiet=parsed.json, unit="point") as bar:
        for phase, ep, skew in itertools.product(inputs.phases, inputs.eps, inputs.skews):
            points, answer, results = plan_phase(inputs, phase, ep, skew, advance(bar))
            all_points += points
            answers.append(answer)
            if ep == inputs.eps[0] and skew == inputs.skews[0]:
                shown[phase] = (answer, results)
    print(report(inputs, answers, all_points, shown, as_json=parsed.json))
    if parsed.out is not None:
        for path in write_outputs(parsed.out, all_points, shown):
            print(f"wrote {path}", file=sys.stderr if parsed.json else sys.stdout)
    return 0
