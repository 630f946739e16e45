"""Race checker: happens-before by vector clocks over the bytes of memory each op touches.

Accesses. For every placed op the checker parses the op's arguments and outputs itself (as
the CUDA sanitizer's argument handler does): each tensor argument is read, or written where
its schema says `(a!)`, under its argument name; returned tensors are written as "output". An
access is the exact byte footprint of the tensor in memory: a dense interval for a contiguous
tensor (the cheap path), otherwise a base, a contiguous run and (count, stride) dimensions.
Sparse and nested tensors are mapped through their component tensors; a tensor with no
addressable memory (MKL-DNN's opaque layout) is placed without a check and noted once.

Memory. Histories are keyed by memory, not by storage object: every live storage belongs to
one block of addresses, and storages whose bytes overlap (`torch.from_dlpack`, a second
storage over the same allocation) share one block. When the last storage of a block dies,
the block leaves the address index, so a later allocation at the same address starts clean.
A storage is known by its StorageImpl's address, which a new storage may take the moment the
old one dies: dead records are reaped before every lookup, and a record answers only for the
very storage object it was made for.

Allocator hazards. Freed memory is handed on as the CUDA caching allocator would: to the next
allocation of the same rounded size on the stream that allocated it. Accesses to the freed
block that are ordered neither before the allocating stream's position at the free (stream
order covers those) nor before a stream named by `record_stream` (the allocator waits for
those) stay in the block's history and move to the new tensor: an unordered access to it is
reported as a race with the freed tensor's access. Writes on a transfer track (low-latency
data in flight) are not such hazards: they land in registered communication buffers, which
the allocator never hands on.

Check. An earlier access A on timeline X at epoch a happens before the current op on timeline
T iff X == T (issue order) or T's vector clock has entry X >= a. Two accesses sharing a byte,
at least one a write, neither ordered before the other: a race, reported once per pair of
ops as a `RaceReport`. History stays bounded: an entry is dropped when a later dense access
covers it, is ordered after it and makes it redundant (a write covers anything; a read covers
reads only), and a device-wide synchronize clears everything.
"""

from __future__ import annotations

import bisect
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from dbo.sim.footprints import canonical_footprint, footprint, footprints_meet
from dbo.sim.race_memory import (
    Block,
    Entry,
    Freed,
    Placed,
    Storage,
    on_death,
    ordered,
    rounded,
)
from dbo.sim.records import Access, OpRecord, OpSite, RaceReport
from dbo.sim.stacks import format_stack, user_stack
from dbo.sim.tracks import Track
from dbo.switch_notes import last_plain_switch

__all__ = [
    "MAX_REPORTS",
    "RaceChecker",
    "RaceError",
    "RaceSink",
    "footprint",
    "footprints_meet",
    "user_stack",
]

MAX_REPORTS = 1000  # a broken schedule races on every layer; the first reports say enough
POOL_DEPTH = 8  # freed blocks with pending hazards kept per (stream, size); older ones drop

# Where the checker hands each race it finds (the device keeps, raises or warns).
RaceSink = Callable[[RaceReport], None]


class RaceError(RuntimeError):
    """Raised on a race when the device's race_action is "raise"."""

    def __init__(self, report: RaceReport) -> None:
        super().__init__(report.describe())
        self.report = report


# ------------------------------------------------------------------------------ memory


class _ArgSpec:
    """Per op overload: each schema argument's name and whether the op writes it."""

    __slots__ = ("by_name", "positional")

    def __init__(self, func: Any) -> None:
        args = func._schema.arguments
        self.positional = tuple(
            (a.name, a.alias_info is not None and a.alias_info.is_write) for a in args
        )
        self.by_name = {name: w for name, w in self.positional}


_SPECS: dict[Any, _ArgSpec] = {}


def _components(t: torch.Tensor) -> list[torch.Tensor] | None:
    """The strided tensors that hold a sparse or nested tensor's data; None if opaque."""
    layout = t.layout
    try:
        if layout == torch.sparse_coo:
            return [t._indices(), t._values()]
        if layout in (torch.sparse_csr, torch.sparse_bsr):
            return [t.crow_indices(), t.col_indices(), t.values()]
        if layout in (torch.sparse_csc, torch.sparse_bsc):
            return [t.ccol_indices(), t.row_indices(), t.values()]
        if t.is_nested:
            return [t.values()]
    except (RuntimeError, NotImplementedError):
        return None
    return None


