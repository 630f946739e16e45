"""Virtual ranks: how long replaying an EP group takes, against recording one rank's step.

The replay (`dbo.sim.cluster`) must stay pure scheduling: a DeepSeek-V3 61-layer decode step
at EP 256 with 2 ubatches and a prefill step at EP 32 (16K tokens per GPU) each within 2 s of
wall time, and its cost per added rank must grow at most linearly from EP 8 to EP 256. The
replay-only figures take as baseline recording the same rank's step once through torch
interception, timed in the same run. Since `plan` pays both for every point it has not seen
(a recording per token and ubatch count, then the group's replay), each setup also gets an
end-to-end figure: one rank recorded uncached plus the whole group's replay of that fresh
recording, against the same 2 s target, with the replay alone as its baseline.
"""

from __future__ import annotations

from dataclasses import replace

from dbo.sim.cluster import simulate_cluster
from dbo.sim.hardware import H800
from dbo.sim.routing import contiguous, zipf
from scenarios.lib.cluster_step import StepSpec, moe_layers, record_step
from scenarios.model import preset
from scenarios.tools.bench.figures import Figure, Stats, Target
from scenarios.tools.bench.registry import Plan, benchmark
from scenarios.tools.bench.timing import interleave, timed_ms

WALL_TARGET_MS = 2000.0
EP_SIZES = (8, 32, 128, 256)


def _spec(phase: str, ep: int, tokens: int, plan: Plan) -> StepSpec:
    config = preset("deepseek-v3", ep_size=ep)
    if plan.quick:
        config = config.with_(num_layers=config.num_dense_layers + 8)
    return StepSpec(config, phase, tokens, 2, H800)


def _samplers(spec: StepSpec) -> dict:
    program = record_step(spec)
    c = spec.config
    routing = zipf(moe_layers(c), c.num_experts, 0.2, top_k=c.top_k)
    placement = contiguous(c.num_experts, c.ep_size)

    def record() -> None:
        record_step.__wrapped__(spec)  # uncached: the interception itself

    def record_and_replay() -> None:
        simulate_cluster(record_step.__wrapped__(spec), routing, placement)

    return {
        "replay": timed_ms(lambda: simulate_cluster(program, routing, placement)),
        "record": timed_ms(record),
        "end_to_end": timed_ms(record_and_replay),
    }


def _wall_figures(name: str, what: str, spec: StepSpec, plan: Plan) -> list[Figure]:
    samples = interleave(_samplers(spec), max(3, plan.step_reps // 3))
    target = [Target("ours", "<=", WALL_TARGET_MS, f"<= {WALL_TARGET_MS:g} ms wall")]
    extra = {"ranks": spec.config.ep_size, "ops": record_step(spec).num_ops}
    return [
        Figure(
            bench="cluster.wall",
            name=name,
            what=f"replay of {what}",
            unit="ms",
            ours=Stats.of(samples["replay"]),
            baseline=Stats.of(samples["record"]),
            baseline_what="recording one rank's step through torch interception (uncached)",
            ratio_def="ours/baseline",
            targets=target,
            extra=extra,
        ),
        Figure(
            bench="cluster.wall",
            name=f"{name}.record_replay",
            what=f"one rank recorded through interception (uncached) plus the whole group's "
            f"replay, as plan pays per point: {what}",
            unit="ms",
            ours=Stats.of(samples["end_to_end"]),
            baseline=Stats.of(samples["replay"]),
            baseline_what="the replay alone (recording cached)",
            ratio_def="ours/baseline",
            targets=target,
            extra=extra,
        ),
    ]


@benchmark("cluster: EP 256 decode, EP 32 prefill", "cluster.wall")
def bench_cluster_wall(plan: Plan) -> list[Figure]:
    decode = _spec("decode", 256, 128, plan)
    prefill = _spec("prefill", 32, 16384, plan)
    return _wall_figures(
        "cluster.ep256_decode",
        f"a DeepSeek-V3 {decode.config.num_layers}-layer decode step, EP 256, 2 ubatches, "
        "128 tokens per GPU, zipf 0.2 routing",
        decode,
        plan,
    ) + _wall_figures(
        "cluster.ep32_prefill",
        f"a DeepSeek-V3 {prefill.config.num_layers}-layer prefill step, EP 32, 2 ubatches, "
        "16K tokens per GPU, zipf 0.2 routing",
        prefill,
        plan,
    )


@benchmark("cluster: cost per rank", "cluster.per_rank")
def bench_cluster_per_rank(plan: Plan) -> list[Figure]:
    """Replay time per rank at EP 256 over the same at EP 8 (<= 1: at most linear growth)."""
    per_rank: dict[int, list[float]] = {}
    base = _spec("decode", EP_SIZES[0], 128, plan)
    samplers = {}
    for ep in EP_SIZES:
        spec = replace(base, config=base.config.with_(ep_size=ep))
        program = record_step(spec)
        c = spec.config
        routing = zipf(moe_layers(c), c.num_experts, 0.2, top_k=c.top_k)
        placement = contiguous(c.num_experts, ep)
        samplers[ep] = timed_ms(
            lambda p=program, r=routing, pl=placement: simulate_cluster(p, r, pl)
        )
    samples = interleave(samplers, max(3, plan.step_reps // 3))
    for ep, values in samples.items():
        per_rank[ep] = [v / ep for v in values]
    first, last = EP_SIZES[0], EP_SIZES[-1]
    return [
        Figure(
            bench="cluster.per_rank",
            name="cluster.per_rank.ep256_over_ep8",
            what=f"replay wall time per rank at EP {last} (decode, 2 ubatches)",
            unit="ms",
            ours=Stats.of(per_rank[last]),
            baseline=Stats.of(per_rank[first]),
            baseline_what=f"the same per rank at EP {first}",
            ratio_def="ours/baseline",
            targets=[Target("ratio", "<=", 1.0, "<= 1: at most linear in ranks")],
            extra={f"ep{ep}_ms": Stats.of(v).median for ep, v in samples.items()},
        )
    ]
