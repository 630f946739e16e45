"""The workspace's slot buffers and their growth: feasibility against the device, the
release-then-reallocate pass over a lane, the rollback when an allocation fails, and the
allocation hook every slot buffer comes through.

`SlotStore` is not thread-safe by itself: the manager calls every method that changes a slot
under its growth lock, and drops its cached views into a lane before that lane grows (they
pin the old buffers).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

from .buffers import BufferLedger, storage_ref
from .diagnostics import debug_enabled, logger, mb
from .errors import WorkspaceAllocationError
from .layout import Layout
from .records import GrowthRecord
from .steps import describe_current_step

__all__ = [
    "Allocate",
    "AllocationHook",
    "HookedAllocations",
    "SlotStore",
    "nbytes_of",
    "device_total_bytes",
    "describe_request",
]

# Former buffers remembered for pointer lookups (live orphans are always kept besides).
BUFFER_HISTORY = 256

Allocate = Callable[[int], torch.Tensor]
# hook(nbytes, allocate) -> the buffer: it may count, watch or fail the allocation, and calls
# `allocate` (the next hook inward, or the real allocator) to make it.
AllocationHook = Callable[[int, Allocate], torch.Tensor]


def nbytes_of(buffer: torch.Tensor | None) -> int:
    """Bytes of a slot buffer (0 for a slot not allocated yet)."""
    return 0 if buffer is None else buffer.numel()


def device_total_bytes(device: torch.device) -> int | None:
    """All the memory `device` has: no growth can ever need more. None where unknown.

    CPU: physical RAM (None where the OS does not report it); CUDA: the device's total as the
    driver reports it; meta and other devices: None, so no bound (meta allocates nothing).
    """
    try:
        if device.type == "cpu":
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        elif device.type == "cuda":
            total = int(torch.cuda.mem_get_info(device)[1])
        else:
            return None
    except (AttributeError, ValueError, OSError, RuntimeError, AssertionError):
        return None  # not reported (or no CUDA): the allocator decides, rollback as ever
    return total if total > 0 else None


def describe_request(key: Any) -> str:
    """A request's (shape, dtype) pairs for an error message, cut to a readable length."""
    text = ", ".join(f"({dims}, {dtype})" for dims, dtype in key)
    return text if len(text) <= 200 else f"{text[:200]}... ({len(key)} tensors)"


