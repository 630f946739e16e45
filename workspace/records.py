"""Small immutable records the manager hands out: growth history, buffer identity, stats."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["GrowthRecord", "BufferInfo", "WorkspaceStats"]

_MB = float(1 << 20)


@dataclass(frozen=True, slots=True)
class GrowthRecord:
    """One synchronous growth of every ubatch's slot of one lane."""

    caller: str  # "file:line:function" of the first frame outside the workspace package
    old_bytes: int  # per-slot capacity before
    new_bytes: int  # per-slot capacity after
    num_slots: int  # slots grown: one per ubatch
    # Bytes of the replaced buffers that outstanding views still kept alive at release time.
    orphaned_bytes: int = 0
    lane: int = 0  # the workspace lane whose slots grew (only that lane's slots change)
    step: str = ""  # the run it served ("the profile run (ubatched: 2 ubatches, 16 tokens)")


@dataclass(frozen=True, slots=True)
class BufferInfo:
    """Which slot buffer a device pointer falls in (see `WorkspaceManager.describe_buffer`)."""

    label: str  # e.g. "workspace slot 1"
    slot: int
    generation: int  # the slot's generation when this buffer was installed (1 = first buffer)
    data_ptr: int  # start of the buffer, not the queried pointer
    nbytes: int
    live: bool  # False once the slot has been given a newer buffer
    offset: int = 0  # queried pointer minus data_ptr
    # For a former buffer: its memory is still held by views (an orphan), so the pointer
    # still addresses this buffer and not something allocated later at the same address.
    still_allocated: bool = True


@dataclass(frozen=True, slots=True)
class WorkspaceStats:
    """A consistent snapshot of one manager's state."""

    device: torch.device
    num_ubatches: int
    capacities: tuple[int, ...]  # bytes per slot (a lane's slots are equal after every growth)
    generations: tuple[int, ...]  # buffer replacements per slot
    locked: bool
    growths: tuple[GrowthRecord, ...]
    failed_growths: int
    allocations: int  # calls of `_allocate`, rollbacks included
    peak_bytes: int  # most slot-buffer bytes alive at once, orphans included
    orphaned_bytes: int  # bytes of replaced buffers still alive now
    orphaned_buffers: int  # how many replaced buffers are still alive now
    orphaning_growths: int  # cumulative growths that left at least one buffer alive
    num_lanes: int = 1  # capacities/generations are indexed ubatch * num_lanes + lane
    persistent_resources: int = 0  # keyed resources held, over every (ubatch, lane)

    @property
    def total_bytes(self) -> int:
        """Bytes held by the current slot buffers (orphans not included)."""
        return sum(self.capacities)

    def summary(self) -> str:
        """One line for reports and logs."""
        sizes = ", ".join(f"{c / _MB:.2f}" for c in self.capacities)
        return (
            f"workspace on {self.device}: {len(self.capacities)} slot(s) "
            f"({self.num_ubatches} ubatch(es) x {self.num_lanes} lane(s)) [{sizes}] MB, "
            f"{'locked' if self.locked else 'unlocked'}, {len(self.growths)} growth(s), "
            f"peak {self.peak_bytes / _MB:.2f} MB, orphaned {self.orphaned_bytes / _MB:.2f} MB "
            f"in {self.orphaned_buffers} buffer(s) ({self.orphaning_growths} growth(s) orphaned "
            f"a buffer)"
        )
