"""Remember replaced slot buffers: which are still alive (orphans) and which pointer was whose.

How we know an old buffer is still alive without keeping it alive ourselves (measured on
torch 2.13, CPU and meta):
- a `weakref` to the slot *tensor* is useless: the Python tensor object dies as soon as the
  manager drops it, even while views (which hold the C++ TensorImpl/storage, not the Python
  object) keep every byte allocated, so it would report "freed" for an orphan;
- `torch._C._storage_Use_Count` needs a raw StorageImpl pointer, which dangles once freed;
- a weak reference to the *storage* (`torch.multiprocessing.reductions.StorageWeakRef`, a
  c10 weak_intrusive_ptr) is exact: it expires when the last tensor sharing the storage dies,
  whatever kind of view or alias it is, and it does not keep the data alive (the allocator
  gets the memory back at expiry; only the small StorageImpl header waits for the weak ref).
So each replaced buffer leaves a StorageWeakRef here, and orphan counts are recomputed from
`expired()` whenever they are asked for.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .records import BufferInfo

__all__ = ["FormerBuffer", "BufferLedger", "storage_ref"]


def storage_ref(buffer: torch.Tensor) -> StorageWeakRef:
    """A weak reference to `buffer`'s storage (the temporary storage object is not kept)."""
    return StorageWeakRef(buffer.untyped_storage())


@dataclass(slots=True)
class FormerBuffer:
    """A slot buffer the manager no longer holds."""

    slot: int
    generation: int
    data_ptr: int
    nbytes: int
    ref: StorageWeakRef

    def alive(self) -> bool:
        return not self.ref.expired()


def _label(slot: int) -> str:
    return f"workspace slot {slot}"


class BufferLedger:
    """Former slot buffers: a bounded history for pointer lookups, plus every live orphan.

    Not thread-safe by itself: the manager calls it under its growth lock.
    """

    def __init__(self, history_limit: int = 256) -> None:
        self._history: deque[FormerBuffer] = deque(maxlen=history_limit)
        # Orphans are never dropped while alive, however long the history bound is:
        # counting them is the point.
        self._orphans: list[FormerBuffer] = []
        self.orphaning_events = 0

    def retire(
        self, slot: int, generation: int, data_ptr: int, nbytes: int, ref: StorageWeakRef
    ) -> int:
        """Record a buffer the manager has just dropped; return its bytes if it lives on."""
        former = FormerBuffer(slot, generation, data_ptr, nbytes, ref)
        self._history.append(former)
        if former.alive():
            self._orphans.append(former)
            return nbytes
        return 0

    def _prune(self) -> list[FormerBuffer]:
        self._orphans = [o for o in self._orphans if o.alive()]
        return self._orphans

    def orphaned_bytes(self) -> int:
        return sum(o.nbytes for o in self._prune())

    def orphaned_buffers(self) -> int:
        return len(self._prune())

    def find(self, ptr: int) -> BufferInfo | None:
        """The former buffer that `ptr` falls in, preferring buffers still allocated.

        An allocated orphan owns its address range outright; among freed ones, the newest
        retirement wins, since an address can only be reused after the older owner freed it.
        """
        for candidates in (self._prune(), self._history):
            for former in reversed(candidates):
                if former.nbytes and former.data_ptr <= ptr < former.data_ptr + former.nbytes:
                    return BufferInfo(
                        label=_label(former.slot),
                        slot=former.slot,
                        generation=former.generation,
                        data_ptr=former.data_ptr,
                        nbytes=former.nbytes,
                        live=False,
                        offset=ptr - former.data_ptr,
                        still_allocated=former.alive(),
                    )
        return None

    @staticmethod
    def current(slot: int, generation: int, buffer: torch.Tensor, ptr: int) -> BufferInfo:
        start = buffer.data_ptr()
        return BufferInfo(
            label=_label(slot),
            slot=slot,
            generation=generation,
            data_ptr=start,
            nbytes=buffer.numel(),
            live=True,
            offset=ptr - start,
            still_allocated=True,
        )
