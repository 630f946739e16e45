"""Kernels that ran side by side on two streams, and how much slower than alone.

One job: from device records alone, how fast a kernel progresses while a kernel on another
stream runs. The rules, fixed before looking at any step time (they are the ones the
simulator's overlap rates were derived with, `HardwareProfile.overlap_rates`):

- A kernel's shared time is the sum of its overlaps with work (kernels, copies, memsets) on
  every other stream.
- Roles: kernels on the compute stream are "compute"; kernels on any other stream are the
  local comm ops, "full_grid" (the simulator's name for a kernel that takes the whole GPU).
- A kernel's signature is its name, grid and block. Its solo time is a duration of the same
  signature that shared no time with another stream; kernels of one signature can run
  different shapes, so the solo time taken is the largest one not above the kernel's own
  duration (it never overstates a slowdown). A kernel with no such duration is left out.
- Per role, over its kernels that shared time: rate = 1 - (sum of duration minus solo time) /
  (sum of shared time), clamped to [0.01, 1]. 1: a neighbour costs nothing; near 0: the kernel
  stands still while the neighbour runs. Slowdown = sum of duration / sum of solo time.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from dbo.sim.records import COMM, COMPUTE, OpRecord

__all__ = ["RoleOverlap", "SideBySide", "shared_times", "side_by_side"]

ROLES = ("compute", "full_grid")
_NOT_KERNELS = ("memcpy", "memset")


@dataclass
class RoleOverlap:
    """Side-by-side totals of one role (or one kernel class)."""

    kernels: int = 0
    shared_us: float = 0.0  # time shared with the other streams' work
    duration_us: float = 0.0  # the overlapped kernels' own durations
    solo_us: float = 0.0  # what the same kernels took alone

    @property
    def excess_us(self) -> float:
        return self.duration_us - self.solo_us

    @property
    def rate(self) -> float | None:
        if self.shared_us <= 0:
            return None
        return min(1.0, max(0.01, 1.0 - self.excess_us / self.shared_us))

    @property
    def slowdown(self) -> float | None:
        return self.duration_us / self.solo_us if self.solo_us > 0 else None

    def add(self, duration: float, solo: float, shared: float) -> None:
        self.kernels += 1
        self.duration_us += duration
        self.solo_us += solo
        self.shared_us += shared

    def to_dict(self) -> dict:
        return {
            "kernels": self.kernels,
            "shared_us": round(self.shared_us, 3),
            "duration_us": round(self.duration_us, 3),
            "solo_us": round(self.solo_us, 3),
            "rate": None if self.rate is None else round(self.rate, 3),
            "slowdown": None if self.slowdown is None else round(self.slowdown, 3),
        }


@dataclass
class SideBySide:
    """What running side by side cost, per role and per kernel class; `worst` lists the
    kernels slowed the most (name, class, role, duration, solo, shared)."""

    roles: dict[str, RoleOverlap] = field(default_factory=lambda: {r: RoleOverlap() for r in ROLES})
    classes: dict[str, RoleOverlap] = field(default_factory=dict)
    worst: list[tuple[str, str, str, float, float, float]] = field(default_factory=list)
    unmatched: int = 0  # overlapped kernels with no solo run of their signature

    @property
    def shared_us(self) -> float:
        """Half the summed shared time of the kernels that had a solo instance to compare
        against (each such pair counted once); the step's whole time with both streams busy
        is `StepFigures.both_busy_us`."""
        return sum(r.shared_us for r in self.roles.values()) / 2

    def rates(self) -> dict[str, float]:
        """The simulator's `overlap_rates`, empty unless both roles have a rate."""
        rates = {k: r.rate for k, r in self.roles.items()}
        if any(v is None for v in rates.values()):
            return {}
        return {k: round(v, 3) for k, v in rates.items() if v is not None}

    def to_dict(self) -> dict:
        return {
            "roles": {k: v.to_dict() for k, v in self.roles.items()},
            "classes": {k: v.to_dict() for k, v in sorted(self.classes.items())},
            "overlap_rates": self.rates(),
            "shared_us": round(self.shared_us, 3),
            "unmatched": self.unmatched,
            "worst": [
                {
                    "kernel": n,
                    "class": c,
                    "role": r,
                    "us": round(d, 3),
                    "solo_us": round(s, 3),
                    "shared_us": round(o, 3),
                }
                for n, c, r, d, s, o in self.worst
            ],
        }


def shared_times(records: Sequence[OpRecord]) -> list[float]:
    """Per record, the summed time it overlaps work on other streams. Work on one stream is
    sequential, so each other stream's records are searched by bisection."""
    by_stream: dict[str, list[OpRecord]] = {}
    for r in records:
        if r.kind in (COMPUTE, COMM):
            by_stream.setdefault(r.stream, []).append(r)
    index = {}
    for stream, recs in by_stream.items():
        recs.sort(key=lambda r: r.start_us)
        index[stream] = ([r.start_us for r in recs], recs)
    out = []
    for r in records:
        shared = 0.0
        if r.kind in (COMPUTE, COMM):
            for stream, (starts, recs) in index.items():
                if stream == r.stream:
                    continue
                k = bisect.bisect_left(starts, r.end_us)
                while k > 0:
                    k -= 1
                    other = recs[k]
                    overlap = min(r.end_us, other.end_us) - max(r.start_us, other.start_us)
                    if overlap > 0:
                        shared += overlap
                    elif other.end_us <= r.start_us:
                        break  # earlier work on a sequential stream ends earlier still
        out.append(shared)
    return out


def _signature(r: OpRecord) -> tuple[str, str, str]:
    return (str(r.args.get("kernel", r.name)), str(r.args.get("grid")), str(r.args.get("block")))


def side_by_side(records: Sequence[OpRecord], compute_stream: str = "compute") -> SideBySide:
    """The side-by-side figures of these records (rules in the module docstring)."""
    records = [r for r in records if r.kind in (COMPUTE, COMM)]
    out = SideBySide()
    solo: dict[tuple, list[float]] = {}
    overlapped = []
    for r, shared in zip(records, shared_times(records)):
        if r.args.get("class") in _NOT_KERNELS:
            continue
        if shared > 0:
            overlapped.append((r, shared))
        else:
            solo.setdefault(_signature(r), []).append(r.dur_us)
    for durations in solo.values():
        durations.sort()
    worst = []
    for r, shared in overlapped:
        durations = solo.get(_signature(r), [])
        k = bisect.bisect_right(durations, r.dur_us)
        if k == 0:
            out.unmatched += 1
            continue
        alone = durations[k - 1]
        role = "compute" if r.stream == compute_stream else "full_grid"
        cls = str(r.args.get("class", "other"))
        out.roles[role].add(r.dur_us, alone, shared)
        out.classes.setdefault(cls, RoleOverlap()).add(r.dur_us, alone, shared)
        worst.append((r.name, cls, role, r.dur_us, alone, shared))
    worst.sort(key=lambda w: w[4] - w[3])  # largest excess first
    out.worst = worst[:8]
    return out