class SlotStore:
    """One buffer per (ubatch, lane) slot, at index `ubatch * num_lanes + lane`, and what
    their growths did (records, failures, allocations, peak, former buffers)."""

    def __init__(
        self,
        device: torch.device,
        num_ubatches: int,
        num_lanes: int,
        alloc_context: Callable[[], AbstractContextManager],
    ) -> None:
        self.device = device
        self.num_ubatches = num_ubatches
        self.num_lanes = num_lanes
        self.alloc_context = alloc_context
        self.slots: list[torch.Tensor | None] = [None] * (num_ubatches * num_lanes)
        self.generations = [0] * len(self.slots)
        # Kept as slots come and go: summing every slot on each install made one growth cost
        # slots x ubatches, minutes at a thousand threads.
        self.live_bytes = 0
        self.ledger = BufferLedger(BUFFER_HISTORY)
        self.growths: list[GrowthRecord] = []
        self.failed_growths = 0
        self.allocations = 0
        self.peak_bytes = 0
        self._device_total: int | None | bool = False  # False: not read yet
        self._allocate: Allocate = self._allocate_buffer

    # ---------------------------------------------------------------- allocation hook

    def _allocate_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty((nbytes,), dtype=torch.uint8, device=self.device)

    @contextmanager
    def allocation_hook(self, hook: AllocationHook) -> Iterator[None]:
        """Route every slot allocation in the block through `hook(nbytes, allocate)`. Hooks
        nest: the innermost block's hook is called first, and its `allocate` is the next one
        out (the real allocator last). Rollback allocations go through it too."""
        if not callable(hook):
            raise TypeError(f"an allocation hook must be callable, got {type(hook).__name__}")
        inner = self._allocate

        def hooked(nbytes: int) -> torch.Tensor:
            return hook(nbytes, inner)

        self._allocate = hooked
        try:
            yield
        finally:
            self._allocate = inner

    # ---------------------------------------------------------------- lanes

    def lane_slots(self, lane: int) -> range:
        return range(lane, self.num_ubatches * self.num_lanes, self.num_lanes)

    def lane_capacity(self, lane: int) -> int:
        return max(nbytes_of(self.slots[w]) for w in self.lane_slots(lane))

    # ---------------------------------------------------------------- growth

    def check_fits_device(self, lane: int, layout: Layout, who: str, caller: str) -> None:
        """Refuse, before anything is released, a growth the device could never hold.

        The lane's slots smaller than the request are each released and re-made at the new
        size, so together they need new size x their count, whatever they held before. A
        ValueError, like the int64 refusal in `plan_layout`: the request can never be served
        on this device, so it is a bad argument and not an allocator failure to retry (that
        is `WorkspaceAllocationError`, raised after a rollback).
        """
        if self._device_total is False:
            self._device_total = device_total_bytes(self.device)
        total = self._device_total
        new_bytes = layout.total_bytes
        resized = sum(1 for w in self.lane_slots(lane) if nbytes_of(self.slots[w]) < new_bytes)
        need = new_bytes * resized
        if total is None or need <= total:
            return
        raise ValueError(
            f"{who}: the request [{describe_request(layout.key)}] from '{caller}' needs "
            f"{mb(new_bytes)} ({new_bytes} bytes) per slot; growing {resized} slot(s) of lane "
            f"{lane} to it needs {need} bytes, more than {self.device} has in all "
            f"({total} bytes). Nothing was released; ask for less per ubatch, or use fewer "
            f"ubatches"
        )

    def grow(self, lane: int, new_bytes: int, caller: str) -> None:
        """Grow every ubatch's slot of `lane` to new_bytes; on failure roll them all back.

        The caller has validated the request (so new_bytes fits int64), checked it against
        the device's memory (`check_fits_device`) and dropped its views into the lane.
        """
        slots = self.lane_slots(lane)
        old_bytes = self.lane_capacity(lane)
        orphaned = 0
        try:
            for w in slots:
                if nbytes_of(self.slots[w]) < new_bytes:
                    orphaned += self.release(w)
                    self.install(w, new_bytes)
        except BaseException as exc:
            self._fail_growth(exc, slots, old_bytes, new_bytes, orphaned, caller)
        record = GrowthRecord(
            caller, old_bytes, new_bytes, self.num_ubatches, orphaned, lane, describe_current_step()
        )
        self.growths.append(record)
        if orphaned:
            self.ledger.orphaning_events += 1
        if debug_enabled():
            total = self.live_bytes
            logger.info(
                "workspace resized by '%s': %s -> %s per slot (%d slots, total %s; "
                "orphaned now %s)",
                caller,
                mb(old_bytes),
                mb(new_bytes),
                self.num_ubatches,
                mb(total),
                mb(self.ledger.orphaned_bytes()),
            )

    def _fail_growth(
        self,
        exc: BaseException,
        slots: range,
        old_bytes: int,
        new_bytes: int,
        orphaned: int,
        caller: str,
    ) -> None:
        """Roll the lane back after a failed allocation, then raise (always)."""
        self.failed_growths += 1
        if orphaned:  # the released buffers stay orphaned whatever the rollback does
            self.ledger.orphaning_events += 1
        self._roll_back(slots, old_bytes)
        now = nbytes_of(self.slots[slots[0]])
        if debug_enabled():  # a rollback resizes too: the log must show it
            logger.info(
                "workspace growth by '%s' to %s per slot failed (%s); every slot rolled "
                "back to %s (%d slots, total %s)",
                caller,
                mb(new_bytes),
                type(exc).__name__,
                mb(now),
                self.num_ubatches,
                mb(now * self.num_ubatches),
            )
        if not isinstance(exc, Exception):
            raise exc
        raise WorkspaceAllocationError(
            f"could not grow the workspace slots on {self.device} to {mb(new_bytes)} "
            f"({new_bytes} bytes) for '{caller}': {type(exc).__name__}: {exc}; every slot "
            f"was rolled back to {mb(now)} ({now} bytes)"
        ) from exc

    def release(self, k: int) -> int:
        """Drop slot k's buffer; return its bytes if views keep it alive (an orphan)."""
        buffer = self.slots[k]
        if buffer is None:
            return 0
        ref = storage_ref(buffer)
        ptr, nbytes = buffer.data_ptr(), buffer.numel()
        self.slots[k] = None
        self.live_bytes -= nbytes
        del buffer  # the last reference the store holds: memory goes back now, unless held
        return self.ledger.retire(k, self.generations[k], ptr, nbytes, ref)

    def install(self, k: int, nbytes: int) -> None:
        """Give slot k a new buffer of nbytes (released first by the caller)."""
        # A slot allocated inside inference_mode would be an inference tensor, and so would
        # every view of it, unusable for in-place work outside that mode later.
        with torch.inference_mode(False), self.alloc_context():
            buffer = self._allocate(nbytes)
        self.allocations += 1
        if (
            not isinstance(buffer, torch.Tensor)
            or buffer.dtype != torch.uint8
            or buffer.dim() != 1
            or buffer.numel() < nbytes
        ):
            raise TypeError(
                f"a slot allocation of {nbytes} bytes must return a 1-D uint8 tensor of >= "
                f"{nbytes} elements, got {buffer!r:.200}"
            )
        self.slots[k] = buffer
        self.generations[k] += 1
        self.live_bytes += nbytes_of(buffer)
        alive = self.live_bytes + self.ledger.orphaned_bytes()
        self.peak_bytes = max(self.peak_bytes, alive)

    def _roll_back(self, slots: range, old_bytes: int) -> None:
        """After a failed growth: these slots back to old_bytes, else all of them empty."""
        try:
            for w in slots:
                if nbytes_of(self.slots[w]) != old_bytes:
                    self.release(w)
                    if old_bytes:
                        self.install(w, old_bytes)
        except BaseException:
            for w in slots:
                self.release(w)
            logger.warning(
                "workspace rollback to %s failed too; every slot of the lane is now empty",
                mb(old_bytes),
            )


class HookedAllocations(AbstractContextManager[None]):
    """`WorkspaceManager.allocation_hook`'s block: the hook is put in and taken out under the
    manager's growth lock (`mutex`), so no growth in flight sees half of either."""

    def __init__(self, store: SlotStore, mutex: AbstractContextManager, hook: AllocationHook):
        if not callable(hook):
            raise TypeError(f"an allocation hook must be callable, got {type(hook).__name__}")
        self._store = store
        self._mutex = mutex
        self._hook = hook
        self._block: AbstractContextManager[None] | None = None

    def __enter__(self) -> None:
        with self._mutex:
            self._block = self._store.allocation_hook(self._hook)
            self._block.__enter__()

    def __exit__(self, *exc: Any) -> None:
        assert self._block is not None
        with self._mutex:
            self._block.__exit__(None, None, None)
