"""Benchmarks of the WorkspaceManager's hot path against the plain per-call algorithm: a fitting
get_simultaneous, the allocations a locked call makes (none), and growth."""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from scenarios.tools.bench.baselines import PerCallWorkspace, moe_request
from scenarios.tools.bench.figures import Figure, Stats, Target
from scenarios.tools.bench.registry import Plan, benchmark
from scenarios.tools.bench.timing import interleave, per_call_sampler
from workspace import WorkspaceManager
from workspace.testing import record_allocations


@contextmanager
def _quiet_fd2() -> Iterator[None]:
    """Kineto writes its profiler start/stop lines straight to file descriptor 2; keep them
    out of the table."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _storage_allocations(fn: Callable[[], Any]) -> int:
    """CPU allocator calls while fn runs, as the profiler's memory events count them."""
    # Imported here: the profiler is optional machinery (a torch build may lack it), and its
    # absence is reported in the figure rather than failing the whole bench at import.
    from torch.profiler import ProfilerActivity, profile

    with _quiet_fd2():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        events = prof.events()
    # An allocation inside an op is that op's self memory; one outside any op is "[memory]".
    return sum(
        1
        for e in events
        if e.self_cpu_memory_usage > 0 or (e.name == "[memory]" and e.cpu_memory_usage > 0)
    )


def get_simultaneous_samples(
    request: Sequence[tuple[tuple[int, ...], torch.dtype]],
    *,
    locked: bool,
    sample_ns: int,
    reps: int,
) -> dict[str, list[float]]:
    """ns per fitting get_simultaneous(*request) call on a fresh 2-slot CPU WorkspaceManager
    ("ours") and on PerCallWorkspace ("per_call"), both warmed up (grown; ours has cached the
    request's layout) and optionally locked, sampled interleaved `reps` times."""
    ours = WorkspaceManager("cpu", 2)
    plain = PerCallWorkspace("cpu", 2)
    ours.get_simultaneous(*request)  # warm-up: grow, and cache the signature
    plain.get_simultaneous(*request)
    if locked:
        ours.lock()
        plain.locked = True
    return interleave(
        {
            "ours": per_call_sampler(ours.get_simultaneous, request, sample_ns),
            "per_call": per_call_sampler(plain.get_simultaneous, request, sample_ns),
        },
        reps,
    )


@benchmark("workspace.get_simultaneous")
def bench_get_simultaneous(plan: Plan) -> list[Figure]:
    figures = []
    for n, locked in ((1, True), (3, True), (8, True), (3, False)):
        samples = get_simultaneous_samples(
            moe_request(n), locked=locked, sample_ns=plan.sample_ns, reps=plan.reps
        )
        state = "locked" if locked else "unlocked"
        figures.append(
            Figure(
                bench="workspace.get_simultaneous",
                name=f"workspace.get_simultaneous.{state}.n{n}",
                what=f"one get_simultaneous call, {n} tensor(s), {state}, fitting, from a "
                f"non-ubatch thread (slot 0), on CPU",
                unit="ns",
                ours=Stats.of(samples["ours"]),
                baseline=Stats.of(samples["per_call"]),
                baseline_what="PerCallWorkspace.get_simultaneous (the plain per-call algorithm)",
                ratio_def="baseline/ours",
                targets=[Target("ratio", ">=", 5.0, "speedup >= 5x")] if locked else [],
            )
        )
    return figures


@benchmark("workspace.allocations")
def bench_allocations(plan: Plan) -> list[Figure]:
    """Locked, fitting calls of 1, 3 and 8 tensors: no slot and no storage allocation."""
    requests = [moe_request(n) for n in (1, 3, 8)]
    ours = WorkspaceManager("cpu", 2)
    plain = PerCallWorkspace("cpu", 2)
    for request in requests:
        ours.get_simultaneous(*request)
        plain.get_simultaneous(*request)
    ours.lock()
    plain.locked = True
    calls = 200 if plan.quick else 2000

    def run(target: Any) -> Callable[[], None]:
        def loop() -> None:
            for _ in range(calls):
                for request in requests:
                    target.get_simultaneous(*request)

        return loop

    with record_allocations(ours) as count:
        run(ours)()
    figures = [
        Figure(
            bench="workspace.allocations",
            name="workspace.allocations.slot",
            what=f"slot allocations during {calls} x 3 locked fitting calls (1, 3 and 8 tensors)",
            unit="count",
            ours=Stats.exact(len(count)),
            targets=[Target("ours", "==", 0, "== 0")],
        )
    ]
    try:
        mine, theirs = _storage_allocations(run(ours)), _storage_allocations(run(plain))
        figures.append(
            Figure(
                bench="workspace.allocations",
                name="workspace.allocations.storage",
                what=f"CPU allocator calls (torch.profiler memory events) during {calls} x 3 "
                f"locked fitting calls",
                unit="count",
                ours=Stats.exact(mine),
                baseline=Stats.exact(theirs),
                baseline_what="the same calls on PerCallWorkspace",
                targets=[Target("ours", "==", 0, "== 0")],
            )
        )
    except Exception as exc:  # the profiler is optional machinery; say why it is missing
        figures.append(
            Figure(
                bench="workspace.allocations",
                name="workspace.allocations.storage",
                what="CPU allocator calls (torch.profiler memory events)",
                unit="count",
                ours=Stats.exact(math.nan),
                targets=[Target("ours", "==", 0, "== 0")],
                note=f"profiler unavailable: {type(exc).__name__}: {exc}",
            )
        )
    return figures


@benchmark("workspace.growth")
def bench_growth(plan: Plan) -> list[Figure]:
    """A chain of requests, each larger than the slots, on a fresh 2-slot workspace."""
    step = 64 * 1024
    sizes = [((step * (i + 2),), torch.uint8) for i in range(plan.growths)]
    allocations: list[int] = []

    def ours_sample() -> float:
        manager = WorkspaceManager("cpu", 2)
        manager.get_simultaneous(((step,), torch.uint8))
        with record_allocations(manager) as count:
            start = time.perf_counter_ns()
            for shape in sizes:
                manager.get_simultaneous(shape)
            elapsed = time.perf_counter_ns() - start
        allocations.append(len(count))
        return elapsed / len(sizes)

    def plain_sample() -> float:
        plain = PerCallWorkspace("cpu", 2)
        plain.get_simultaneous(((step,), torch.uint8))
        start = time.perf_counter_ns()
        for shape in sizes:
            plain.get_simultaneous(shape)
        return (time.perf_counter_ns() - start) / len(sizes)

    samples = interleave({"ours": ours_sample, "per_call": plain_sample}, plan.reps)
    per_growth = allocations[-1] / len(sizes)
    return [
        Figure(
            bench="workspace.growth",
            name="workspace.growth",
            what=f"one unlocked get_simultaneous that grows both slots of a 2-slot CPU "
            f"workspace (mean over a chain of {len(sizes)} growths, 128 KiB to "
            f"{sizes[-1][0][0] // 1024} KiB)",
            unit="ns",
            ours=Stats.of(samples["ours"]),
            baseline=Stats.of(samples["per_call"]),
            baseline_what="the same chain on PerCallWorkspace",
            extra={"slot_allocations_per_growth": per_growth},
            note="ours also validates the request, names the caller (a stack walk), keeps a "
            "weak reference per replaced buffer (orphan counting) and records the growth",
        )
    ]
