"""How a sample is taken: calibrated call loops with the collector off, interleaved variants
(A, B, A, B, ...) so that drift on a shared machine hits ours and the baseline alike."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any


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


def per_call_sampler(fn: Callable[..., Any], args: tuple, min_ns: int) -> Callable[[], float]:
    """A sampler of ns per fn(*args) call, over a loop calibrated to last `min_ns`."""
    number = _calibrate(fn, args, min_ns)
    return lambda: _loop_ns(fn, args, number) / number


def interleave(samplers: dict[str, Callable[[], float]], reps: int) -> dict[str, list[float]]:
    """A, B, C, A, B, C, ...: each rep samples every variant once, so drift hits all alike."""
    samples: dict[str, list[float]] = {name: [] for name in samplers}
    for _ in range(reps):
        for name, sample in samplers.items():
            samples[name].append(sample())
    return samples


def timed_ms(fn: Callable[[], Any], before: Callable[[], Any] | None = None) -> Callable[[], float]:
    """A sampler of one call of fn in milliseconds; `before` runs untimed first (a reset)."""

    def sample() -> float:
        if before is not None:
            before()
        gc.collect()  # start every step sample from the same heap, not mid-collection
        start = time.perf_counter_ns()
        fn()
        return (time.perf_counter_ns() - start) / 1e6

    return sample
