"""Benchmarks of the simulator: interception cost per small op, a tiny real-valued step, and
a DeepSeek-V3-size decode step on `meta`, each against the same work with no simulator."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import dbo
from dbo.sim import SimDevice
from dbo.sim.options import SimOptions
from dbo.streams import Device
from scenarios.model import Batch, MoEModel, preset
from scenarios.steps import Step, prepare, serial_step, ubatched_step
from scenarios.tools.bench.baselines import NullDevice
from scenarios.tools.bench.figures import Figure, Stats, Target
from scenarios.tools.bench.registry import Plan, benchmark
from scenarios.tools.bench.timing import interleave, timed_ms
from workspace import reset_workspace_manager


@benchmark("sim.intercept")
def bench_intercept(plan: Plan) -> list[Figure]:
    """Small CPU ops (16 floats: a mul that allocates, an in-place add) per op."""
    n = plan.small_ops
    x = torch.ones(16)
    w = torch.full((16,), 0.5)

    def ops() -> None:
        for _ in range(n):
            y = torch.mul(x, w)
            x.add_(y)
            x.mul_(0.25)

    def sampler(device: SimDevice | None) -> Callable[[], float]:
        def sample() -> float:
            if device is None:
                start = time.perf_counter_ns()
                ops()
                return (time.perf_counter_ns() - start) / (3 * n)
            device.reset()
            with dbo.use_device(device), device.thread_scope(None):
                start = time.perf_counter_ns()
                ops()
                elapsed = time.perf_counter_ns() - start
            return elapsed / (3 * n)

        return sample

    plain = sampler(None)
    plain()  # warm-up: the first ops pay one-time dispatch setup
    fast, checked = (
        SimDevice(SimOptions(check_races=False)),
        SimDevice(SimOptions(check_races=True)),
    )
    samples = interleave(
        {"plain": plain, "sim": sampler(fast), "races": sampler(checked)}, plan.reps
    )
    base = Stats.of(samples["plain"])
    figures = []
    for key, label, races in (
        ("sim", "sim.intercept.small_op", False),
        ("races", "sim.intercept.small_op.races", True),
    ):
        stats = Stats.of(samples[key])
        figures.append(
            Figure(
                bench="sim.intercept",
                name=label,
                what=f"one small op (16 floats; mul, add_, mul_) under thread_scope(None) of "
                f"SimDevice(check_races={races}), {3 * n} ops per sample",
                unit="ns",
                ours=stats,
                baseline=base,
                baseline_what="the same ops with no interception",
                extra={
                    "intercepted_ops_per_s": 1e9 / stats.median,
                    "plain_ops_per_s": 1e9 / base.median,
                },
            )
        )
    return figures


# Bench steps get a generous timeout: a shared machine may stall a DeepSeek-size meta step.
_STEP_TIMEOUT_S = 120.0


def bench_ubatched_step(
    model: MoEModel, x: torch.Tensor, device: Device, n: int, mode: str
) -> Step:
    """The model's step split over `n` ubatches, with the bench's thread timeout."""
    return ubatched_step(model, x, device, mode=mode, num_ubatches=n, timeout_s=_STEP_TIMEOUT_S)


def step_sampler(step: Callable[[], Any], device: Device) -> Callable[[], float]:
    """ms for one step; a simulated device is reset first (untimed), so its timeline and
    race history do not grow from sample to sample."""
    return timed_ms(step, device.reset if isinstance(device, SimDevice) else None)


@benchmark("sim.tiny_step")
def bench_tiny_step(plan: Plan) -> list[Figure]:
    config = preset("tiny")
    model = MoEModel(config, Batch.decode(16, 8))
    x = model.inputs()
    mode = "ll"
    devices: dict[str, Device] = {
        "plain": NullDevice(),
        "sim": SimDevice(SimOptions(check_races=False)),
        "races": SimDevice(SimOptions(check_races=True)),
    }
    steps = {
        key: serial_step(model, x, device, mode=mode, thread_scope=key != "plain")
        for key, device in devices.items()
    }
    prepare(torch.device("cpu"), 1, list(steps.values()))
    samples = interleave(
        {key: step_sampler(step, devices[key]) for key, step in steps.items()}, plan.step_reps
    )
    reset_workspace_manager()
    base = Stats.of(samples["plain"])
    return [
        Figure(
            bench="sim.tiny_step",
            name=name,
            what=f"one serial step of preset('tiny') ({config.num_layers} layers, float64 on "
            f"CPU, decode 16 tokens, mode {mode!r}) on SimDevice(check_races={races})",
            unit="ms",
            ours=Stats.of(samples[key]),
            baseline=base,
            baseline_what="the same step with no interception (dbo helpers no-ops)",
        )
        for key, name, races in (
            ("sim", "sim.tiny_step", False),
            ("races", "sim.tiny_step.races", True),
        )
    ]


@benchmark("sim.deepseek_v3_step")
def bench_deepseek(plan: Plan) -> list[Figure]:
    layers = plan.deepseek_layers
    config = preset("deepseek-v3", num_layers=layers)
    batch = Batch.decode(256, 128)
    model = MoEModel(config, batch)
    x = model.inputs()
    mode = "ll"
    sim = SimDevice(SimOptions(tensor_device="meta"))
    null = NullDevice("meta")
    variants: dict[str, tuple[Callable[[], Any], Device]] = {
        "dbo_sim": (bench_ubatched_step(model, x, sim, 2, mode), sim),
        "plain": (serial_step(model, x, null, mode=mode, thread_scope=False), null),
        "dbo_null": (bench_ubatched_step(model, x, null, 2, mode), null),
        "serial_sim": (serial_step(model, x, sim, mode=mode), sim),
    }
    prepare(torch.device("meta"), 2, [step for step, _ in variants.values()])
    samples = interleave(
        {key: step_sampler(step, device) for key, (step, device) in variants.items()},
        max(3, plan.step_reps - 2),
    )
    reset_workspace_manager()
    ours, base = Stats.of(samples["dbo_sim"]), Stats.of(samples["plain"])
    return [
        Figure(
            bench="sim.deepseek_v3_step",
            name="sim.deepseek_v3_step",
            what=f"one DeepSeek-V3-size decode step on meta ({layers} layers, 256 tokens, "
            f"context 128, mode {mode!r}), 2 ubatches in dbo.run_ubatches on SimDevice (wall)",
            unit="ms",
            ours=ours,
            baseline=base,
            baseline_what="the same model's serial forward on meta, no simulator, no threads",
            targets=[Target("ours", "<=", 2000.0, "<= 2 s"), Target("ratio", "<=", 5.0, "<= 5x")],
            extra={
                "layers": layers,
                "dbo_without_sim_ms": statistics.median(samples["dbo_null"]),
                "serial_on_sim_ms": statistics.median(samples["serial_sim"]),
            },
            note="" if layers == 61 else f"reduced to {layers} layers (--quick)",
        )
    ]
