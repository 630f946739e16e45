"""What `dbo-sim plan` simulates, once `scenarios.tools.plan` has checked the command line.

For each phase (decode: DeepEP low-latency kernels, steps replayed as CUDA graphs; prefill:
DeepEP normal kernels, eager), each EP size, tokens-per-device count and skew, one rank's
step is recorded serially and with 2..4 ubatches and replayed for the whole EP group
(`dbo.sim.cluster`): the step time is the slowest rank's, so imbalance, stragglers, the SMs
DeepEP's normal kernels hold and DP padding all count. The gain of N ubatches is serial step /
N-ubatch step - 1. DBO "pays from" the smallest token count from which the best gain stays
positive over the rest of the range, among the points that fit in GPU memory
(`scenarios.tools.plan_memory`); that count is printed as the engine flags to set. When it
lies at the range's edge the range grows until it does not (`scenarios.tools.plan_range`),
and each answer carries the replay's known error near it (`scenarios.tools.plan_errors`).

The steps run as one task per recording, replayed for every skew that shares it, across a
process pool (`scenarios.tools.plan_pool`), each recording kept on disk for the next run
(`scenarios.tools.plan_cache`).

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
from tqdm import tqdm

from dbo.sim.hardware import HardwareProfile, profile_from_name
from dbo.sim.routing import Placement, Routing
from scenarios.lib.cluster_step import (
    DPAgreement,
    StepSpec,
    dp_agreement,
    moe_layers,
    placement_from_spec,
    routing_from_spec,
)
from scenarios.lib.progress import advance, progress_bar
from scenarios.lib.usage import UsageError, one_line
from scenarios.model import ModelConfig
from scenarios.model_presets import PRESETS, preset, torch_dtypes
from scenarios.tools.plan_args import PlanArgs
from scenarios.tools.plan_cache import recording
from scenarios.tools.plan_errors import error_bars
from scenarios.tools.plan_memory import MemoryNeed, memory_need
from scenarios.tools.plan_output import PhaseAnswer, PlanPoint, report, setup_line, write_outputs
from scenarios.tools.plan_pool import GroupStep, StepTask, replay, run_tasks
from scenarios.tools.plan_range import RangeState, next_tokens, range_note

__all__ = [
    "Curve",
    "PlanInputs",
    "PointSpec",
    "answer",
    "check_inputs",
    "plan_phase",
    "point_specs",
    "run_plan",
    "simulate_points",
]


@dataclass(frozen=True)
class PlanInputs:
    """The command line, checked against the model: everything `plan_phase` reads, each
    from one place."""

    config: ModelConfig
    profile: HardwareProfile  # its gpus_per_node is --gpus-per-node: the group's one source
    eps: list[int]
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

    @property
    def gpus_per_node(self) -> int:
        return self.profile.gpus_per_node


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
    if parsed.gpus_per_node is not None:
        profile = replace(profile, gpus_per_node=parsed.gpus_per_node)
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
    """Record each phase's first serial step (through the disk cache, and in memory before
    the pool forks: the sweep replays it, not records it again) so that a model
    torch cannot run on meta tensors (an activation dtype its grouped GEMM lacks) is refused
    in one line, not with a traceback after the first points."""
    ep = parsed.eps[0]
    shaped = config.with_(ep_size=ep, num_experts=config.num_experts + parsed.redundant)
    for phase in parsed.phases:
        spec = StepSpec(shaped, phase, parsed.tokens[phase][0], None, profile)
        try:
            recording(spec)
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


@dataclass(frozen=True)
class Progress:
    """The bar's two moves: more steps to run (a range that grew), one step done."""

    add: Callable[[int], None]
    done: Callable[[str], None]

    @staticmethod
    def of(bar: tqdm) -> Progress:
        def add(n: int) -> None:
            bar.total = (bar.total or 0) + n
            bar.refresh()

        return Progress(add, advance(bar))


@dataclass(frozen=True)
class Curve:
    """One EP size and skew of a phase: the group every token count is replayed for."""

    ep: int
    skew: str
    routing: Routing
    placement: Placement


@dataclass(frozen=True)
class PointSpec:
    """One step of a token count: serial (n = 1) or n ubatches as the DP ranks agree."""

    num_ubatches: int
    spec: StepSpec
    dp: DPAgreement


