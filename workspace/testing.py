"""Hooks for tests and benchmarks: record or fail a manager's slot allocations.

Both wrap the instance's `_allocate`, the one method every slot buffer comes from, and put
back whatever was there before on exit (so they nest).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from .manager import WorkspaceManager

__all__ = ["record_allocations", "failing_allocations", "InjectedAllocationError"]


class InjectedAllocationError(RuntimeError):
    """Raised by `failing_allocations` in place of a real out-of-memory error."""


@contextmanager
def _wrapped(manager: WorkspaceManager,
             make: Callable[[Callable[[int], torch.Tensor]], Callable[[int], torch.Tensor]]
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
