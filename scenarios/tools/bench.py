"""`python -m scenarios bench`: time what dbo-sim exists to make fast, each figure a ratio.

Every figure sets our code against a baseline timed in the same process, interleaved with it
(A, B, A, B, ...), because the machines this runs on are small, shared and noisy: an absolute
time means little, a ratio taken in the same minutes means something. Each figure keeps its
samples (median, min, max, and the values), the ratio (the median of per-repetition ratios,
each repetition sampling ours and the baseline back to back), and, where the project has one,
a target and whether it was met. The table goes to stdout, everything to `<out>/bench.json`
with the date and the machine. A missed target is printed as MISSED but does not fail the
command: benchmarks report, tests gate.

What is measured (exactly), by benchmark:
- workspace.get_simultaneous: one call of `WorkspaceManager.get_simultaneous` with 1, 3 and 8
  tensors that fit (locked, and unlocked for 3) against `SeedWorkspace` below, the plain
  per-call algorithm (byte sizes, 256-byte rounding, running offsets, slice/view/reshape per tensor),
  both paying the `dbo_current_ubatch_id()` lookup.
- workspace.allocations: slot allocations (`_allocate` calls) and CPU storage allocations
  (the profiler's allocator events) during locked, fitting calls: both must be 0.
- workspace.growth: a chain of requests each forcing every slot to grow (unlocked).
- baton: one baton pass between two ubatch threads calling `dbo_yield()` in
  `dbo.run_ubatches` on a device whose streams and events do nothing (the baton alone),
  against vLLM's `threading.Event` ring and a bare `threading.Lock` ping-pong (the floor),
  under the OS's scheduling and with every thread on one core; and `dbo_yield()` on the
  simulated device (what its handoff bookkeeping adds).
- sim.intercept, sim.tiny_step, sim.deepseek_v3_step: the simulator's interception cost per
  small op, on a real-valued tiny step, and on a DeepSeek-V3-size `meta` decode step (2
  ubatches on the simulator against the plain serial forward on `meta`).
- scaling.*: get_simultaneous against tensor count, step time against ubatch and layer
  count, slot bytes against N x the largest request, and orphaned bytes after a growth.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

import dbo
from dbo.sim import SimDevice
from dbo.split import split_batch
from dbo.streams import Device, Event, Stream
from dbo.ubatching import dbo_current_ubatch_id, dbo_yield
from scenarios.model import Batch, MoEModel, preset
from scenarios.tools.progress import Progress
from workspace import (
    WorkspaceManager,
    init_workspace_manager,
    lock_workspace,
    reset_workspace_manager,
)
from workspace.testing import record_allocations

__all__ = [
    "BENCHMARKS",
    "Stats",
    "Target",
    "Figure",
    "Plan",
    "FULL",
    "QUICK",
    "SeedWorkspace",
    "run_benchmarks",
    "format_table",
    "main",
]

# The benchmarks every run (quick or full) reports; each figure names the one it belongs to.
BENCHMARKS: tuple[str, ...] = (
    "workspace.get_simultaneous",
    "workspace.allocations",
    "workspace.growth",
    "baton",
    "sim.intercept",
    "sim.tiny_step",
    "sim.deepseek_v3_step",
    "scaling.get_simultaneous",
    "scaling.ubatches",
    "scaling.layers",
    "scaling.workspace_bytes",
    "scaling.orphaned_bytes",
)

SCHEMA_VERSION = 1


# --------------------------------------------------------------------------------------------
# Records


@dataclass(frozen=True)
class Stats:
    """Samples of one quantity, in the figure's unit, in the order they were taken."""

    median: float
    min: float
    max: float
    samples: int
    values: tuple[float, ...] = ()

    @staticmethod
    def of(values: Sequence[float]) -> "Stats":
        if not values:
            raise ValueError("Stats.of needs at least one sample")
        median = statistics.median(values)
        return Stats(median, min(values), max(values), len(values), tuple(values))

    @staticmethod
    def exact(value: float) -> "Stats":
        """A count or a size: one value, no spread."""
        return Stats(value, value, value, 1)