class RaceChecker:
    """Access history by memory block of one device, checked at every placed op."""

    def __init__(self, on_race: RaceSink, transfer_tracks: Iterable[int] = ()) -> None:
        self._on_race = on_race  # every race found, once per pair of ops
        # Timelines of data in flight between GPUs (low-latency transfers): their writes land
        # in registered communication buffers, which the caching allocator never hands on.
        self._transfer_tracks = frozenset(transfer_tracks)
        self._storages: dict[int, Storage] = {}  # StorageImpl address -> live storage
        self._starts: list[int] = []  # sorted block starts (blocks are disjoint)
        self._blocks: list[Block] = []
        self._dead: list[tuple[Storage, Any]] = []  # appended by finalizers, any thread
        self._pool: dict[tuple[int, int], list[Freed]] = {}
        self._reported: set[tuple[int, int, int]] = set()
        self.notes: list[str] = []  # tensors placed without a check, one line per kind

    def clear(self) -> None:
        """Forget every access (all earlier work is ordered before all later work)."""
        if self._dead:
            self._reap()
        for block in self._blocks:
            block.entries = []
        self._pool.clear()
        self._reported.clear()

    # -------------------------------------------------------------------------- inspection

    @property
    def num_blocks(self) -> int:
        """Memory blocks with a live storage the checker knows."""
        if self._dead:
            self._reap()
        return len(self._blocks)

    def ops_at(self, address: int) -> list[str]:
        """Names of the ops in the history of the live memory at `address` (oldest first)."""
        if self._dead:
            self._reap()
        i = bisect.bisect_right(self._starts, address) - 1
        if i < 0 or self._blocks[i].end <= address:
            return []
        return [e.record.name for e in self._blocks[i].entries]

    # ------------------------------------------------------------------ storages, blocks

    def _storage(self, st: Any) -> tuple[Storage, bool]:
        """The live record of a storage object, registering it on first sight."""
        # Reap first: a new storage can take the address (and so the key) of one that died
        # since the last reap, and that dead record must not answer for it.
        if self._dead:
            self._reap()
        key = st._cdata
        rec = self._storages.get(key)
        if rec is not None:
            if rec.names(st):
                return rec, False
            # The object's memory changed under it (`resize_` reallocates in place): the old
            # memory was freed, so the record dies now, as its finalizer would have said.
            rec.finalizer.detach()
            on_death(self._dead, rec)
            self._reap()
        base, nbytes = st.data_ptr(), st.nbytes()
        block = self._block_for(base, base + max(nbytes, 1))
        rec = Storage(key, base, nbytes, block, st)
        block.storages.add(rec)
        self._storages[key] = rec
        # The callback holds the dead list, not the checker: a long-lived tensor must not
        # keep its device alive.
        rec.finalizer = weakref.finalize(st, on_death, self._dead, rec)
        return rec, True

    def _block_for(self, start: int, end: int) -> Block:
        """The block over [start, end): new, or the union of the live blocks it overlaps."""
        i = bisect.bisect_left(self._starts, end)
        j = i
        while j > 0 and self._blocks[j - 1].end > start:
            j -= 1
        if i == j:
            block = Block(start, end)
            self._starts.insert(i, start)
            self._blocks.insert(i, block)
            return block
        merged = self._blocks[j:i]
        block = merged[0]
        for other in merged[1:]:
            block.entries.extend(other.entries)
            block.storages |= other.storages
            block.recorded.extend(other.recorded)
            block.alloc_track = block.alloc_track or other.alloc_track
            block.alloc_stack = block.alloc_stack or other.alloc_stack
            for rec in other.storages:
                rec.block = block
        block.start, block.end = min(block.start, start), max(block.end, end)
        self._starts[j:i] = [block.start]
        self._blocks[j:i] = [block]
        return block

    def _reap(self) -> None:
        while self._dead:
            rec, snap = self._dead.pop()
            if self._storages.get(rec.key) is rec:
                del self._storages[rec.key]
            block = rec.block
            block.storages.discard(rec)
            if block.storages:
                continue
            i = bisect.bisect_left(self._starts, block.start)
            while i < len(self._blocks) and self._blocks[i] is not block:
                i += 1
            if i < len(self._blocks):
                del self._starts[i], self._blocks[i]
            if snap is not None and block.entries:
                self._free(block, snap)

    def _free(self, block: Block, snap: Any) -> None:
        """Pool a freed block's accesses that nothing orders before a reuse."""
        track = block.alloc_track
        assert track is not None
        alloc_vc, recorded = snap
        pending = [
            e.moved(-block.start, None)
            for e in block.entries
            if e.track not in self._transfer_tracks
            and not ordered(e, track.index, alloc_vc)
            and not any(ordered(e, i, vc) for i, vc in recorded)
        ]
        if not pending:
            return
        key = (track.index, rounded(block.end - block.start))
        pool = self._pool.setdefault(key, [])
        pool.append(Freed(pending, block.alloc_stack))
        del pool[:-POOL_DEPTH]

    def allocated(self, t: torch.Tensor, track: Track, stack: Any) -> None:
        """`t`'s storage was just allocated on `track` by an op that launches no kernel."""
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        rec, _ = self._storage(st)
        if rec.block.alloc_track is None:
            self._take_from_pool(rec, track, stack)

    def record_stream(self, t: torch.Tensor, track: Track) -> None:
        """The allocator must not reuse `t`'s memory before `track`'s work at the free."""
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        block = self._storage(st)[0].block
        if all(r is not track for r in block.recorded):
            block.recorded.append(track)

    # ------------------------------------------------------------------------- accesses

    def parse(self, func: Any, args: tuple, kwargs: dict, out: Any) -> tuple[list, list, list]:
        """(reads, writes, fresh storage keys) of one executed op, from its schema."""
        spec = _SPECS.get(func)
        if spec is None:
            spec = _SPECS[func] = _ArgSpec(func)
        found: dict[tuple, list] = {}  # storage + footprint -> [is_write, names]
        fresh: list[int] = []
        add = self._add_tensor
        positional = spec.positional
        for i, value in enumerate(args):
            if isinstance(value, torch.Tensor):
                name, w = positional[i]
                add(value, w, name, found, None)
            elif isinstance(value, (list, tuple)):
                name, w = positional[i] if i < len(positional) else ("", False)
                for v in value:
                    if isinstance(v, torch.Tensor):
                        add(v, w, name, found, None)
        for name, value in kwargs.items():
            self._add(value, spec.by_name.get(name, False), name, found, None)
        self._add(out, True, "output", found, fresh)
        reads: list[Access] = []
        writes: list[Access] = []
        for (key, start, end, run, dims), (w, names) in found.items():
            argument = names[0] if len(names) == 1 else ", ".join(names)
            (writes if w else reads).append(Access(key, start, end, w, dims, run, argument))
        return reads, writes, fresh

    def _add(self, value: Any, w: bool, name: str, found: dict, fresh: list | None) -> None:
        if isinstance(value, torch.Tensor):
            self._add_tensor(value, w, name, found, fresh)
        elif isinstance(value, (list, tuple)):
            for v in value:
                if isinstance(v, torch.Tensor):
                    self._add_tensor(v, w, name, found, fresh)

    def _add_tensor(self, t: torch.Tensor, w: bool, name: str, found: dict, fresh: Any) -> None:
        try:
            st = t.untyped_storage()
            n = t.numel()
            if n == 0:
                return
            if t.is_contiguous():  # the cheap path: one dense interval
                start = t.data_ptr()
                fp: tuple = (start, start + n * t.element_size(), 0, ())
            else:
                fp = canonical_footprint(t.data_ptr(), t.shape, t.stride(), t.element_size())
        except (RuntimeError, NotImplementedError):
            parts = _components(t)
            if parts is None:
                self._note(t)
                return
            for part in parts:
                self._add_tensor(part, w, name, found, fresh)
            return
        key = st._cdata
        new = self._storage(st)[1]
        if new and fresh is not None:
            fresh.append(key)
        slot_key = (key, *fp)
        slot = found.get(slot_key)
        if slot is None:
            found[slot_key] = [w, [name]]
        else:
            slot[0] = slot[0] or w
            if name not in slot[1]:
                slot[1].append(name)

    def _note(self, t: torch.Tensor) -> None:
        what = f"{t.layout} tensors are placed without a race check (no addressable memory)"
        if what not in self.notes:
            self.notes.append(what)
            warnings.warn(what, RuntimeWarning, stacklevel=2)

    # ------------------------------------------------------------------------------ check

    def on_op(
        self,
        record: OpRecord,
        track: Track,
        epoch: int,
        reads: Sequence[Access],
        writes: Sequence[Access],
        stack: Any = None,
        fresh: Iterable[int] = (),
    ) -> None:
        """Check one op's accesses against the history, then add them (lock held)."""
        if self._dead:
            self._reap()
        for key in fresh:
            rec = self._storages.get(key)
            if rec is not None and rec.block.alloc_track is None:
                self._take_from_pool(rec, track, stack)
        here = Placed(record, track.index, track.vc, epoch, stack)
        for access in (*reads, *writes):
            rec = self._storages.get(access.storage)
            if rec is not None:
                self._check(access, rec, here)

    def _take_from_pool(self, rec: Storage, track: Track, stack: Any) -> None:
        """A new allocation on `track`: the allocator may hand it a freed block of the same
        rounded size from that stream's pool, and with it the block's pending accesses."""
        block = rec.block
        block.alloc_track, block.alloc_stack = track, stack
        pool = self._pool.get((track.index, rounded(rec.nbytes)))
        if pool:
            freed = pool.pop()
            block.entries.extend(e.moved(block.start, freed.alloc_stack) for e in freed.entries)

    def _check(self, access: Access, rec: Storage, here: Placed) -> None:
        block, me, vc = rec.block, here.track, here.vc
        s, e, w, dims = access.start, access.end, access.is_write, access.dims
        keep: list[Entry] = []
        for old in block.entries:
            if old.end <= s or e <= old.start:
                keep.append(old)
                continue
            if old.track == me or (old.track < len(vc) and vc[old.track] >= old.epoch):
                if (
                    old.start >= s
                    and old.end <= e
                    and (w or not old.is_write)
                    and (not dims or (old.dims == dims and old.run == access.run))
                ):
                    continue  # redundant: any later conflict with `old` conflicts with us
            elif (w or old.is_write) and (
                not (dims or old.dims)
                or footprints_meet(
                    (s, e, access.run, dims), (old.start, old.end, old.run, old.dims)
                )
            ):
                self._report(access, rec, old, here)
            keep.append(old)
        keep.append(Entry.of(access, here))
        block.entries = keep

    def _report(self, access: Access, rec: Storage, old: Entry, here: Placed) -> None:
        record, stack = here.record, here.stack
        key = (access.storage, old.record.seq, record.seq)
        if key in self._reported:
            return
        self._reported.add(key)
        base = rec.base
        first = OpSite(
            op=old.record.name,
            ubatch=old.record.ubatch,
            stream=old.record.stream,
            start=old.start - base,
            end=old.end - base,
            is_write=old.is_write,
            stack=format_stack(old.stack),
            argument=old.argument,
        )
        second = OpSite(
            op=record.name,
            ubatch=record.ubatch,
            stream=record.stream,
            start=access.start - base,
            end=access.end - base,
            is_write=access.is_write,
            stack=format_stack(stack),
            argument=access.argument,
            switched_at=_switched_at(record.stream),
        )
        report = RaceReport(
            storage=access.storage,
            first=first,
            second=second,
            allocation=format_stack(rec.block.alloc_stack),
            freed_allocation=None if old.freed_alloc is None else format_stack(old.freed_alloc),
        )
        self._on_race(report)


def _switched_at(stream: str) -> str:
    """The plain switch onto `stream` the issuing thread still stands on (it issues the later
    access of the race, so its note is the one that matters), or ""."""
    switch = last_plain_switch()
    return switch.describe() if switch is not None and switch.stream == stream else ""
