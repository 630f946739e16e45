"""Hooks for tests, stress runs and benchmarks: record, watch or fail a manager's slot
allocations, and let a plain thread act as a ubatch.

The allocation hooks wrap the instance's `_allocate`, the one method every slot buffer comes
from, and put back whatever was there before on exit (so they nest).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from dbo import ubatching

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
def _wrapped(
    manager: WorkspaceManager,
    make: Callable[[Callable[[int], torch.Tensor]], Callable[[int], torch.Tensor]],
) -> Iterator[None]:
    had_own = "_allocate" in vars(manager)
    previous = vars(manager).get("_allocate")
    manager._allocate = make(manager._allocate)  # type: ignore[method-assign]
    try:
        yield
    finally:
        if had_own:
            manager._allocate = previous  # type: ignore[method-assign]
        else:
            del manager._allocate


@contextmanager
def record_allocations(manager: WorkspaceManager) -> Iterator[list[int]]:
    """Yield a list that receives the byte size of every allocation attempt in the block."""
    sizes: list[int] = []

    def make(inner: Callable[[int], torch.Tensor]) -> Callable[[int], torch.Tensor]:
        def recording(nbytes: int) -> torch.Tensor:
            sizes.append(nbytes)
            return inner(nbytes)

        return recording

    with _wrapped(manager, make):
        yield sizes


@contextmanager
def failing_allocations(manager: WorkspaceManager, *calls: int) -> Iterator[list[int]]:
    """Make the given allocation attempts (1-based, counted inside the block) fail.

    Yields the list of attempted sizes, failed ones included.
    """
    attempts: list[int] = []
    failing = set(calls)

    def make(inner: Callable[[int], torch.Tensor]) -> Callable[[int], torch.Tensor]:
        def failing_allocate(nbytes: int) -> torch.Tensor:
            attempts.append(nbytes)
            if len(attempts) in failing:
                raise InjectedAllocationError(
                    f"injected failure of allocation #{len(attempts)} ({nbytes} bytes)"
                )
            return inner(nbytes)

        return failing_allocate

    with _wrapped(manager, make):
        yield attempts


@contextmanager
def watch_allocations(
    manager: WorkspaceManager, on_allocate: Callable[[int], None]
) -> Iterator[None]:
    """Call `on_allocate(nbytes)` at every allocation attempt in the block, before it is made
    (so the callback sees the manager's state at that moment, e.g. whether it is locked)."""

    def make(inner: Callable[[int], torch.Tensor]) -> Callable[[int], torch.Tensor]:
        def watched(nbytes: int) -> torch.Tensor:
            on_allocate(nbytes)
            return inner(nbytes)

        return watched

    with _wrapped(manager, make):
        yield


@contextmanager
def as_ubatch(slot: int) -> Iterator[None]:
    """Make the calling thread count as ubatch `slot` (it gets that workspace slot) for the
    block, outside any ubatched step and without the baton: for tests and stress runs that
    drive a manager from plain threads, which is harsher than DBO, where one thread runs at a
    time."""
    ident = threading.get_ident()
    ubatching._THREAD_ID_TO_CONTEXT[ident] = slot
    try:
        yield
    finally:
        ubatching._THREAD_ID_TO_CONTEXT.pop(ident, None)