@dataclass(frozen=True)
class Target:
    """A goal for a figure: `on` ("ratio" or "ours") `op` ("<=", ">=", "==") `value`."""

    on: str
    op: str
    value: float
    label: str  # as the table shows it

    def met(self, ours: float, ratio: float | None) -> bool:
        x = ours if self.on == "ours" else ratio
        if x is None or math.isnan(x):
            return False
        if self.op == "<=":
            return x <= self.value
        if self.op == ">=":
            return x >= self.value
        return x == self.value


@dataclass
class Figure:
    """One row of the table: ours against a baseline, their ratio, and the targets."""

    bench: str  # one of BENCHMARKS
    name: str
    what: str  # exactly what one sample measures
    unit: str  # "ns", "ms", "bytes" or "count"
    ours: Stats
    baseline: Stats | None = None
    baseline_what: str = ""
    ratio_def: str = "ours/baseline"  # or "baseline/ours" (a speedup)
    targets: list[Target] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    note: str = ""

    @property
    def paired(self) -> bool:
        """Ours and the baseline were sampled in lockstep (rep i of each taken together)."""
        return (
            self.baseline is not None
            and len(self.ours.values) > 1
            and len(self.ours.values) == len(self.baseline.values)
        )

    @property
    def ratio(self) -> float | None:
        """The median of per-repetition ratios when paired, else the ratio of medians.

        Pairing matters on a shared machine: it drifts between phases (the baton's floor
        alone flips between about 6 and 20 us as the peer core sleeps or not), and both
        samples of a pair sit in the same phase, while two medians may not.
        """
        if self.baseline is None:
            return None
        if self.paired:
            pairs = zip(self.ours.values, self.baseline.values)
            return statistics.median(_divide(a, b, self.ratio_def) for a, b in pairs)
        return _divide(self.ours.median, self.baseline.median, self.ratio_def)

    @property
    def met(self) -> bool | None:
        """None when the figure has no target (it informs, it does not judge)."""
        if not self.targets:
            return None
        return all(t.met(self.ours.median, self.ratio) for t in self.targets)

    def to_dict(self) -> dict[str, Any]:
        return {
            "bench": self.bench,
            "name": self.name,
            "what": self.what,
            "unit": self.unit,
            "ours": _stats_dict(self.ours),
            "baseline": None if self.baseline is None else _stats_dict(self.baseline),
            "baseline_what": self.baseline_what,
            "ratio": _json_float(self.ratio),
            "ratio_def": self.ratio_def,
            "ratio_paired": self.paired,
            "targets": [asdict(t) for t in self.targets],
            "target": "; ".join(t.label for t in self.targets) or None,
            "met": self.met,
            "extra": self.extra,
            "note": self.note,
        }


def _divide(ours: float, baseline: float, ratio_def: str) -> float:
    a, b = (baseline, ours) if ratio_def == "baseline/ours" else (ours, baseline)
    if b == 0:
        return 1.0 if a == 0 else math.inf
    return a / b


def _json_float(x: float | None) -> float | None:
    # JSON has no inf/nan; a figure that produced one carries null and says so in its note.
    return None if x is None or not math.isfinite(x) else x


def _stats_dict(stats: Stats) -> dict[str, Any]:
    return {k: _json_float(v) if isinstance(v, float) else v for k, v in asdict(stats).items()}


def _strict_json(value: Any) -> Any:
    """`value` with every non-finite float (in extras too) replaced by None."""
    if isinstance(value, float):
        return _json_float(value)
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    return value


