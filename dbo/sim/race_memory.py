"""The race checker's memory records: blocks of addresses with their access histories, the
live storages over them, and freed blocks the caching allocator may hand on.

A `Block` is shared by every storage whose bytes overlap it; an `Entry` is one access in its
history, made by a `Placed` op; a `Freed` block keeps the accesses no later work is ordered
after, for the next allocation of the same rounded size on its stream (`rounded`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from dbo.sim.footprints import Dims
from dbo.sim.records import Access, OpRecord
from dbo.sim.tracks import Track

__all__ = [
    "ALLOC_ROUND",
    "Block",
    "Entry",
    "Freed",
    "Placed",
    "Storage",
    "on_death",
    "ordered",
    "rounded",
]

ALLOC_ROUND = 512  # the caching allocator rounds every request up to this many bytes


@dataclass(slots=True)
class Entry:
    """One access in a block's history: its bytes, and the placed op that made it."""

    start: int
    end: int
    run: int
    dims: Dims
    is_write: bool
    track: int
    epoch: int
    record: OpRecord
    stack: Any
    argument: str
    freed_alloc: Any = None  # set on a hazard inherited from a freed block

    @classmethod
    def of(cls, access: Access, here: Placed) -> Entry:
        """`access`, made by the op being checked."""
        return cls(
            access.start,
            access.end,
            access.run,
            access.dims,
            access.is_write,
            here.track,
            here.epoch,
            here.record,
            here.stack,
            access.argument,
        )

    def moved(self, delta: int, freed_alloc: Any) -> Entry:
        return replace(
            self, start=self.start + delta, end=self.end + delta, freed_alloc=freed_alloc
        )


class Placed(NamedTuple):
    """The op whose accesses are being checked: its record, its timeline's index and vector
    clock, its epoch there, and the user stack that issued it."""

    record: OpRecord
    track: int
    vc: Sequence[int]
    epoch: int
    stack: Any


class Block:
    """A range of addresses and the accesses to it; shared by storages over its bytes."""

    __slots__ = ("alloc_stack", "alloc_track", "end", "entries", "recorded", "start", "storages")

    def __init__(self, start: int, end: int) -> None:
        self.start = start
        self.end = end
        self.entries: list[Entry] = []
        self.storages: set[Storage] = set()  # by identity: a dead one's key may be reused
        self.alloc_track: Track | None = None  # set when the allocation was seen
        self.alloc_stack: Any = None
        self.recorded: list[Track] = []  # streams named by record_stream


class Storage:
    """One live storage object. `key` (the StorageImpl's address) is reused as soon as the
    storage dies, so a record found by key counts only while `ref` still names the object."""

    __slots__ = ("base", "block", "finalizer", "key", "nbytes", "ref")

    def __init__(self, key: int, base: int, nbytes: int, block: Block, st: Any) -> None:
        self.key = key
        self.base = base
        self.nbytes = nbytes
        self.block = block
        self.ref = weakref.ref(st)
        self.finalizer: Any = None

    def names(self, st: Any) -> bool:
        """True while this record describes the storage object `st`."""
        return self.ref() is st and self.base == st.data_ptr() and self.nbytes == st.nbytes()


class Freed:
    """A freed block whose history still holds accesses no later work is ordered after."""

    __slots__ = ("alloc_stack", "entries")

    def __init__(self, entries: list[Entry], alloc_stack: Any) -> None:
        self.entries = entries  # addresses relative to the block's start
        self.alloc_stack = alloc_stack


def ordered(e: Entry, track_index: int, vc: Sequence[int]) -> bool:
    return e.track == track_index or (e.track < len(vc) and vc[e.track] >= e.epoch)


def on_death(dead: list, rec: Storage) -> None:
    # Runs when a storage object dies (any thread, any moment): only snapshot the clocks
    # that say what the free is ordered after; RaceChecker._reap does the rest.
    block = rec.block
    snap = None
    if block.alloc_track is not None:
        track = block.alloc_track
        snap = (list(track.vc), [(t.index, list(t.vc)) for t in block.recorded])
    dead.append((rec, snap))


def rounded(nbytes: int) -> int:
    return -(-max(nbytes, 1) // ALLOC_ROUND) * ALLOC_ROUND
