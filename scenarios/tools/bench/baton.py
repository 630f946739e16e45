"""The baton benchmark: one pass between two ubatch threads calling `dbo_yield()`, against
vLLM's `threading.Event` ring and a bare `threading.Lock` ping-pong (the floor)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import dbo
from dbo.sim import SimDevice
from dbo.sim.options import SimOptions
from dbo.streams import Device
from dbo.ubatching import dbo_current_ubatch_id, dbo_yield
from scenarios.tools.bench.baselines import NullDevice
from scenarios.tools.bench.figures import Figure, Stats, Target
from scenarios.tools.bench.registry import Plan, benchmark
from scenarios.tools.bench.timing import interleave


def _one_core_cpu() -> int | None:
    """The CPU the one-core phase runs on (the lowest this process may use), or None where
    this platform cannot pin threads."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    return min(os.sched_getaffinity(0))


@contextmanager
def _pinned(cpu: int | None, home: set[int] | None = None) -> Iterator[None]:
    """Run the calling thread, and only it, on `cpu` for the block (None: leave it where the
    OS puts it), then move it to `home` (default: where it was). Affinity is per thread on
    Linux, so every thread that takes part in a pass pins itself: the ubatch threads are
    pooled and reused, so they inherit nothing from whoever starts a step. A worker the pool
    creates while the launcher is pinned inherits the pin, hence `home`: the launcher's CPUs
    from before, which every worker gets back for the next user."""
    if cpu is None:
        yield
        return
    back = set(os.sched_getaffinity(0)) if home is None else home
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, back)


def _dbo_pingpong(device: Device, handoffs: int, cpu: int | None) -> Callable[[], float]:
    """ns per baton pass: two ubatch threads of `dbo.run_ubatches` each call dbo_yield()
    `handoffs` times; ubatch 0 times its loop, which spans 2 x handoffs passes. With a `cpu`,
    both ubatch threads and the launching thread run on it; the timed loop starts only after
    one untimed round, by which time every ubatch thread has pinned itself."""

    def sample() -> float:
        times = [0, 0]
        home = None if cpu is None else set(os.sched_getaffinity(0))

        def body(_: Any) -> None:
            with _pinned(cpu, home):
                first = dbo_current_ubatch_id() == 0
                dbo_yield()  # the untimed round: the peer pins itself before the clock starts
                if first:
                    times[0] = time.perf_counter_ns()
                for _ in range(handoffs):
                    dbo_yield()
                if first:
                    times[1] = time.perf_counter_ns()

        if isinstance(device, SimDevice):
            device.reset()  # its timeline holds a record per pass
        with _pinned(cpu):
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


def _ring_pingpong(ring: Any, handoffs: int, cpu: int | None) -> Callable[[], float]:
    """ns per pass for two fresh threads passing a baton made of `ring`'s primitive; thread 0
    times its loop, which spans 2 x handoffs passes, as in `_dbo_pingpong`. With a `cpu`,
    both threads pin themselves before the start barrier and the launching thread too."""

    def sample() -> float:
        signals = [ring.make(), ring.make()]
        barrier = threading.Barrier(3)
        times = [0, 0]

        def body(i: int) -> None:
            own, nxt = signals[i], signals[1 - i]
            with _pinned(cpu):
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
        with _pinned(cpu):
            barrier.wait()
            ring.signal(signals[0])
        for t in threads:
            t.join(timeout=60.0)
            if t.is_alive():  # daemon threads: a stuck one cannot keep the process alive
                raise RuntimeError(f"baton baseline {ring.__name__} did not finish in 60 s")
        return (times[1] - times[0]) / (2 * handoffs)

    return sample


# What the baton's figures are held to, as ratios taken in the same run. The floor is two
# threads doing nothing but release-then-acquire; dbo_yield must also find its context,
# keep the step's bookkeeping (yield counts, states, abort checks) and tell the device, so it
# is held to a multiple of the floor, and to beating vLLM's Event ring, which it replaces.
FLOOR_TARGET = 1.5
EVENT_RING_TARGET = 1.0

FLOOR_WHAT = "a bare threading.Lock ping-pong (release the peer's, acquire our own)"
EVENT_WHAT = "vLLM's threading.Event ring (set next, wait own, clear own)"


def _placement(where: str) -> tuple[int | None, str, str]:
    """(cpu, figure-name suffix, how the threads were placed) for the phase `where`."""
    if where == "os":
        return None, "", "threads placed by the OS"
    cpu = _one_core_cpu()
    if cpu is None:
        return None, ".one_core", "one core requested, but this platform cannot pin threads"
    return cpu, ".one_core", f"every thread taking part pinned to CPU {cpu}"