@dataclass(frozen=True)
class Plan:
    """How much of everything to run: the full run, or a CI smoke (`--quick`)."""

    quick: bool
    reps: int  # interleaved samples per micro-benchmark
    sample_ns: int  # a micro sample loops until it lasts at least this long
    handoffs: int  # yields per thread in one baton sample
    handoff_reps: int
    step_reps: int
    deepseek_layers: int
    small_ops: int  # ops per interception sample
    growths: int  # growths per growth sample
    tensor_counts: tuple[int, ...]
    ubatch_counts: tuple[int, ...]
    layer_counts: tuple[int, ...]
    byte_ubatch_counts: tuple[int, ...]


FULL = Plan(
    quick=False,
    reps=15,
    sample_ns=10_000_000,
    handoffs=2000,
    handoff_reps=15,
    step_reps=11,
    deepseek_layers=61,
    small_ops=2000,
    growths=16,
    tensor_counts=(1, 2, 4, 8, 16, 32, 64),
    ubatch_counts=(2, 3, 4, 8),
    layer_counts=(1, 2, 4, 8),
    byte_ubatch_counts=(2, 3, 4, 8),
)
QUICK = Plan(
    quick=True,
    reps=5,
    sample_ns=1_000_000,
    handoffs=200,
    handoff_reps=3,
    step_reps=3,
    deepseek_layers=8,
    small_ops=200,
    growths=4,
    tensor_counts=(1, 8, 64),
    ubatch_counts=(2, 4),
    layer_counts=(1, 2),
    byte_ubatch_counts=(2, 4),
)


# --------------------------------------------------------------------------------------------
# Timing


