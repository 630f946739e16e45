"""Hooks for tests, stress runs and benchmarks: record, watch or fail a manager's slot
allocations, and let a plain thread act as a ubatch.

The allocation helpers are blocks of the manager's `allocation_hook`, through which every slot
buffer comes; they nest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from dbo.ubatching import bind_thread_to_ubatch

from .growth import Allocate
from .manager import WorkspaceManager

__all__ = [
    "record_allocations",
    "watch_allocations",
    "failing_allocations",
    "InjectedAllocationError",
    "as_ubatch",
]


class InjectedAllocationError(RuntimeError):
    """Raised by `failing_allocations` in place of a real out-of-memory error."""


@contextmanager
def record_allocations(manager: WorkspaceManager) -> Iterator[list[int]]:
    """Yield a list that receives the byte size of every allocation attempt in the block."""
    sizes: list[int] = []

    def recording(nbytes: int, allocate: Allocate) -> torch.Tensor:
        sizes.append(nbytes)
        return allocate(nbytes)

    with manager.allocation_hook(recording):
        yield sizes


@contextmanager
def failing_allocations(manager: WorkspaceManager, *calls: int) -> Iterator[list[int]]:
    """Make the given allocation attempts (1-based, counted inside the block) fail.

    Yields the list of attempted sizes, failed ones included.
    """
    attempts: list[int] = []
    failing = set(calls)

    def failing_allocate(nbytes: int, allocate: Allocate) -> torch.Tensor:
        attempts.append(nbytes)
        if len(attempts) in failing:
            raise InjectedAllocationError(
                f"injected failure of allocation #{len(attempts)} ({nbytes} bytes)"
            )
        return allocate(nbytes)

    with manager.allocation_hook(failing_allocate):
        yield attempts


@contextmanager
def watch_allocations(
    manager: WorkspaceManager, on_allocate: Callable[[int], None]
) -> Iterator[None]:
    """Call `on_allocate(nbytes)` at every allocation attempt in the block, before it is made
    (so the callback sees the manager's state at that moment, e.g. whether it is locked)."""

    def watched(nbytes: int, allocate: Allocate) -> torch.Tensor:
        on_allocate(nbytes)
        return allocate(nbytes)

    with manager.allocation_hook(watched):
        yield


@contextmanager
def as_ubatch(slot: int) -> Iterator[None]:
    """Make the calling thread count as ubatch `slot` (it gets that workspace slot) for the
    block, outside any ubatched step and without the baton: for tests and stress runs that
    drive a manager from plain threads, which is harsher than DBO, where one thread runs at a
    time."""
    with bind_thread_to_ubatch(slot):
        yield
