"""What to draw: a run's records (`TraceRun`) and the time window a user asks for.

A window is virtual microseconds (`100:400`) or MoE layers (`layers=0:2`, counted by the
dispatches of the lowest ubatch that dispatches); `windowed` keeps what overlaps it. The
Chrome trace (`dbo.sim.trace`) and the PNG timeline (`dbo.sim.plot`) both draw `TraceRun`s.
The CLI parses a `--window` value into a `WindowSpec` itself, so that a malformed one is
refused without importing this package (and torch with it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from dbo.sim.records import EventWait, HostRange, OpRecord, RaceReport

__all__ = ["TraceRun", "Window", "WindowSpec", "layer_starts", "windowed"]


@dataclass(frozen=True)
class TraceRun:
    """One run to draw: its records and what the device noted beside them. Runs of one trace
    share the time axis (each starts at its device's reset) and are stacked in order."""

    label: str | None  # "serial", "DBO"; None for a lone run (processes named "rank N")
    records: Sequence[OpRecord]
    races: Sequence[RaceReport] = ()
    waits: Sequence[EventWait] = ()
    ranges: Sequence[HostRange] = ()


@dataclass(frozen=True)
class Window:
    """A time window [start_us, end_us] of virtual time: only what overlaps it is drawn."""

    start_us: float
    end_us: float

    def __post_init__(self) -> None:
        # The CLI makes these two checks, in these words, before it imports this module.
        if not (math.isfinite(self.start_us) and math.isfinite(self.end_us)):
            raise ValueError(f"window bounds must be finite, got {self.start_us}:{self.end_us}")
        if self.end_us <= self.start_us:
            raise ValueError(
                f"window end ({self.end_us}) must be after its start ({self.start_us})"
            )

    def holds(self, start_us: float, end_us: float) -> bool:
        return end_us >= self.start_us and start_us <= self.end_us


@dataclass(frozen=True)
class WindowSpec:
    """A window as a user gives it: virtual microseconds, or MoE layers [first, stop)."""

    start: float
    end: float
    unit: str  # "us" or "layers"

    def resolve(self, records: Sequence[OpRecord]) -> Window:
        """The time window of these records that the spec names."""
        if self.unit == "us":
            return Window(self.start, self.end)
        starts = layer_starts(records)
        first, stop = int(self.start), int(self.end)
        if first >= len(starts):
            raise ValueError(
                f"window layers={first}:{stop}: the run has {len(starts)} MoE layer(s) "
                f"(counted by dispatches), numbered from 0"
            )
        end = starts[stop] if stop < len(starts) else max(r.end_us for r in records)
        return Window(starts[first], end)


def layer_starts(records: Sequence[OpRecord]) -> list[float]:
    """Where each MoE layer starts, counted by dispatches: the start of each dispatch op of
    the lowest ubatch that dispatches (a serial run's, else ubatch 0's). A layer thus runs
    from one dispatch to the next; dense layers before the first MoE layer are not counted."""
    dispatches = [r for r in records if r.name.endswith("dispatch")]
    if not dispatches:
        return []
    first = min((r.ubatch for r in dispatches), key=lambda u: -1 if u is None else u)
    return sorted(r.start_us for r in dispatches if r.ubatch == first)


def windowed(run: TraceRun, window: Window | None) -> TraceRun:
    """The part of `run` that overlaps `window` (all of it when window is None)."""
    if window is None:
        return run
    records = [r for r in run.records if window.holds(r.start_us, r.end_us)]
    ranges = [g for g in run.ranges if window.holds(g.start_us, g.end_us)]
    waits = [w for w in run.waits if window.holds(w.record_us, w.record_us)]
    return TraceRun(run.label, records, run.races, waits, ranges)
