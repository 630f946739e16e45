"""Benchmark: the race checker's cost per intercepted op, with and without the checker.

The same op mix runs under `thread_scope` of a `SimDevice(check_races=False)` and of a
`SimDevice(check_races=True)`, interleaved sample by sample so that machine noise hits both
alike; plain torch (no interception) is the floor. The mix is what a DBO step issues: small
elementwise ops on two streams joined by events, a strided view, an in-place list op. The
figure to watch is the checker's own share, checked minus unchecked, per op; `main()` prints
it with the ratio checked / unchecked. The benchmark uses only the public device interface,
so the same file measures any commit (run it against an older tree to compare).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dbo.sim import SimDevice

__all__ = ["RaceBench", "bench_races", "main"]

OPS_PER_ROUND = 6  # ops each round of `_mix` issues (a list op counts once)


@dataclass(frozen=True)
class RaceBench:
    """Medians in ns per intercepted op."""

    plain_ns: float  # no interception at all
    unchecked_ns: float  # SimDevice(check_races=False)
    checked_ns: float  # SimDevice(check_races=True)
    rounds: int
    reps: int
    best_unchecked_ns: float = 0.0  # fastest samples: less sensitive to a loaded machine
    best_checked_ns: float = 0.0

    @property
    def checker_ns(self) -> float:
        """The checker's own cost per op."""
        return self.checked_ns - self.unchecked_ns

    @property
    def ratio(self) -> float:
        """Checked over unchecked time per op."""
        return self.checked_ns / self.unchecked_ns

    def describe(self) -> str:
        return (
            f"per intercepted op: plain {self.plain_ns / 1e3:.2f} us, unchecked "
            f"{self.unchecked_ns / 1e3:.2f} us, checked {self.checked_ns / 1e3:.2f} us; "
            f"checker {self.checker_ns / 1e3:.2f} us/op; checked/unchecked {self.ratio:.2f}x "
            f"({self.rounds} rounds x {OPS_PER_ROUND} ops, median of {self.reps}); fastest "
            f"samples: checker {(self.best_checked_ns - self.best_unchecked_ns) / 1e3:.2f} "
            f"us/op, checked/unchecked {self.best_checked_ns / self.best_unchecked_ns:.2f}x"
        )


def _mix(device: SimDevice | None, rounds: int) -> Callable[[], None]:
    x = torch.randn(64)
    grid = torch.zeros(16, 16)
    params = [torch.zeros(16) for _ in range(4)]
    if device is None:
        streams: Sequence = (None, None)
    else:
        streams = (device.Stream("compute"), device.Stream("comm"))

    def run() -> None:
        for i in range(rounds):
            here, there = streams[i % 2], streams[1 - i % 2]
            if device is not None:
                device.set_stream(here)
            y = x * 2.0
            y.add_(1.0)
            grid[:, i % 16].copy_(y[:16])  # a strided column
            torch._foreach_mul_(params, 1.0)
            z = y.sum()
            del z
            x.mul_(1.0)
            if device is not None:  # hand over to the other stream: a race-free schedule
                event = here.record_event()
                there.wait_event(event)

    return run


def _sampler(device: SimDevice | None, rounds: int) -> Callable[[], float]:
    run = _mix(device, rounds)

    def sample() -> float:
        if device is None:
            start = time.perf_counter_ns()
            run()
            return (time.perf_counter_ns() - start) / (rounds * OPS_PER_ROUND)
        device.reset()
        with device.thread_scope(None):
            start = time.perf_counter_ns()
            run()
            elapsed = time.perf_counter_ns() - start
        return elapsed / (rounds * OPS_PER_ROUND)

    return sample


def bench_races(rounds: int = 200, reps: int = 15) -> RaceBench:
    """Median ns per op of the mix: plain, unchecked, checked (interleaved samples)."""
    if rounds < 1 or reps < 1:
        raise ValueError(f"rounds and reps must be positive, got {rounds} and {reps}")
    samplers = {
        "plain": _sampler(None, rounds),
        "unchecked": _sampler(SimDevice(check_races=False), rounds),
        "checked": _sampler(SimDevice(check_races=True), rounds),
    }
    for sample in samplers.values():
        sample()  # warm-up: first calls pay one-time dispatch and classification setup
    samples: dict[str, list[float]] = {k: [] for k in samplers}
    for _ in range(reps):
        for key, sample in samplers.items():
            samples[key].append(sample())
    med = {k: statistics.median(v) for k, v in samples.items()}
    best = {k: min(v) for k, v in samples.items()}
    return RaceBench(
        med["plain"], med["unchecked"], med["checked"], rounds, reps,
        best["unchecked"], best["checked"],
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    rounds = int(args[0]) if args else 200
    reps = int(args[1]) if len(args) > 1 else 15
    print(bench_races(rounds, reps).describe())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