def _loop_ns(fn: Callable[..., Any], args: tuple, number: int) -> int:
    """Nanoseconds for `number` calls of fn(*args), the garbage collector off (as timeit)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter_ns()
        for _ in range(number):
            fn(*args)
        return time.perf_counter_ns() - start
    finally:
        if enabled:
            gc.enable()


def _calibrate(fn: Callable[..., Any], args: tuple, min_ns: int) -> int:
    """The call count whose loop lasts at least min_ns (this also warms fn up)."""
    number = 1
    while True:
        elapsed = _loop_ns(fn, args, number)
        if elapsed >= min_ns or number >= 1 << 24:
            return number
        # Aim a little past min_ns so the next try usually settles it.
        number = max(number * 2, int(number * 1.2 * min_ns / max(elapsed, 1)))


def _per_call_sampler(fn: Callable[..., Any], args: tuple, min_ns: int) -> Callable[[], float]:
    number = _calibrate(fn, args, min_ns)
    return lambda: _loop_ns(fn, args, number) / number


def _interleave(samplers: dict[str, Callable[[], float]], reps: int) -> dict[str, list[float]]:
    """A, B, C, A, B, C, ...: each rep samples every variant once, so drift hits all alike."""
    samples: dict[str, list[float]] = {name: [] for name in samplers}
    for _ in range(reps):
        for name, sample in samplers.items():
            samples[name].append(sample())
    return samples


def _timed_ms(
    fn: Callable[[], Any], before: Callable[[], Any] | None = None
) -> Callable[[], float]:
    """A sampler of one call of fn in milliseconds; `before` runs untimed first (a reset)."""

    def sample() -> float:
        if before is not None:
            before()
        gc.collect()  # start every step sample from the same heap, not mid-collection
        start = time.perf_counter_ns()
        fn()
        return (time.perf_counter_ns() - start) / 1e6

    return sample


# --------------------------------------------------------------------------------------------
# Baselines and helpers


def _seed_nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _seed_round_up(nbytes: int, alignment: int = 256) -> int:
    return (nbytes + alignment - 1) // alignment * alignment


class SeedWorkspace:
    """The plain per-call algorithm, as the baseline for get_simultaneous.

    Per call: each tensor's byte size (numel x itemsize), each rounded up to 256, their sum,
    the running offsets; the caller's slot by `dbo_current_ubatch_id()`, grown (every slot,
    old buffer dropped first) when too small and not locked; then one slice, view(dtype) and
    reshape(shape) per tensor. Nothing is cached: that is the difference being measured.
    """

    def __init__(self, device: str | torch.device, num_ubatches: int) -> None:
        self.device = torch.device(device)
        self.slots: list[torch.Tensor | None] = [None] * num_ubatches
        self.locked = False

    def get_simultaneous(
        self, *shapes_and_dtypes: tuple[tuple[int, ...], torch.dtype]
    ) -> list[torch.Tensor]:
        actual = [_seed_nbytes(shape, dtype) for shape, dtype in shapes_and_dtypes]
        aligned = [_seed_round_up(n) for n in actual]
        offsets = list(accumulate([0] + aligned[:-1]))
        buffer = self._ensure_size(sum(aligned))
        return [
            buffer[offsets[i] : offsets[i] + actual[i]].view(dtype).reshape(shape)
            for i, (shape, dtype) in enumerate(shapes_and_dtypes)
        ]

    def _ensure_size(self, required: int) -> torch.Tensor:
        slot = dbo_current_ubatch_id()
        buffer = self.slots[slot]
        if buffer is None or buffer.numel() < required:
            if self.locked:
                raise AssertionError(f"seed workspace is locked; {required} bytes requested")
            for k, old in enumerate(self.slots):
                if old is None or old.numel() < required:
                    self.slots[k] = None
                    del old
                    self.slots[k] = torch.empty((required,), dtype=torch.uint8, device=self.device)
            buffer = self.slots[slot]
        return buffer  # type: ignore[return-value]


# Tensor shapes of the requests: the MoE block's mix of a decode step's scratch (16 tokens,
# DeepSeek-V3 widths), cycled to make a request of any length.
_REQUEST_CYCLE: tuple[tuple[tuple[int, ...], torch.dtype], ...] = (
    ((16, 7168), torch.bfloat16),
    ((16, 8), torch.int32),
    ((16, 2048), torch.bfloat16),
    ((16, 8), torch.float32),
)


def _request(n: int) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    return tuple(_REQUEST_CYCLE[i % len(_REQUEST_CYCLE)] for i in range(n))


def _request_bytes(request: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> int:
    return sum(_seed_round_up(_seed_nbytes(s, d)) for s, d in request)


class _NullEvent(Event):
    def __init__(self, device: "_NullDevice") -> None:
        self.device = device

    def record(self, stream: Stream | None = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _NullStream(Stream):
    def __init__(self, device: "_NullDevice", name: str) -> None:
        self.device = device
        self.name = name

    def wait_event(self, event: Event) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _NullDevice(Device):
    """Streams and events that do nothing, tensors on CPU or meta: the runtime and the model
    with no simulator, so what is timed is the baton or the model's own Python and torch."""

    kind = "null"

    def __init__(self, tensor_device: str = "cpu") -> None:
        self.torch_device = torch.device(tensor_device)
        self._default = _NullStream(self, "default")
        self._tls = threading.local()

    def Stream(self, name: str = "") -> Stream:
        return _NullStream(self, name or "stream")

    def Event(self) -> Event:
        return _NullEvent(self)

    def default_stream(self) -> Stream:
        return self._default

    def current_stream(self) -> Stream:
        return getattr(self._tls, "stream", self._default)

    def set_stream(self, stream: Stream) -> None:
        self._tls.stream = stream

    def synchronize(self) -> None:
        pass


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


# --------------------------------------------------------------------------------------------
# Workspace