def _curves(inputs: PlanInputs, parsed: PlanArgs) -> list[Curve]:
    curves = []
    for ep, skew in itertools.product(inputs.eps, inputs.skews):
        config = inputs.config.with_(ep_size=ep)
        routing = routing_from_spec(skew, config, seed=parsed.seed, histogram=parsed.histogram)
        placement = placement_from_spec(
            inputs.placement if inputs.redundant else "contiguous", config, routing
        )
        curves.append(Curve(ep, skew, routing, placement))
    return curves


def point_specs(
    inputs: PlanInputs, parsed: PlanArgs, phase: str, ep: int, tokens: int
) -> list[PointSpec]:
    """The serial step and each ubatch count's at `tokens` per device (a step the DP ranks
    agreed not to split runs serially)."""
    config = inputs.config.with_(ep_size=ep)
    record_config = config.with_(num_experts=config.num_experts + inputs.redundant)
    real = _dp_tokens(tokens, ep if parsed.dp is None else parsed.dp, parsed.dp_spread, parsed.seed)
    base = StepSpec(record_config, phase, tokens, None, inputs.profile)
    out = [PointSpec(1, base, dp_agreement(real, 2))]
    for n in inputs.ubatches:
        dp = dp_agreement(real, n)
        spec = replace(base, tokens=dp.padded_tokens, num_ubatches=n if dp.split else None)
        out.append(PointSpec(n, spec, dp))
    return out


def _plan_point(
    curve: Curve, p: PointSpec, step: GroupStep, serial_us: float, memory: MemoryNeed
) -> PlanPoint:
    """One replayed step; a step the DP ranks agreed not to split gains nothing."""
    split = p.spec.num_ubatches is not None
    gain = (serial_us / step.step_us - 1.0) * 100.0 if split and p.num_ubatches > 1 else 0.0
    return PlanPoint(
        p.spec.phase,
        curve.ep,
        curve.skew,
        p.dp.real_tokens[0],
        p.num_ubatches,
        step.step_us,
        gain,
        step.slowest_rank,
        step.peer_wait_us,
        step.exposed_comm_us,
        p.dp.padded_tokens,
        p.dp.padding_share,
        p.dp.split,
        memory.fits,
        round(memory.total_gb, 2),
    )


def simulate_points(
    inputs: PlanInputs,
    parsed: PlanArgs,
    phase: str,
    wanted: dict[int, list[int]],
    curves: list[Curve],
    progress: Progress | None = None,
) -> dict[tuple[int, int], list[PlanPoint]]:
    """The points of every (curve index, token count) in `wanted`: one task per recording,
    replayed for each curve that needs it, across the process pool."""
    users: dict[StepSpec, list[int]] = {}
    specs = {}
    for i, counts in wanted.items():
        for t in counts:
            specs[(i, t)] = point_specs(inputs, parsed, phase, curves[i].ep, t)
            for p in specs[(i, t)]:
                if i not in users.setdefault(p.spec, []):
                    users[p.spec].append(i)
    tasks = [
        StepTask(s, tuple((curves[i].routing, curves[i].placement) for i in u))
        for s, u in users.items()
    ]
    if progress is not None:
        progress.add(len(tasks))
    steps = run_tasks(tasks, parsed.workers, progress.done if progress else None)
    step_of = {(t.spec, i): g for t, gs in zip(tasks, steps) for i, g in zip(users[t.spec], gs)}
    points = {}
    for (i, t), ps in specs.items():
        memory = memory_need(
            inputs.config,
            inputs.profile,
            phase,
            curves[i].ep,
            t,
            redundant=inputs.redundant,
            context=ps[0].spec.context,
        )
        serial_us = step_of[(ps[0].spec, i)].step_us
        points[(i, t)] = [
            _plan_point(curves[i], p, step_of[(p.spec, i)], serial_us, memory) for p in ps
        ]
    return points


