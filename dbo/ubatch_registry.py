"""The process-wide registries of the running ubatched step: which thread runs which ubatch,
the live contexts, and the threads the launcher abandoned.

These are the runtime's only module state (documented registries, as in vLLM's
`ubatching.py`). `THREAD_ID_TO_CONTEXT` (thread ident -> ubatch id) and `CURRENT_CONTEXTS`
(ubatch id -> its live context, else None) are read lock-free by the `dbo_*` hot paths: a
single dict or list read is atomic, and a thread only ever reads its own entry. Every write
goes through the functions here, under `REGISTRY_LOCK` (once per ubatch per step, never on the
yield path), so a late thread of a finished or aborted step cannot register into the next one.

Abandoned threads. A thread still inside its ubatch when the launcher gives up on the step
(a timeout, an interrupt, or peers that did not unwind in time) is moved from
`THREAD_ID_TO_CONTEXT` to `ABANDONED_THREADS`; from then on `raise_if_abandoned` raises
`UBatchAbandoned` in it, and every runtime call of such a thread calls that first. The mark is
dropped when the runtime's thread loop sees the job return (`clear_abandoned_mark`), or, for a
thread of the user's own, when its ident turns up on a different, newer thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from dbo.errors import StepAborted, UBatchAbandoned

__all__ = [
    "THREAD_ID_TO_CONTEXT",
    "CURRENT_CONTEXTS",
    "ABANDONED_THREADS",
    "abandon_thread",
    "REGISTRY_LOCK",
    "register",
    "unregister",
    "unregister_locked",
    "abandon_locked",
    "claim_slots",
    "raise_if_abandoned",
    "clear_abandoned_mark",
    "abandoned_thread_count",
    "step_active",
    "bind_thread_to_ubatch",
]


class _StepLike(Protocol):
    closed: bool
    aborted: bool


class RegisteredContext(Protocol):
    """What the registries need of a ubatch context: its ubatch id and its step."""

    id: int
    step: _StepLike


THREAD_ID_TO_CONTEXT: dict[int, int] = {}
CURRENT_CONTEXTS: list[Any] = []
# thread ident -> (the thread, why it was abandoned)
ABANDONED_THREADS: dict[int, tuple[threading.Thread, str]] = {}
REGISTRY_LOCK = threading.Lock()
# context -> the ident it registered, so that only its own entries are ever removed
_REGISTERED: dict[Any, int] = {}

_get_ident = threading.get_ident


def register(ctx: RegisteredContext) -> None:
    """Register the calling thread as ubatch `ctx.id` of `ctx.step`.

    Raises `StepAborted` when the step is already over (a late thread), RuntimeError when
    the slot holds a context of another step that still runs."""
    ident = _get_ident()
    with REGISTRY_LOCK:
        if ctx.step.closed or ctx.step.aborted:
            raise StepAborted()
        occupant = CURRENT_CONTEXTS[ctx.id]
        if occupant is not None and occupant is not ctx:
            raise RuntimeError(
                f"ubatch {ctx.id} cannot start: ubatch {ctx.id} of another step is still "
                f"running in this process; DBO runs one step at a time (the registries are "
                f"process-wide)"
            )
        # A thread of the user's own that was abandoned once may run a new step's ubatch.
        ABANDONED_THREADS.pop(ident, None)
        THREAD_ID_TO_CONTEXT[ident] = ctx.id
        CURRENT_CONTEXTS[ctx.id] = ctx
        _REGISTERED[ctx] = ident


def unregister(ctx: RegisteredContext) -> None:
    """Drop `ctx`'s registration (a no-op when it has none)."""
    with REGISTRY_LOCK:
        unregister_locked(ctx)


def unregister_locked(ctx: RegisteredContext) -> int | None:
    """`unregister` for a caller holding `REGISTRY_LOCK`; returns the ident it dropped.

    Only the context's own entries go: its thread may already serve a newer step (workers
    are reused), and its slot may hold a newer step's context."""
    ident = _REGISTERED.pop(ctx, None)
    if ident is not None and THREAD_ID_TO_CONTEXT.get(ident) == ctx.id:
        del THREAD_ID_TO_CONTEXT[ident]
    else:
        ident = None
    if ctx.id < len(CURRENT_CONTEXTS) and CURRENT_CONTEXTS[ctx.id] is ctx:
        CURRENT_CONTEXTS[ctx.id] = None
    return ident


