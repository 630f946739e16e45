"""The workspace package's exceptions: one class per way a request can be refused."""

from __future__ import annotations

__all__ = [
    "WorkspaceLockedError",
    "WorkspaceNotInitializedError",
    "WorkspaceAllocationError",
    "WorkspaceSlotError",
]


class WorkspaceLockedError(AssertionError):
    """A request needed more workspace than the slot has while growth is locked.

    An AssertionError subclass so code written against vLLM (which raises a bare
    AssertionError here) keeps catching it.
    """


class WorkspaceNotInitializedError(RuntimeError, AssertionError):
    """`current_workspace_manager()` was called before `init_workspace_manager()`.

    vLLM asserts here (an AssertionError); this project raised a RuntimeError. Both bases, like
    `WorkspaceLockedError`'s: handlers written against either keep catching it, and unlike a
    bare `assert` it survives `python -O`.
    """


class WorkspaceAllocationError(RuntimeError, MemoryError):
    """A slot buffer could not be allocated; every slot was rolled back before raising.

    Both a RuntimeError (what torch raises for allocator failures) and a MemoryError (what
    the failure is), so either kind of handler catches it. The torch error is chained.
    """


class WorkspaceSlotError(RuntimeError, IndexError):
    """The calling thread's ubatch id or workspace lane has no slot in this manager (too few
    ubatches or lanes). A RuntimeError, as vLLM raises for an unconfigured lane."""
