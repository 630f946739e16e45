"""The dbo_* helpers and the forward context: who may run, on which stream, and when to yield.

N ubatch threads share one compute stream and one comm stream and pass a single baton round a
ring: context i waits on its own CPU signal and, when it yields, sets signal (i + 1) mod N.
Only the holder of the baton runs Python, which is what lets each ubatch own a workspace slot
without locks. Each context also owns a compute-done and a comm-done device event, used by the
yield-and-switch helpers to order the two streams for that ubatch.

This module is the helpers' and the forward context's; the ring's parts live beside it:
`dbo.ubatch_step` (the baton signals and the step's shared state), `dbo.ubatch_context` (the
contexts and `make_ubatch_contexts`), `dbo.ubatch_registry` (which thread runs which ubatch).
Every name is importable from here, as from vLLM's module.

Documented registries: those of `dbo.ubatch_registry`, and `_forward_context`, the forward
context of threads that are not ubatches (serial steps, set by `set_forward_context`); a
ubatch thread reads its own context's instead, so its forward context is restored on every
resume and never leaks into the launcher.

Abandoned threads. A thread the launcher abandoned (still in user code when its step timed
out) gets `UBatchAbandoned` from every helper here, the queries included, and from
`current_forward_context`/`set_forward_context`, so it unwinds instead of reaching a later
step (see `dbo.ubatch_registry`).

Differences from vLLM's `vllm/v1/worker/ubatching.py`, all on failure or misuse paths: an
exception or an early exit in one ubatch releases its peers (`UBatchStep.abort`), a yield
count that differs between ubatches is reported instead of hanging, `dbo_current_ubatch_id()`
answers 0 for a thread that is not a ubatch, `dbo_enabled()` and `current_forward_context()`
answer for the calling thread, a second step started while one runs is refused, and a thread
the launcher abandoned is refused by every helper.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from dbo import ubatch_registry as registry
from dbo.frames import register_runtime_file
from dbo.streams import stream_context
from dbo.ubatch_context import UBatchContext, make_ubatch_contexts
from dbo.ubatch_registry import abandoned_thread_count, bind_thread_to_ubatch
from dbo.ubatch_step import (
    ABORTED,
    FAILED,
    FINISHED,
    NOT_STARTED,
    PARKED,
    RUNNING,
    CpuSignal,
    UBatchProgress,
    UBatchStep,
)

register_runtime_file(__file__)  # race reports leave the runtime's frames out of user stacks

__all__ = [
    "UBatchContext",
    "UBatchStep",
    "UBatchProgress",
    "CpuSignal",
    "make_ubatch_contexts",
    "dbo_enabled",
    "ubatch_step_active",
    "dbo_current_ubatch_id",
    "dbo_current_ubatch_token_offset",
    "dbo_yield",
    "dbo_yield_and_switch_from_compute_to_comm",
    "dbo_yield_and_switch_from_comm_to_compute",
    "dbo_switch_to_comm",
    "dbo_switch_to_compute",
    "dbo_switch_to_comm_sync",
    "dbo_switch_to_compute_sync",
    "dbo_register_recv_hook",
    "dbo_maybe_run_recv_hook",
    "dbo_get_previous_event",
    "current_forward_context",
    "set_forward_context",
    "check_not_abandoned",
    "abandoned_thread_count",
    "bind_thread_to_ubatch",
    "NOT_STARTED",
    "RUNNING",
    "PARKED",
    "FINISHED",
    "FAILED",
    "ABORTED",
]

# The registries, bound once: the hot paths below read them with no module lookup.
_THREAD_ID_TO_CONTEXT = registry.THREAD_ID_TO_CONTEXT
_CURRENT_CONTEXTS = registry.CURRENT_CONTEXTS
_ABANDONED_THREADS = registry.ABANDONED_THREADS
_raise_if_abandoned = registry.raise_if_abandoned
_forward_context: Any = None

_get_ident = threading.get_ident


# --------------------------------------------------------------------------------------------
# Helpers: each is a no-op on a thread that is not a ubatch thread, as in vLLM, and raises
# `UBatchAbandoned` on one the launcher abandoned.


def _current_context() -> UBatchContext | None:
    ubatch_id = _THREAD_ID_TO_CONTEXT.get(_get_ident())
    if ubatch_id is None:
        if _ABANDONED_THREADS:
            _raise_if_abandoned()
        return None
    return _CURRENT_CONTEXTS[ubatch_id]


def check_not_abandoned() -> None:
    """Raise `UBatchAbandoned` in a thread the launcher abandoned; otherwise do nothing.

    For runtime entry points beyond this module (the workspace calls it): one dict truth test
    while no thread is abandoned."""
    if _ABANDONED_THREADS:
        _raise_if_abandoned()


def ubatch_step_active() -> bool:
    """True while any thread is registered as a ubatch or any context is live (between steps,
    and after every failed one, this is False)."""
    return registry.step_active()


def dbo_enabled() -> bool:
    """True on a thread that runs a ubatch of the current step. A query: records nothing,
    waits for nothing, keeps the baton.

    vLLM answers True on every thread while any step runs; this answers for the caller, so
    a launcher or helper thread is never told to yield or switch streams it does not own."""
    if _get_ident() in _THREAD_ID_TO_CONTEXT:
        return True
    if _ABANDONED_THREADS:
        _raise_if_abandoned()
    return False


def dbo_current_ubatch_id() -> int:
    """The calling thread's ubatch id; 0 for any other thread (it is not a ubatch). A query:
    records nothing, waits for nothing, keeps the baton.

    vLLM raises KeyError for a non-ubatch thread while a step runs; 0 keeps serial code on
    such a thread working. Its workspace calls then share ubatch 0's slot, as every caller
    outside a step does, so such a thread must not hold workspace views across a step."""
    ubatch_id = _THREAD_ID_TO_CONTEXT.get(_get_ident())
    if ubatch_id is not None:
        return ubatch_id
    if _ABANDONED_THREADS:
        _raise_if_abandoned()
    return 0


def dbo_current_ubatch_token_offset() -> int:
    """The row where the calling ubatch starts in the parent batch (its context's
    `token_offset`); 0 on any other thread, as in vLLM. A query: records nothing, waits for
    nothing, keeps the baton."""
    ctx = _current_context()
    return 0 if ctx is None else ctx.token_offset


def _ubatch_helper(method: Callable[[UBatchContext], None]) -> Callable[[], None]:
    # Called by name on the registered context, not as the unbound function: a seat of
    # another runtime (`dbo.verification.vllm_runtime.VllmSeat`) answers with its own methods.
    name = method.__name__

    def helper() -> None:
        ctx = _current_context()
        if ctx is not None:
            getattr(ctx, name)()

    helper.__name__ = f"dbo_{method.__name__.rstrip('_')}"
    helper.__doc__ = (
        f"`UBatchContext.{method.__name__}` for the calling ubatch; a no-op on any other "
        f"thread (a serial step), `UBatchAbandoned` in an abandoned one.\n\n"
        + (method.__doc__ or "").replace("\n        ", "\n")
    )
    return helper


def dbo_yield() -> None:
    """`UBatchContext.yield_` for the calling ubatch; a no-op on any other thread (a serial
    step), `UBatchAbandoned` in an abandoned one."""
    # Written out rather than made by _ubatch_helper: it is the hot path, and two fewer
    # Python frames per pass show in the bench's baton figures.
    ubatch_id = _THREAD_ID_TO_CONTEXT.get(_get_ident())
    if ubatch_id is not None:
        ctx = _CURRENT_CONTEXTS[ubatch_id]
        if ctx is not None:
            ctx.yield_()
    elif _ABANDONED_THREADS:
        _raise_if_abandoned()


dbo_yield_and_switch_from_compute_to_comm = _ubatch_helper(
    UBatchContext.yield_and_switch_from_compute_to_comm
)
dbo_yield_and_switch_from_comm_to_compute = _ubatch_helper(
    UBatchContext.yield_and_switch_from_comm_to_compute
)
dbo_switch_to_comm = _ubatch_helper(UBatchContext.switch_to_comm)
dbo_switch_to_compute = _ubatch_helper(UBatchContext.switch_to_compute)
dbo_switch_to_comm_sync = _ubatch_helper(UBatchContext.switch_to_comm_sync)
dbo_switch_to_compute_sync = _ubatch_helper(UBatchContext.switch_to_compute_sync)
dbo_maybe_run_recv_hook = _ubatch_helper(UBatchContext.maybe_run_recv_hook)


def dbo_register_recv_hook(recv_hook: Callable[[], Any]) -> None:
    """Store `recv_hook` on the next ubatch's context; it runs when that ubatch calls
    `dbo_maybe_run_recv_hook()` (normally right after it resumes) or exits.

    Records nothing, waits for nothing, leaves the stream unchanged and keeps the baton:
    follow it with `dbo_yield()`, as vLLM's low-latency path does, so the next ubatch runs
    its compute while the transfer flies, then receives it. No-op outside a ubatch."""
    ctx = _current_context()
    if ctx is None:
        return
    if not callable(recv_hook):
        raise TypeError(f"recv_hook must be callable, got {type(recv_hook).__name__}")
    next_id = (ctx.id + 1) % ctx.step.num_ubatches
    nxt = ctx.step.contexts[next_id]
    if nxt.state.status in (FINISHED, FAILED, ABORTED):
        raise RuntimeError(
            f"ubatch {ctx.id} registered a recv hook on ubatch {next_id}, which has already "
            f"finished; the hook would never run"
        )
    if nxt.recv_hook is not None:
        raise RuntimeError(
            f"ubatch {ctx.id} registered a recv hook on ubatch {next_id}, which still has an "
            f"unrun one; call dbo_maybe_run_recv_hook() in ubatch {next_id} after it resumes"
        )
    nxt.recv_hook = recv_hook


def dbo_get_previous_event(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run `func` with this ubatch's compute stream current (to record or wait on events
    there); returns its result. No-op (None) outside a ubatch thread, as in vLLM.

    Records what `func` records (vLLM passes DeepEP's `buffer.capture`: an event on the
    compute stream for the comm kernel to wait on), restores the caller's stream after,
    does not wait itself and keeps the baton."""
    ctx = _current_context()
    if ctx is None:
        return None
    with stream_context(ctx.compute_stream):
        return func(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# Forward context


def current_forward_context() -> Any:
    """The calling ubatch's forward context; on any other thread, the one set by
    `set_forward_context` (None if none)."""
    ctx = _current_context()
    return ctx.forward_context if ctx is not None else _forward_context


@contextmanager
def set_forward_context(context: Any) -> Iterator[Any]:
    """Set the forward context for the block: the calling ubatch's own (until the block
    ends, across its yields), or, on any other thread, the one of a serial step."""
    global _forward_context
    ctx = _current_context()
    if ctx is not None:
        previous = ctx.forward_context
        ctx.forward_context = context
        try:
            yield context
        finally:
            ctx.forward_context = previous
        return
    previous = _forward_context
    _forward_context = context
    try:
        yield context
    finally:
        _forward_context = previous
