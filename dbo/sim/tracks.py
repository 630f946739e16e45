"""One in-order timeline of a simulated device (`Track`) and the vector clocks that order them.

A stream's handle, the device clock and the race checker all read the same `Track`; it sits
below all three so that none of them has to import another to name it.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["Track", "VectorClock", "join"]

# One entry per timeline of a device: entry i is how much of timeline i is ordered before.
VectorClock = list[int]


def join(into: VectorClock, other: Sequence[int]) -> bool:
    """into = max(into, other) elementwise; True when `into` changed."""
    changed = False
    if len(into) < len(other):
        into.extend([0] * (len(other) - len(into)))
    for i, v in enumerate(other):
        if v > into[i]:
            into[i] = v
            changed = True
    return changed


class Track:
    """One in-order timeline: a stream, or the link track of low-latency transfers.

    `free_at` is when the work issued so far ends; `vc[index]` counts the ops placed here, so
    an op's epoch is that entry right after it; `host_gen` is the host-sync generation already
    joined into `vc` (work launched after a host sync is ordered after what the host waited
    for)."""

    __slots__ = ("index", "name", "free_at", "vc", "host_gen")

    def __init__(self, index: int, name: str) -> None:
        self.index = index
        self.name = name
        self.free_at = 0.0
        self.vc: VectorClock = [0] * (index + 1)
        self.host_gen = 0

    def reset(self) -> None:
        self.free_at = 0.0
        self.vc = [0] * (self.index + 1)
        self.host_gen = 0
