"""The baton benchmark: one pass between two ubatch threads calling `dbo_yield()`, against
vLLM's `threading.Event` ring and a bare `threading.Lock` ping-pong (the floor)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import dbo
from dbo.sim import SimDevice
from dbo.streams import Device
from dbo.ubatching import dbo_current_ubatch_id, dbo_yield
from scenarios.tools.bench.baselines import _NullDevice
from scenarios.tools.bench.figures import Figure, Stats, Target
from scenarios.tools.bench.registry import Plan, benchmark
from scenarios.tools.bench.timing import _interleave


@contextmanager
def _one_core() -> Iterator[int | None]:
    """Run the block's new threads on a single CPU (they inherit the creating thread's
    affinity); yields the CPU, or None where affinity cannot be set."""
    if not hasattr(os, "sched_setaffinity"):
        yield None
        return
    before = os.sched_getaffinity(0)
    cpu = min(before)
    os.sched_setaffinity(0, {cpu})
    try:
        yield cpu
    finally:
        os.sched_setaffinity(0, before)


def _dbo_pingpong(device: Device, handoffs: int) -> Callable[[], float]:
    """ns per baton pass: two ubatch threads of `dbo.run_ubatches` each call dbo_yield()
    `handoffs` times; ubatch 0 times its loop, which spans 2 x handoffs passes."""

    def sample() -> float:
        times = [0, 0]

        def body(_: Any) -> None:
            first = dbo_current_ubatch_id() == 0
            if first:
                times[0] = time.perf_counter_ns()
            for _ in range(handoffs):
                dbo_yield()
            if first:
                times[1] = time.perf_counter_ns()

        if isinstance(device, SimDevice):
            device.reset()  # its timeline holds a record per pass
        dbo.run_ubatches(body, [None, None], device=device, timeout=60.0)
        return (times[1] - times[0]) / (2 * handoffs)

    return sample


class _LockRing:
    """The floor: each thread releases its peer's lock and blocks on its own; nothing else."""

    @staticmethod
    def make() -> threading.Lock:
        lock = threading.Lock()
        lock.acquire()  # held = not signalled
        return lock

    @staticmethod
    def signal(lock: threading.Lock) -> None:
        lock.release()

    @staticmethod
    def wait(lock: threading.Lock) -> None:
        lock.acquire()

    @staticmethod
    def passes(own: threading.Lock, nxt: threading.Lock, n: int) -> None:
        release, acquire = nxt.release, own.acquire
        for _ in range(n):
            release()
            acquire()


class _EventRing:
    """vLLM's ring: set the next ubatch's event, wait on our own, clear it."""

    make = threading.Event

    @staticmethod
    def signal(event: threading.Event) -> None:
        event.set()

    @staticmethod
    def wait(event: threading.Event) -> None:
        event.wait()
        event.clear()

    @staticmethod
    def passes(own: threading.Event, nxt: threading.Event, n: int) -> None:
        for _ in range(n):
            nxt.set()
            own.wait()
            own.clear()


def _ring_pingpong(ring: Any, handoffs: int) -> Callable[[], float]:
    """ns per pass for two threads passing a baton made of `ring`'s primitive; thread 0
    times its loop, which spans 2 x handoffs passes, as in `_dbo_pingpong`."""

    def sample() -> float:
        signals = [ring.make(), ring.make()]
        barrier = threading.Barrier(3)
        times = [0, 0]

        def body(i: int) -> None:
            own, nxt = signals[i], signals[1 - i]
            barrier.wait()
            ring.wait(own)  # the first turn
            if i == 0:
                times[0] = time.perf_counter_ns()
            ring.passes(own, nxt, handoffs)
            if i == 0:
                times[1] = time.perf_counter_ns()
            ring.signal(nxt)  # release the peer's last wait

        threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(2)]
        for t in threads:
            t.start()
        barrier.wait()
        ring.signal(signals[0])
        for t in threads:
            t.join(timeout=60.0)
            if t.is_alive():  # daemon threads: a stuck one cannot keep the process alive
                raise RuntimeError(f"baton baseline {ring.__name__} did not finish in 60 s")
        return (times[1] - times[0]) / (2 * handoffs)

    return sample


@benchmark("baton")
def bench_baton(plan: Plan) -> list[Figure]:
    k = plan.handoffs
    figures = []
    floor_what = "a bare threading.Lock ping-pong (release the peer's, acquire our own)"
    event_what = "vLLM's threading.Event ring (set next, wait own, clear own)"
    for where in ("os", "one_core"):
        with _one_core() if where == "one_core" else nullcontext() as cpu:
            samples = _interleave(
                {
                    "dbo": _dbo_pingpong(_NullDevice(), k),
                    "event": _ring_pingpong(_EventRing, k),
                    "lock": _ring_pingpong(_LockRing, k),
                },
                plan.handoff_reps,
            )
        suffix = "" if where == "os" else ".one_core"
        how = "threads placed by the OS" if where == "os" else f"every thread on CPU {cpu}"
        if where == "one_core" and cpu is None:
            how = "one core requested, but this platform cannot pin threads"
        floor = Stats.of(samples["lock"])
        dbo_stats, event_stats = Stats.of(samples["dbo"]), Stats.of(samples["event"])
        figures.append(
            Figure(
                bench="baton",
                name=f"baton.dbo_yield{suffix}",
                what=f"one baton pass: 2 ubatch threads of dbo.run_ubatches on a do-nothing "
                f"device, {k} dbo_yield() each per sample; {how}",
                unit="ns",
                ours=dbo_stats,
                baseline=floor,
                baseline_what=floor_what,
                targets=[Target("ratio", "<=", 1.1, "<= 1.1x floor")],
                extra={"vs_event_ring": dbo_stats.median / event_stats.median},
            )
        )
        figures.append(
            Figure(
                bench="baton",
                name=f"baton.event_ring{suffix}",
                what=f"one pass of {event_what}, 2 threads, {k} passes each per sample; {how}",
                unit="ns",
                ours=event_stats,
                baseline=floor,
                baseline_what=floor_what,
                note="vLLM's mechanism, for reference",
            )
        )
    sim = SimDevice(check_races=False)
    samples = _interleave(
        {
            "sim": _dbo_pingpong(sim, k),
            "lock": _ring_pingpong(_LockRing, k),
        },
        plan.handoff_reps,
    )
    figures.append(
        Figure(
            bench="baton",
            name="baton.dbo_yield.sim",
            what="one baton pass as in baton.dbo_yield, on SimDevice(check_races=False) "
            "(threads intercepted, a handoff record per pass)",
            unit="ns",
            ours=Stats.of(samples["sim"]),
            baseline=Stats.of(samples["lock"]),
            baseline_what=floor_what,
        )
    )
    return figures
