"""What a `WorkspaceManager` tells about itself: its sizes, generations and growth history,
the orphans growth left, the slot buffer a device pointer falls in (graph replay's pointer
check), and `stats()` in one record.

A mixin of `WorkspaceManager`, which builds the state named below; every read that could
race a growth takes the manager's mutex.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

import torch

from .buffers import BufferLedger
from .growth import SlotStore, nbytes_of
from .records import BufferInfo, GrowthRecord, WorkspaceStats

__all__ = ["WorkspaceReport"]


class WorkspaceReport:
    """The introspection half of `WorkspaceManager`'s API."""

    _device: torch.device
    _num_ubatches: int
    _num_lanes: int
    _store: SlotStore
    _slots: list[torch.Tensor | None]
    _persistent: list[dict[Hashable, Any]]
    _locked: bool
    _mutex: threading.RLock
    _check_lane: Callable[[int], int]

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def num_ubatches(self) -> int:
        return self._num_ubatches

    @property
    def num_lanes(self) -> int:
        return self._num_lanes

    @property
    def capacity(self) -> int:
        """Bytes of the largest slot (a lane's slots are equal after every growth)."""
        with self._mutex:
            return max(nbytes_of(b) for b in self._slots)

    def lane_capacity(self, lane: int) -> int:
        """Bytes per slot of `lane` (every ubatch's slot of a lane is equal)."""
        if isinstance(lane, bool) or not isinstance(lane, int):
            raise TypeError(f"lane must be an int, got {type(lane).__name__}")
        with self._mutex:
            return self._store.lane_capacity(self._check_lane(lane))

    def slot_capacities(self) -> list[int]:
        """Bytes per slot, indexed `ubatch * num_lanes + lane`."""
        with self._mutex:
            return [nbytes_of(b) for b in self._slots]

    def slot_generation(self, k: int) -> int:
        """How many buffers slot k has been given (0 before its first growth)."""
        count = len(self._slots)
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < count:
            raise ValueError(f"slot must be an int in [0, {count}), got {k!r}")
        return self._store.generations[k]

    def persistent_resource_count(self) -> int:
        """Persistent resources held, over every (ubatch, lane)."""
        with self._mutex:
            return sum(len(r) for r in self._persistent)

    def growth_history(self) -> list[GrowthRecord]:
        with self._mutex:
            return list(self._store.growths)

    @property
    def peak_bytes(self) -> int:
        """Most bytes of slot buffers alive at once, orphans included."""
        return self._store.peak_bytes

    def orphaned_bytes(self) -> int:
        """Bytes of replaced slot buffers that views still keep alive right now."""
        with self._mutex:
            return self._store.ledger.orphaned_bytes()

    @property
    def orphaning_growths(self) -> int:
        """Cumulative count of growths that left at least one old buffer alive."""
        return self._store.ledger.orphaning_events

    def describe_buffer(self, data_ptr: int) -> BufferInfo | None:
        """The current or former slot buffer that `data_ptr` falls in, or None.

        Needs a real device: on `meta` every pointer is 0 and None is returned.
        """
        if isinstance(data_ptr, bool) or not isinstance(data_ptr, int):
            raise TypeError(f"data_ptr must be an int, got {type(data_ptr).__name__}")
        if self._device.type == "meta":
            return None
        with self._mutex:
            for k, buffer in enumerate(self._slots):
                if buffer is not None and buffer.numel():
                    start = buffer.data_ptr()
                    if start <= data_ptr < start + buffer.numel():
                        return BufferLedger.current(k, self._store.generations[k], buffer, data_ptr)
            return self._store.ledger.find(data_ptr)

    def slot_buffers(self) -> list[BufferInfo | None]:
        """The current buffer of each slot (None before its first growth)."""
        with self._mutex:
            return [
                None
                if b is None
                else BufferLedger.current(k, self._store.generations[k], b, b.data_ptr())
                for k, b in enumerate(self._slots)
            ]

    def stats(self) -> WorkspaceStats:
        with self._mutex:
            return WorkspaceStats(
                device=self._device,
                num_ubatches=self._num_ubatches,
                capacities=tuple(nbytes_of(b) for b in self._slots),
                generations=tuple(self._store.generations),
                locked=self._locked,
                growths=tuple(self._store.growths),
                failed_growths=self._store.failed_growths,
                allocations=self._store.allocations,
                peak_bytes=self._store.peak_bytes,
                orphaned_bytes=self._store.ledger.orphaned_bytes(),
                orphaned_buffers=self._store.ledger.orphaned_buffers(),
                orphaning_growths=self._store.ledger.orphaning_events,
                num_lanes=self._num_lanes,
                persistent_resources=sum(len(r) for r in self._persistent),
            )
