"""Race checker: happens-before by vector clocks over byte ranges of storages.

Every placed op hands in its accesses (`Access`: storage identity, byte range, read/write)
together with its timeline and epoch (its timeline's own vector-clock entry right after it).
An earlier access A on timeline X at epoch a happens before the current op on timeline T iff
X == T (issue order) or T's vector clock has entry X >= a. Two accesses to overlapping bytes
of one storage, at least one a write, neither ordered before the other: a race, reported once
per pair of ops as a `RaceReport`.

Keys: the storage's StorageImpl address (`untyped_storage()._cdata`), which is unique while
the storage lives; the storage's Python object is preserved by torch, so a weakref finalizer
drops its history when it dies (an allocator reusing the address then starts clean), and a
freshly allocated op output resets it too. Ranges are a conservative span: from the first to
one past the last byte any element of the view can touch (a strided view covers its gaps).

Memory stays bounded: an entry is pruned when a newer access covers its bytes, is ordered
after it, and makes it redundant (a write covers anything; a read covers reads only), and a
device-wide synchronize clears everything (all earlier work is then ordered before all later).
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any, Sequence

import torch

from dbo.sim.records import Access, OpRecord, OpSite, RaceReport

if TYPE_CHECKING:
    from dbo.sim.device import SimDevice, _Track

__all__ = ["RaceChecker", "RaceError", "user_stack", "storage_span"]

MAX_REPORTS = 1000  # a broken schedule races on every layer; the first reports say enough

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_SIM_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_SKIP_FILES = ("threading.py", "contextlib.py")


class RaceError(RuntimeError):
    """Raised on a race when the device's race_action is "raise"."""

    def __init__(self, report: RaceReport) -> None:
        super().__init__(report.describe())
        self.report = report


def user_stack(depth: int = 4, skip: int = 1) -> tuple[tuple[str, int, str], ...]:
    """The innermost `depth` frames outside torch, dbo.sim and stdlib context plumbing, as raw
    (file, line, function) tuples, innermost last. Raw so that capturing stays cheap; format
    only when a race is reported."""
    frames: list[tuple[str, int, str]] = []
    f = sys._getframe(skip)
    while f is not None and len(frames) < depth:
        filename = f.f_code.co_filename
        if not (
            filename.startswith(_TORCH_DIR)
            or filename.startswith(_SIM_DIR)
            or filename.endswith(_SKIP_FILES)
        ):
            frames.append((filename, f.f_lineno, f.f_code.co_name))
        f = f.f_back
    frames.reverse()
    return tuple(frames)


def _format_stack(raw: tuple[tuple[str, int, str], ...]) -> tuple[str, ...]:
    return tuple(f"{os.path.relpath(fn) if fn.startswith(os.getcwd()) else fn}:{ln}:{name}" for fn, ln, name in raw)


def storage_span(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(storage key, first byte, one past the last byte) a tensor's elements may touch, or
    None for an empty or storage-less (meta) tensor."""
    if t.device.type == "meta":
        return None
    n = t.numel()
    if n == 0:
        return None
    size = t.element_size()
    first = t.storage_offset()
    last = first
    for dim, stride in zip(t.shape, t.stride()):
        last += (dim - 1) * stride
    return t.untyped_storage()._cdata, first * size, (last + 1) * size


class _Entry:
    __slots__ = ("start", "end", "is_write", "track", "epoch", "record", "stack")

    def __init__(self, start: int, end: int, is_write: bool, track: int, epoch: int, record: OpRecord, stack: Any) -> None:
        self.start = start
        self.end = end
        self.is_write = is_write
        self.track = track
        self.epoch = epoch
        self.record = record
        self.stack = stack


class RaceChecker:
    """Per-storage access history of one device, checked at every placed op."""

    def __init__(self, device: "SimDevice") -> None:
        self.device = device
        self._history: dict[int, list[_Entry]] = {}
        self._watched: set[int] = set()
        self._dead: list[int] = []  # keys whose storage died; appended from any thread
        self._reported: set[tuple[int, int, int]] = set()

    def clear(self) -> None:
        self._history.clear()
        self._reported.clear()

    # ------------------------------------------------------------------ storage lifetimes

    def watch(self, t: torch.Tensor) -> None:
        """Forget a storage's history when it dies (its address may be reused)."""
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._watched:
            return
        self._watched.add(key)
        weakref.finalize(storage, self._dead.append, key)

    def fresh(self, key: int) -> None:
        """A new allocation at `key`: earlier accesses there were to another buffer."""
        self._history.pop(key, None)

    def _reap(self) -> None:
        while self._dead:
            key = self._dead.pop()
            self._watched.discard(key)
            self._history.pop(key, None)

    # ------------------------------------------------------------------------------ check

    def on_op(
        self,
        record: OpRecord,
        track: "_Track",
        epoch: int,
        reads: Sequence[Access],
        writes: Sequence[Access],
        stack: Any = None,
    ) -> None:
        """Check one op's accesses against the history, then add them (lock held)."""
        if self._dead:
            self._reap()
        vc = track.vc
        nvc = len(vc)
        me = track.index
        for access in (*reads, *writes):
            entries = self._history.get(access.storage)
            if entries is None:
                entries = self._history[access.storage] = []
            keep: list[_Entry] = []
            s, e, w = access.start, access.end, access.is_write
            for old in entries:
                if old.end <= s or e <= old.start:
                    keep.append(old)
                    continue
                ordered = old.track == me or (old.track < nvc and vc[old.track] >= old.epoch)
                if not ordered and (w or old.is_write):
                    self._report(access, old, record, stack)
                if ordered and old.start >= s and old.end <= e and (w or not old.is_write):
                    continue  # redundant: any later conflict with `old` conflicts with us
                keep.append(old)
            keep.append(_Entry(s, e, w, me, epoch, record, stack))
            self._history[access.storage] = keep

    def _report(self, access: Access, old: _Entry, record: OpRecord, stack: Any) -> None:
        key = (access.storage, old.record.seq, record.seq)
        if key in self._reported or len(self.device.races) >= MAX_REPORTS:
            return
        self._reported.add(key)
        first = OpSite(
            op=old.record.name,
            ubatch=old.record.ubatch,
            stream=old.record.stream,
            start=old.start,
            end=old.end,
            is_write=old.is_write,
            stack=_format_stack(old.stack or ()),
        )
        second = OpSite(
            op=record.name,
            ubatch=record.ubatch,
            stream=record.stream,
            start=access.start,
            end=access.end,
            is_write=access.is_write,
            stack=_format_stack(stack or ()),
        )
        report = RaceReport(storage=access.storage, first=first, second=second)
        self.device.races.append(report)
        action = self.device.race_action
        if action == "raise":
            raise RaceError(report)
        if action == "warn":
            import warnings

            warnings.warn(report.describe(), RuntimeWarning, stacklevel=2)