def answer(phase: str, ep: int, skew: str, points: list[PlanPoint]) -> PhaseAnswer:
    """Where DBO pays, over the points that fit in memory: the smallest count from which the
    best gain stays positive, its ubatch count, and the best gain."""
    best: dict[int, PlanPoint] = {}
    for p in points:
        if p.num_ubatches > 1 and p.fits:
            if p.tokens not in best or p.gain_pct > best[p.tokens].gain_pct:
                best[p.tokens] = p
    tokens = sorted(best)
    pays_from = next(
        (t for i, t in enumerate(tokens) if all(best[u].gain_pct > 0 for u in tokens[i:])), None
    )
    top = max(best.values(), key=lambda p: p.gain_pct, default=None)
    at = best.get(pays_from) if pays_from is not None else None
    unfit = sorted({p.tokens for p in points if not p.fits})
    return PhaseAnswer(
        phase,
        ep,
        skew,
        pays_from,
        at.num_ubatches if at else None,
        top.gain_pct if top else 0.0,
        top.tokens if top else None,
        unfit_tokens=tuple(unfit),
    )


def _range_state(given: list[int], points: list[PlanPoint], a: PhaseAnswer) -> RangeState:
    simulated = sorted({p.tokens for p in points})
    last_fits = all(p.fits for p in points if p.tokens == simulated[-1])
    return RangeState(tuple(given), tuple(simulated), a.pays_from, last_fits)


def plan_phase(
    inputs: PlanInputs,
    parsed: PlanArgs,
    phase: str,
    curves: list[Curve],
    progress: Progress | None = None,
) -> tuple[list[list[PlanPoint]], list[PhaseAnswer]]:
    """Every curve's points and answer for one phase. The given token counts first; then,
    while a curve's crossover lies at its range's edge, the next halving or doubling
    (`scenarios.tools.plan_range`), all curves' new counts in one round."""
    given = inputs.tokens[phase]
    got: dict[int, dict[int, list[PlanPoint]]] = {i: {} for i in range(len(curves))}
    wanted = {i: list(given) for i in range(len(curves))}
    while wanted:
        for (i, t), points in simulate_points(
            inputs, parsed, phase, wanted, curves, progress
        ).items():
            got[i][t] = points
        wanted = {}
        for i, c in enumerate(curves):
            points = [p for t in sorted(got[i]) for p in got[i][t]]
            state = _range_state(given, points, answer(phase, c.ep, c.skew, points))
            more = next_tokens(state)
            if more is not None and more not in got[i]:
                wanted[i] = [more]
    all_points, answers = [], []
    for i, c in enumerate(curves):
        points = [p for t in sorted(got[i]) for p in got[i][t]]
        a = answer(phase, c.ep, c.skew, points)
        note = range_note(_range_state(given, points, a))
        answers.append(replace(a, range_note=note, error_bars=tuple(error_bars(phase, c.ep))))
        all_points.append(points)
    return all_points, answers


def _shown(inputs: PlanInputs, parsed: PlanArgs, a: PhaseAnswer, curve: Curve):
    """The group replayed at the answer's point, for its critical path, gating and traces."""
    tokens = a.pays_from or a.best_tokens
    if tokens is None:
        return {}
    n = a.best_ubatches or inputs.ubatches[0]
    ps = {p.num_ubatches: p for p in point_specs(inputs, parsed, a.phase, a.ep, tokens)}
    p = ps.get(n) or ps[1]
    return {(tokens, n): replay(p.spec, curve.routing, curve.placement)}


def run_plan(parsed: PlanArgs) -> int:
    """Simulate every point and print the answer; with --json one JSON document on stdout
    and every other line (progress, the files written) on stderr."""
    inputs = check_inputs(parsed)
    curves = _curves(inputs, parsed)
    all_points, answers, shown = [], [], {}
    with progress_bar(None, "plan", quiet=parsed.json, unit="step") as bar:
        for phase in inputs.phases:
            points, phase_answers = plan_phase(inputs, parsed, phase, curves, Progress.of(bar))
            all_points += [p for ps in points for p in ps]
            answers += phase_answers
            main = phase_answers[0]
            # The answer's group replayed once more: text mode prints its critical path and
            # gating, --out writes its traces; --json alone needs neither.
            needed = not parsed.json or parsed.out is not None
            shown[phase] = (main, _shown(inputs, parsed, main, curves[0]) if needed else {})
    print(report(inputs, answers, all_points, shown, as_json=parsed.json))
    if parsed.out is not None:
        for path in write_outputs(parsed.out, all_points, shown, setup_line(inputs)):
            print(f"wrote {path}", file=sys.stderr if parsed.json else sys.stdout)
    return 0