def _get_simultaneous_samples(
    request: Sequence[tuple[tuple[int, ...], torch.dtype]], *, locked: bool, sample_ns: int, reps: int
) -> dict[str, list[float]]:
    """ns per fitting get_simultaneous(*request) call on a fresh 2-slot CPU WorkspaceManager
    ("ours") and on SeedWorkspace ("seed"), both warmed up (grown; ours has cached the
    request's layout) and optionally locked, sampled interleaved `reps` times."""
    ours = WorkspaceManager("cpu", 2)
    seed = SeedWorkspace("cpu", 2)
    ours.get_simultaneous(*request)  # warm-up: grow, and cache the signature
    seed.get_simultaneous(*request)
    if locked:
        ours.lock()
        seed.locked = True
    return _interleave(
        {
            "ours": _per_call_sampler(ours.get_simultaneous, request, sample_ns),
            "seed": _per_call_sampler(seed.get_simultaneous, request, sample_ns),
        },
        reps,
    )


def bench_get_simultaneous(plan: Plan) -> list[Figure]:
    figures = []
    for n, locked in ((1, True), (3, True), (8, True), (3, False)):
        samples = _get_simultaneous_samples(_request(n), locked=locked, sample_ns=plan.sample_ns, reps=plan.reps)
        state = "locked" if locked else "unlocked"
        figures.append(
            Figure(
                bench="workspace.get_simultaneous",
                name=f"workspace.get_simultaneous.{state}.n{n}",
                what=f"one get_simultaneous call, {n} tensor(s), {state}, fitting, from a "
                f"non-ubatch thread (slot 0), on CPU",
                unit="ns",
                ours=Stats.of(samples["ours"]),
                baseline=Stats.of(samples["seed"]),
                baseline_what="SeedWorkspace.get_simultaneous (the plain per-call algorithm)",
                ratio_def="baseline/ours",
                targets=[Target("ratio", ">=", 5.0, "speedup >= 5x")] if locked else [],
            )
        )
    return figures


def bench_allocations(plan: Plan) -> list[Figure]:
    """Locked, fitting calls of 1, 3 and 8 tensors: no slot and no storage allocation."""
    requests = [_request(n) for n in (1, 3, 8)]
    ours = WorkspaceManager("cpu", 2)
    seed = SeedWorkspace("cpu", 2)
    for request in requests:
        ours.get_simultaneous(*request)
        seed.get_simultaneous(*request)
    ours.lock()
    seed.locked = True
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
            what=f"WorkspaceManager._allocate calls during {calls} x 3 locked fitting calls "
            f"(1, 3 and 8 tensors)",
            unit="count",
            ours=Stats.exact(len(count)),
            targets=[Target("ours", "==", 0, "== 0")],
        )
    ]
    try:
        mine, theirs = _storage_allocations(run(ours)), _storage_allocations(run(seed))
        figures.append(
            Figure(
                bench="workspace.allocations",
                name="workspace.allocations.storage",
                what=f"CPU allocator calls (torch.profiler memory events) during {calls} x 3 "
                f"locked fitting calls",
                unit="count",
                ours=Stats.exact(mine),
                baseline=Stats.exact(theirs),
                baseline_what="the same calls on SeedWorkspace",
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

    def seed_sample() -> float:
        seed = SeedWorkspace("cpu", 2)
        seed.get_simultaneous(((step,), torch.uint8))
        start = time.perf_counter_ns()
        for shape in sizes:
            seed.get_simultaneous(shape)
        return (time.perf_counter_ns() - start) / len(sizes)

    samples = _interleave({"ours": ours_sample, "seed": seed_sample}, plan.reps)
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
            baseline=Stats.of(samples["seed"]),
            baseline_what="the same chain on SeedWorkspace",
            extra={"slot_allocations_per_growth": per_growth},
            note="ours also validates the request, names the caller (a stack walk), keeps a "
            "weak reference per replaced buffer (orphan counting) and records the growth",
        )
    ]


# --------------------------------------------------------------------------------------------
# The baton


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
            what=f"one baton pass as in baton.dbo_yield, on SimDevice(check_races=False) "
            f"(threads intercepted, a handoff record per pass)",
            unit="ns",
            ours=Stats.of(samples["sim"]),
            baseline=Stats.of(samples["lock"]),
            baseline_what=floor_what,
        )
    )
    return figures


