"""How costs and sizes grow: get_simultaneous against tensor count, step time against ubatch
and layer count, slot bytes against N x the largest request, orphaned bytes after a growth."""

from __future__ import annotations

from typing import Any

import torch

import dbo
from dbo.sim import SimDevice
from dbo.sim.options import SimOptions
from dbo.ubatching import dbo_yield
from scenarios.model import Batch, MoEModel, preset
from scenarios.steps import prepare
from scenarios.tools.bench.baselines import NullDevice, moe_request, request_bytes
from scenarios.tools.bench.figures import Figure, Stats, Target
from scenarios.tools.bench.registry import Plan, benchmark
from scenarios.tools.bench.simulator import bench_ubatched_step, step_sampler
from scenarios.tools.bench.timing import interleave
from scenarios.tools.bench.workspace import get_simultaneous_samples
from workspace import WorkspaceManager, reset_workspace_manager


@benchmark("scaling.get_simultaneous")
def bench_scaling_get_simultaneous(plan: Plan) -> list[Figure]:
    figures = []
    for n in plan.tensor_counts:
        samples = get_simultaneous_samples(
            moe_request(n), locked=True, sample_ns=plan.sample_ns // 2, reps=max(3, plan.reps // 2)
        )
        stats = Stats.of(samples["ours"])
        figures.append(
            Figure(
                bench="scaling.get_simultaneous",
                name=f"scaling.get_simultaneous.n{n}",
                what=f"one locked fitting get_simultaneous call with {n} tensor(s)",
                unit="ns",
                ours=stats,
                baseline=Stats.of(samples["per_call"]),
                baseline_what="PerCallWorkspace.get_simultaneous",
                ratio_def="baseline/ours",
                extra={"ours_ns_per_tensor": stats.median / n},
            )
        )
    return figures


@benchmark("scaling: ubatches, layers", "scaling.ubatches", "scaling.layers")
def bench_scaling_steps(plan: Plan) -> list[Figure]:
    mode = "ll"
    batch = Batch.decode(16, 8)
    figures = []
    tiny = preset("tiny")
    model = MoEModel(tiny, batch)
    x = model.inputs()
    device = SimDevice(SimOptions(check_races=False))
    steps = {str(n): bench_ubatched_step(model, x, device, n, mode) for n in plan.ubatch_counts}
    prepare(torch.device("cpu"), max(plan.ubatch_counts), list(steps.values()))
    samples = interleave({k: step_sampler(s, device) for k, s in steps.items()}, plan.step_reps)
    first = str(plan.ubatch_counts[0])
    for n in plan.ubatch_counts:
        figures.append(
            Figure(
                bench="scaling.ubatches",
                name=f"scaling.ubatches.n{n}",
                what=f"one step of preset('tiny') ({tiny.num_layers} layers, decode 16 tokens, "
                f"mode {mode!r}) in {n} ubatches on SimDevice(check_races=False) (wall)",
                unit="ms",
                ours=Stats.of(samples[str(n)]),
                baseline=Stats.of(samples[first]),
                baseline_what=f"the same step in {first} ubatches",
            )
        )
    steps = {}
    for layers in plan.layer_counts:
        model = MoEModel(preset("tiny", num_layers=layers), batch)
        steps[str(layers)] = bench_ubatched_step(model, model.inputs(), device, 2, mode)
    prepare(torch.device("cpu"), 2, list(steps.values()))
    samples = interleave({k: step_sampler(s, device) for k, s in steps.items()}, plan.step_reps)
    first = str(plan.layer_counts[0])
    for layers in plan.layer_counts:
        stats = Stats.of(samples[str(layers)])
        figures.append(
            Figure(
                bench="scaling.layers",
                name=f"scaling.layers.l{layers}",
                what=f"one step of preset('tiny') with {layers} layer(s) (decode 16 tokens, mode "
                f"{mode!r}) in 2 ubatches on SimDevice(check_races=False) (wall)",
                unit="ms",
                ours=stats,
                baseline=Stats.of(samples[first]),
                baseline_what=f"the same step with {first} layer(s)",
                extra={"ms_per_layer": stats.median / layers},
            )
        )
    reset_workspace_manager()
    return figures


@benchmark("scaling.workspace_bytes")
def bench_workspace_bytes(plan: Plan) -> list[Figure]:
    """Warm up N ubatch threads on mixed requests; the slots must total exactly N x R."""
    figures = []
    for n in plan.byte_ubatch_counts:
        manager = WorkspaceManager("cpu", n)
        # Each ubatch asks for a different mix; only the last one sees the largest request,
        # so slots it never touched must still end up its size (synchronous growth).
        plans = [[moe_request(1), moe_request(3 + i), moe_request(2)] for i in range(n)]
        plans[-1][1] = moe_request(12)
        largest = max(request_bytes(r) for p in plans for r in p)

        def body(requests: list[Any], manager: WorkspaceManager = manager) -> None:
            for request in requests:
                manager.get_simultaneous(*request)
                dbo_yield()

        dbo.run_ubatches(body, plans, device=NullDevice(), timeout=60.0)
        total = sum(manager.slot_capacities())
        figures.append(
            Figure(
                bench="scaling.workspace_bytes",
                name=f"scaling.workspace_bytes.n{n}",
                what=f"sum of slot bytes after {n} ubatch threads warmed up (largest request "
                f"R = {largest} bytes, aligned, seen by ubatch {n - 1} only)",
                unit="bytes",
                ours=Stats.exact(total),
                baseline=Stats.exact(n * largest),
                baseline_what="N x R",
                targets=[Target("ratio", "==", 1.0, "== N x R")],
                extra={"slot_capacities": manager.slot_capacities()},
            )
        )
    return figures


@benchmark("scaling.orphaned_bytes")
def bench_orphans(plan: Plan) -> list[Figure]:
    """Hold a view into slot 0, force a growth: the old slot-0 buffer must be counted."""
    manager = WorkspaceManager("cpu", 2)
    held = manager.get_simultaneous(((256 * 1024,), torch.uint8))
    old_size = manager.capacity
    manager.get_simultaneous(((1024 * 1024,), torch.uint8))
    orphaned = manager.orphaned_bytes()
    stats = manager.stats()
    del held
    return [
        Figure(
            bench="scaling.orphaned_bytes",
            name="scaling.orphaned_bytes",
            what="orphaned_bytes() after a growth of a 2-slot workspace while a view into "
            "slot 0's old buffer is held",
            unit="bytes",
            ours=Stats.exact(orphaned),
            baseline=Stats.exact(old_size),
            baseline_what="the old slot size",
            targets=[Target("ratio", "==", 1.0, "== old slot")],
            extra={
                "orphaning_growths": stats.orphaning_growths,
                "peak_bytes": stats.peak_bytes,
                "orphaned_after_release": manager.orphaned_bytes(),
            },
        )
    ]
