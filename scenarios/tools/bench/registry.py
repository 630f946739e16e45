"""The one list of benchmarks: each is a function of the `Plan`, registered with the
`benchmark` decorator under a progress label and the names its figures carry. The run order
is the registration order (the package imports its benchmark modules in that order)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from scenarios.tools.bench.figures import Figure


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


BenchFn = Callable[[Plan], list[Figure]]


@dataclass(frozen=True)
class Benchmark:
    """A registered benchmark: what the progress bar calls it, the `Figure.bench` names its
    figures carry, and the function that runs it."""

    label: str
    names: tuple[str, ...]
    run: BenchFn

    def __call__(self, plan: Plan) -> list[Figure]:
        figures = self.run(plan)
        stray = sorted({f.bench for f in figures} - set(self.names))
        if stray:
            raise RuntimeError(
                f"benchmark {self.label!r} returned figures of {stray}, not among the names it "
                f"registered ({list(self.names)}); add them to its @benchmark(...)"
            )
        return figures


_REGISTRY: list[Benchmark] = []


def benchmark(label: str, *names: str) -> Callable[[BenchFn], BenchFn]:
    """Register `fn(plan) -> list[Figure]` as a benchmark whose figures carry `names` (by
    default the label itself)."""

    def register(fn: BenchFn) -> BenchFn:
        entry = Benchmark(label, names or (label,), fn)
        taken = {n for b in _REGISTRY for n in (b.label, *b.names)}
        clash = sorted(taken & {entry.label, *entry.names})
        if clash:
            raise ValueError(f"benchmark names {clash} are registered twice; pick unique ones")
        _REGISTRY.append(entry)
        return fn

    return register


def registered() -> tuple[Benchmark, ...]:
    """Every registered benchmark, in run order."""
    return tuple(_REGISTRY)


def benchmark_names() -> tuple[str, ...]:
    """The `Figure.bench` names a full run reports, in run order."""
    return tuple(n for b in _REGISTRY for n in b.names)