def abandon_locked(ctx: RegisteredContext, thread: threading.Thread | None, reason: str) -> None:
    """Unregister `ctx` and, if its thread was still registered (so still inside the
    ubatch), mark that thread abandoned: its next runtime call raises `UBatchAbandoned`."""
    ident = unregister_locked(ctx)
    if ident is not None and thread is not None:
        ABANDONED_THREADS[ident] = (thread, reason)


def abandon_thread(thread: threading.Thread, reason: str) -> None:
    """Mark `thread` abandoned though it ran no ubatch (a serial run cut off by its timeout):
    its next runtime call raises `UBatchAbandoned`, so it cannot reach a later step."""
    if thread.ident is not None:
        with REGISTRY_LOCK:
            ABANDONED_THREADS[thread.ident] = (thread, reason)


def claim_slots(num_ubatches: int) -> None:
    """Check that no step runs and make room for `num_ubatches` contexts."""
    with REGISTRY_LOCK:
        # Catches a step started while another runs (a nested call from inside a ubatch, a
        # second launcher thread); one that slips in before the first step's threads have
        # registered is refused when its threads try to (`register`).
        if any(ctx is not None for ctx in CURRENT_CONTEXTS):
            raise RuntimeError(
                "another ubatched step is still running in this process; DBO runs one step "
                "at a time (the registries are process-wide)"
            )
        if len(CURRENT_CONTEXTS) < num_ubatches:
            CURRENT_CONTEXTS.extend([None] * (num_ubatches - len(CURRENT_CONTEXTS)))


def raise_if_abandoned() -> None:
    """Raise `UBatchAbandoned` if the calling thread was abandoned (and is not registered to
    a newer step). Cheap when no thread is abandoned: one dict truth test."""
    if not ABANDONED_THREADS:
        return
    ident = _get_ident()
    entry = ABANDONED_THREADS.get(ident)
    if entry is None or ident in THREAD_ID_TO_CONTEXT:
        return
    thread, reason = entry
    if thread is not threading.current_thread():
        # The abandoned thread has ended and its ident went to a new thread.
        with REGISTRY_LOCK:
            if ABANDONED_THREADS.get(ident) is entry:
                del ABANDONED_THREADS[ident]
        return
    raise UBatchAbandoned(reason)


def clear_abandoned_mark() -> None:
    """Forget that the calling thread was abandoned: the runtime's thread loop calls it once
    the ubatch job it ran has returned (the thread runs no more of that step's user code)."""
    if ABANDONED_THREADS:
        with REGISTRY_LOCK:
            ABANDONED_THREADS.pop(_get_ident(), None)


def abandoned_thread_count() -> int:
    """Threads still marked abandoned and alive (for tests and reports)."""
    with REGISTRY_LOCK:
        for ident, (thread, _) in list(ABANDONED_THREADS.items()):
            if not thread.is_alive():
                del ABANDONED_THREADS[ident]
        return len(ABANDONED_THREADS)


def step_active() -> bool:
    """True while any thread is registered as a ubatch or any context is live."""
    return bool(THREAD_ID_TO_CONTEXT) or any(ctx is not None for ctx in CURRENT_CONTEXTS)


@contextmanager
def bind_thread_to_ubatch(ubatch_id: int) -> Iterator[None]:
    """Make the calling thread count as ubatch `ubatch_id` for the block (its
    `dbo_current_ubatch_id()`, hence its workspace slot), outside any step and without the
    baton: for tests and stress runs that drive a workspace from plain threads."""
    ident = _get_ident()
    with REGISTRY_LOCK:
        THREAD_ID_TO_CONTEXT[ident] = ubatch_id
    try:
        yield
    finally:
        with REGISTRY_LOCK:
            THREAD_ID_TO_CONTEXT.pop(ident, None)