# --------------------------------------------------------------------------------------------
# The simulator


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
    fast, checked = SimDevice(check_races=False), SimDevice(check_races=True)
    samples = _interleave(
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


def _serial_step(
    model: MoEModel, x: torch.Tensor, device: Device, *, intercept: bool, mode: str
) -> Callable[[], Any]:
    def step() -> Any:
        with dbo.use_device(device), (device.thread_scope(None) if intercept else nullcontext()):
            return model.forward(x, None, mode=mode)

    return step


def _ubatched_step(
    model: MoEModel, x: torch.Tensor, device: Device, num_ubatches: int, mode: str
) -> Callable[[], Any]:
    slices = split_batch(model.batch.query_start_loc, model.batch.num_tokens, num_ubatches)

    def step() -> Any:
        return dbo.run_ubatches(
            lambda s: model.forward(x[s.token_slice], s, mode=mode),
            slices,
            device=device,
            timeout=120.0,
        )

    return step


def _locked_workspace(
    torch_device: torch.device, slots: int, warmups: Sequence[Callable[[], Any]]
) -> None:
    """The harness's life cycle: a fresh workspace, one eager warm-up of
    every step to be timed (the slots grow to their largest need), then lock. The variants
    of one benchmark share it, so they can interleave; a serial step uses slot 0."""
    reset_workspace_manager()
    init_workspace_manager(torch_device, slots)
    for step in warmups:
        step()
    lock_workspace()


def _step_sampler(step: Callable[[], Any], device: Device) -> Callable[[], float]:
    """ms for one step; a simulated device is reset first (untimed), so its timeline and
    race history do not grow from sample to sample."""
    return _timed_ms(step, device.reset if isinstance(device, SimDevice) else None)


def bench_tiny_step(plan: Plan) -> list[Figure]:
    config = preset("tiny")
    model = MoEModel(config, Batch.decode(16, 8))
    x = model.inputs()
    mode = "ll"
    devices: dict[str, Device] = {
        "plain": _NullDevice(),
        "sim": SimDevice(check_races=False),
        "races": SimDevice(check_races=True),
    }
    steps = {
        key: _serial_step(model, x, device, intercept=key != "plain", mode=mode)
        for key, device in devices.items()
    }
    _locked_workspace(torch.device("cpu"), 1, list(steps.values()))
    samples = _interleave(
        {key: _step_sampler(step, devices[key]) for key, step in steps.items()}, plan.step_reps
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


def bench_deepseek(plan: Plan) -> list[Figure]:
    layers = plan.deepseek_layers
    config = preset("deepseek-v3", num_layers=layers)
    batch = Batch.decode(256, 128)
    model = MoEModel(config, batch)
    x = model.inputs()
    mode = "ll"
    sim = SimDevice(tensor_device="meta")
    null = _NullDevice("meta")
    variants: dict[str, tuple[Callable[[], Any], Device]] = {
        "dbo_sim": (_ubatched_step(model, x, sim, 2, mode), sim),
        "plain": (_serial_step(model, x, null, intercept=False, mode=mode), null),
        "dbo_null": (_ubatched_step(model, x, null, 2, mode), null),
        "serial_sim": (_serial_step(model, x, sim, intercept=True, mode=mode), sim),
    }
    _locked_workspace(torch.device("meta"), 2, [step for step, _ in variants.values()])
    samples = _interleave(
        {key: _step_sampler(step, device) for key, (step, device) in variants.items()},
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


# --------------------------------------------------------------------------------------------
# Scaling


def bench_scaling_get_simultaneous(plan: Plan) -> list[Figure]:
    figures = []
    for n in plan.tensor_counts:
        samples = _get_simultaneous_samples(
            _request(n), locked=True, sample_ns=plan.sample_ns // 2, reps=max(3, plan.reps // 2)
        )
        stats = Stats.of(samples["ours"])
        figures.append(
            Figure(
                bench="scaling.get_simultaneous",
                name=f"scaling.get_simultaneous.n{n}",
                what=f"one locked fitting get_simultaneous call with {n} tensor(s)",
                unit="ns",
                ours=stats,
                baseline=Stats.of(samples["seed"]),
                baseline_what="SeedWorkspace.get_simultaneous",
                ratio_def="baseline/ours",
                extra={"ours_ns_per_tensor": stats.median / n},
            )
        )
    return figures


def bench_scaling_steps(plan: Plan) -> list[Figure]:
    mode = "ll"
    batch = Batch.decode(16, 8)
    figures = []
    tiny = preset("tiny")
    model = MoEModel(tiny, batch)
    x = model.inputs()
    device = SimDevice(check_races=False)
    steps = {str(n): _ubatched_step(model, x, device, n, mode) for n in plan.ubatch_counts}
    _locked_workspace(torch.device("cpu"), max(plan.ubatch_counts), list(steps.values()))
    samples = _interleave({k: _step_sampler(s, device) for k, s in steps.items()}, plan.step_reps)
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
        steps[str(layers)] = _ubatched_step(model, model.inputs(), device, 2, mode)
    _locked_workspace(torch.device("cpu"), 2, list(steps.values()))
    samples = _interleave({k: _step_sampler(s, device) for k, s in steps.items()}, plan.step_reps)
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


def bench_workspace_bytes(plan: Plan) -> list[Figure]:
    """Warm up N ubatch threads on mixed requests; the slots must total exactly N x R."""
    figures = []
    for n in plan.byte_ubatch_counts:
        manager = WorkspaceManager("cpu", n)
        # Each ubatch asks for a different mix; only the last one sees the largest request,
        # so slots it never touched must still end up its size (synchronous growth).
        plans = [[_request(1), _request(3 + i), _request(2)] for i in range(n)]
        plans[-1][1] = _request(12)
        largest = max(_request_bytes(r) for p in plans for r in p)

        def body(requests: list[Any]) -> None:
            for request in requests:
                manager.get_simultaneous(*request)
                dbo_yield()

        dbo.run_ubatches(body, plans, device=_NullDevice(), timeout=60.0)
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


# --------------------------------------------------------------------------------------------
# Running and reporting


_STEPS: tuple[tuple[str, Callable[[Plan], list[Figure]]], ...] = (
    ("get_simultaneous", bench_get_simultaneous),
    ("allocations", bench_allocations),
    ("growth", bench_growth),
    ("baton", bench_baton),
    ("interception", bench_intercept),
    ("tiny step", bench_tiny_step),
    ("deepseek-v3 step", bench_deepseek),
    ("scaling: tensors", bench_scaling_get_simultaneous),
    ("scaling: ubatches, layers", bench_scaling_steps),
    ("workspace bytes", bench_workspace_bytes),
    ("orphans", bench_orphans),
)


# Torch intra-op threads during the run. Every op timed here is small, and on a shared
# 2-core machine an OpenMP region whose second worker is descheduled waits out a whole time
# slice: tiny steps showed 100-500 ms outliers against a 3 ms median with 2 threads.
BENCH_TORCH_THREADS = 1


@contextmanager
def _bench_conditions() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(BENCH_TORCH_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_benchmarks(plan: Plan, progress: Progress | None = None) -> list[Figure]:
    figures: list[Figure] = []
    with _bench_conditions():
        for label, bench in _STEPS:
            figures.extend(bench(plan))
            if progress is not None:
                progress.update(label)
    return figures


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            capture_output=True, text=True, timeout=5, cwd=Path(__file__).resolve().parent,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def machine_info() -> dict[str, Any]:
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "usable_cpus": affinity,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "switch_interval_s": sys.getswitchinterval(),
        "git_commit": _git_commit(),
    }


def _fmt(value: float, unit: str) -> str:
    if math.isnan(value):
        return "n/a"
    if unit in ("count", "bytes"):
        return f"{int(value)}" + (" B" if unit == "bytes" else "")
    ns = value * {"ns": 1.0, "ms": 1e6}[unit]
    for scale, suffix in ((1e9, "s"), (1e6, "ms"), (1e3, "us")):
        if ns >= scale:
            return f"{ns / scale:.3g} {suffix}"
    return f"{ns:.3g} ns"


def _fmt_ratio(figure: Figure) -> str:
    ratio = figure.ratio
    if ratio is None:
        return "-"
    return f"{ratio:.2f}x" + (" faster" if figure.ratio_def == "baseline/ours" else "")


def format_table(figures: Sequence[Figure]) -> str:
    """name, ours, baseline (medians), ratio, target, met: one row per figure."""
    header = ("name", "ours", "baseline", "ratio", "target", "met")
    rows = [header]
    for f in figures:
        rows.append(
            (
                f.name,
                _fmt(f.ours.median, f.unit),
                "-" if f.baseline is None else _fmt(f.baseline.median, f.unit),
                _fmt_ratio(f),
                "; ".join(t.label for t in f.targets) or "-",
                {True: "yes", False: "MISSED", None: "-"}[f.met],
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def report(figures: Sequence[Figure], plan: Plan, seconds: float) -> dict[str, Any]:
    targeted = [f for f in figures if f.met is not None]
    return {
        "schema": SCHEMA_VERSION,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": plan.quick,
        "machine": machine_info(),
        "plan": asdict(plan),
        "torch_threads_during_run": BENCH_TORCH_THREADS,
        "seconds": round(seconds, 2),
        "benchmarks": list(BENCHMARKS),
        "figures": [f.to_dict() for f in figures],
        "summary": {
            "targets": len(targeted),
            "met": sum(1 for f in targeted if f.met),
            "missed": [f.name for f in targeted if not f.met],
        },
    }


def main(args: argparse.Namespace) -> int:
    """Run the benchmarks, print the table (or the JSON), write <out>/bench.json; always 0."""
    quick = bool(getattr(args, "quick", False))
    as_json = bool(getattr(args, "json", False))
    out = Path(getattr(args, "out", "out"))
    plan = QUICK if quick else FULL
    progress = Progress(len(_STEPS), "bench", enabled=False if as_json else None)
    start = time.monotonic()
    try:
        figures = run_benchmarks(plan, progress)
    finally:
        progress.close()
        reset_workspace_manager()  # leave no benchmark's workspace behind for the caller
    doc = _strict_json(report(figures, plan, time.monotonic() - start))
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench.json"
    path.write_text(json.dumps(doc, indent=2, default=str, allow_nan=False) + "\n")
    if as_json:
        print(json.dumps(doc, default=str, allow_nan=False))
        return 0
    m = doc["machine"]
    print(
        f"dbo-sim bench{' --quick' if quick else ''}  {doc['date']}  {m['platform']}, "
        f"{m['cpu_count']} CPUs, Python {m['python']}, torch {m['torch']}"
    )
    print(format_table(figures))
    print("ours, baseline: medians; ratio: median of per-repetition ratios, ours/baseline "
          "(\"faster\": baseline/ours)")  # fmt: skip
    summary = doc["summary"]
    print(
        f"\n{summary['met']} of {summary['targets']} targets met in {doc['seconds']:.0f} s; "
        f"wrote {path}"
    )
    for f in figures:
        if f.met is False:
            targets = "; ".join(t.label for t in f.targets)
            note = f" - {f.note}" if f.note else ""
            print(f"MISSED {f.name}: {targets} (ours {_fmt(f.ours.median, f.unit)}, "
                  f"ratio {_fmt_ratio(f)}){note}")  # fmt: skip
    return 0