def _baton_phase(plan: Plan, where: str) -> list[Figure]:
    k = plan.handoffs
    cpu, suffix, how = _placement(where)
    samples = interleave(
        {
            "dbo": _dbo_pingpong(NullDevice(), k, cpu),
            "event": _ring_pingpong(_EventRing, k, cpu),
            "lock": _ring_pingpong(_LockRing, k, cpu),
        },
        plan.handoff_reps,
    )
    dbo_stats, event, floor = (Stats.of(samples[key]) for key in ("dbo", "event", "lock"))
    what = (
        f"one baton pass: 2 ubatch threads of dbo.run_ubatches on a do-nothing device, {k} "
        f"dbo_yield() each per sample; {how}"
    )
    return [
        Figure(
            bench="baton",
            name=f"baton.dbo_yield{suffix}",
            what=what,
            unit="ns",
            ours=dbo_stats,
            baseline=floor,
            baseline_what=FLOOR_WHAT,
            targets=[Target("ratio", "<=", FLOOR_TARGET, f"<= {FLOOR_TARGET}x floor")],
        ),
        Figure(
            bench="baton",
            name=f"baton.dbo_yield.vs_event_ring{suffix}",
            what=what,
            unit="ns",
            ours=dbo_stats,
            baseline=event,
            baseline_what=EVENT_WHAT,
            ratio_def="baseline/ours",
            targets=[Target("ratio", ">=", EVENT_RING_TARGET, "faster than the Event ring")],
        ),
        Figure(
            bench="baton",
            name=f"baton.event_ring{suffix}",
            what=f"one pass of {EVENT_WHAT}, 2 threads, {k} passes each per sample; {how}",
            unit="ns",
            ours=event,
            baseline=floor,
            baseline_what=FLOOR_WHAT,
            note="vLLM's mechanism, for reference",
        ),
    ]


def _accounting(handoffs: int) -> Callable[[], float]:
    """ns of the simulated device's own accounting of one baton pass: `on_handoff` alone, on
    one thread, as many times as a `_dbo_pingpong` sample passes, the collector on as in a
    step. The records the passes leave are made when the timeline is read, after the step."""
    device = SimDevice(SimOptions(check_races=False))
    passes = 2 * handoffs

    def sample() -> float:
        device.reset()
        with device.thread_scope(0):
            start = time.perf_counter_ns()
            for _ in range(passes):
                device.on_handoff()
            return (time.perf_counter_ns() - start) / passes

    return sample


# The simulated device keeps the runtime's baton: its own accounting of a pass (the host
# clock, the pass's record) costs a small share of the pass, so a simulated step's handoffs
# time like the runtime's.
SIM_ACCOUNTING_TARGET = 0.1
SIM_EVENT_RING_TARGET = 1.1


def _baton_on_simulator(plan: Plan) -> list[Figure]:
    k = plan.handoffs
    samples = interleave(
        {
            "sim": _dbo_pingpong(SimDevice(SimOptions(check_races=False)), k, None),
            "runtime": _dbo_pingpong(NullDevice(), k, None),
            "event": _ring_pingpong(_EventRing, k, None),
            "accounting": _accounting(k),
        },
        plan.handoff_reps,
    )
    sim, runtime, event, accounting = (
        Stats.of(samples[key]) for key in ("sim", "runtime", "event", "accounting")
    )
    runtime_what = "the runtime's pass: baton.dbo_yield on a do-nothing device, same run"
    return [
        Figure(
            bench="baton",
            name="baton.dbo_yield.sim",
            what="one baton pass as in baton.dbo_yield, on SimDevice(check_races=False) "
            "(threads intercepted, the host clock charged, a handoff record per pass)",
            unit="ns",
            ours=sim,
            baseline=event,
            baseline_what=EVENT_WHAT,
            targets=[
                Target(
                    "ratio",
                    "<=",
                    SIM_EVENT_RING_TARGET,
                    f"<= {SIM_EVENT_RING_TARGET}x the Event ring",
                )
            ],
            extra={"runtime_pass_ns": runtime.median},
        ),
        Figure(
            bench="baton",
            name="baton.sim_accounting",
            what=f"the simulator's accounting of one pass alone: SimDevice.on_handoff(), one "
            f"thread, {2 * k} per sample, collector on",
            unit="ns",
            ours=accounting,
            baseline=runtime,
            baseline_what=runtime_what,
            targets=[
                Target(
                    "ratio",
                    "<=",
                    SIM_ACCOUNTING_TARGET,
                    f"<= {SIM_ACCOUNTING_TARGET:g} of the runtime's pass",
                )
            ],
        ),
    ]


@benchmark("baton")
def bench_baton(plan: Plan) -> list[Figure]:
    return _baton_phase(plan, "os") + _baton_phase(plan, "one_core") + _baton_on_simulator(plan)
