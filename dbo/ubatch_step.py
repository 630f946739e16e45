"""One ubatched step's shared state: the baton signals of the ring, each ubatch's status and
yield count, and the first failure, which releases every parked peer."""

from __future__ import annotations

import gc
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any

from dbo import ubatch_registry as registry
from dbo.errors import UBatchError, YieldMismatchError, describe_error

__all__ = [
    "CpuSignal",
    "UBatchProgress",
    "UBatchStep",
    "NOT_STARTED",
    "RUNNING",
    "PARKED",
    "FINISHED",
    "FAILED",
    "ABORTED",
    "as_ubatch_error",
    "note_yield",
]

# The modules whose frames sit between a parked thread's lock wait and the user's call of a
# dbo_* helper: skipped when a report says where a ubatch is parked.
_HERE = os.path.dirname(__file__)  # as co_filename spells it
_BATON_FILES = frozenset(
    os.path.join(_HERE, name) for name in ("ubatching.py", "ubatch_context.py")
)


class CpuSignal:
    """A one-shot wake-up for one parked thread: the baton primitive of the ring.

    A bare `threading.Lock` used as a binary semaphore (held = not signalled), instead of
    vLLM's `threading.Event`: an Event wait builds a fresh lock and condition per call, a Lock
    acquire does not (the bench's baton figures compare the two, and a bare lock ping-pong,
    in one run). Any thread may `set` it; only its owner `wait`s.

    `release` and `acquire` are the lock's own bound methods, for the yield path: between
    waking the peer and parking itself, the yielding thread still holds the GIL, and every
    Python call in that window is one the woken peer may wake up into and wait out.
    """

    __slots__ = ("_lock", "release", "acquire")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self.release = self._lock.release  # raises RuntimeError when already signalled
        self.acquire = self._lock.acquire

    def set(self) -> None:
        try:
            self._lock.release()
        except RuntimeError:
            pass  # already signalled: an abort may set every signal, some twice

    def wait(self, timeout: float = -1) -> bool:
        return self._lock.acquire(timeout=timeout)

    def is_set(self) -> bool:
        return not self._lock.locked()


# Ubatch states, for error reports ("where it waits").
NOT_STARTED = "not started"
RUNNING = "running"
PARKED = "parked"
FINISHED = "finished"
FAILED = "failed"
ABORTED = "aborted"


@dataclass
class UBatchProgress:
    """One ubatch's progress in its step, for the ring's checks and the error reports."""

    status: str = NOT_STARTED
    yields: int = 0
    # The ubatch's thread: error reports look up where it is parked through
    # sys._current_frames(), so the yield path formats no stack (a stack capture per yield
    # measurably slowed every handoff).
    thread_ident: int | None = None
    # Where the ubatch last yielded (code, line), so a report can place a ubatch that has
    # finished; reading two frame attributes costs far less than formatting a stack.
    last_yield: tuple[Any, int] | None = None
    thread: threading.Thread | None = None


class UBatchStep:
    """The shared state of one ubatched step: yield counts, status, and the first failure.

    Every context of the step holds it. `abort` records the first error and wakes every parked
    thread, which then unwinds with `StepAborted` instead of running on. `cut_off_running`
    and `close` mark the threads still inside the step abandoned (`dbo.ubatch_registry`).
    """

    def __init__(self, num_ubatches: int, ready_barrier: threading.Barrier) -> None:
        self.num_ubatches = num_ubatches
        self.ready_barrier = ready_barrier
        self.signals = [CpuSignal() for _ in range(num_ubatches)]
        self.states = [UBatchProgress() for _ in range(num_ubatches)]
        self.contexts: list[Any] = []  # its UBatchContexts, filled by make_ubatch_contexts
        self.error: BaseException | None = None
        self.aborted = False
        self.closed = False  # after close(): no thread may register for this step any more
        self._lock = threading.Lock()
        self._detected: list[YieldMismatchError] = []  # errors the ring itself raised

    def release_first(self) -> None:
        """The launcher's part: let ubatch 0 run."""
        self.signals[0].set()

    def abort(self, error: BaseException) -> None:
        """Record `error` (the first one wins) and release every peer."""
        with self._lock:
            if self.error is None:
                self.error = error
            self.aborted = True
        try:
            self.ready_barrier.abort()
        except Exception:  # pragma: no cover - abort on a broken barrier is harmless
            pass
        for signal in self.signals:
            signal.set()

    def cut_off_running(self) -> None:
        """Mark abandoned the threads running user code right now (not parked, so no abort
        can reach them): the launcher calls it when it gives up on the step (a timeout), so
        such a thread's next runtime call raises `UBatchAbandoned`. Parked peers unwind by
        themselves; `close` marks any that has not by then."""
        reason = self._abandon_reason()
        with registry.REGISTRY_LOCK:
            for ctx, state in zip(self.contexts, self.states):
                if state.status == RUNNING:
                    registry.abandon_locked(ctx, state.thread, reason)

    def close(self) -> None:
        """End the step for the registries: drop every registration it still has, marking
        abandoned the threads still inside their ubatch, and refuse late ones (a thread left
        behind by a timeout that reaches `__enter__` afterwards). The launcher calls it once
        the step is over, whatever the outcome."""
        reason = self._abandon_reason()
        with registry.REGISTRY_LOCK:
            self.closed = True
            for ctx, state in zip(self.contexts, self.states):
                registry.abandon_locked(ctx, state.thread, reason)

    def _abandon_reason(self) -> str:
        cause = describe_error(self.error).splitlines()[0] if self.error is not None else "over"
        return (
            f"this thread ran a ubatch of a step the launcher abandoned ({cause}); it may not "
            f"use the dbo_* helpers, the forward context or the workspace again (a later step "
            f"owns them): let it return"
        )

    def describe(self) -> str:
        frames = _current_frames()
        lines = []
        for i, state in enumerate(self.states):
            where = ""
            frame = frames.get(state.thread_ident) if state.thread_ident is not None else None
            if state.status in (PARKED, RUNNING) and frame is not None:
                where = f" at {_frame_site(_user_frame(frame))}"
            elif state.last_yield is not None:
                code, line = state.last_yield
                where = (
                    f", last yield at {code.co_filename.rsplit('/', 1)[-1]}:{line}:{code.co_name}"
                )
            lines.append(f"  ubatch {i}: {state.yields} yield(s), {state.status}{where}")
        return "\n".join(lines)

    def yield_counts(self) -> list[int]:
        return [state.yields for state in self.states]

    def mismatch(self, reason: str) -> YieldMismatchError:
        """The error for a yield-count mismatch the ring detected (`reason`: how)."""
        error = YieldMismatchError(
            f"ubatches yielded a different number of times ({reason}); every ubatch must "
            f"yield the same number of times per step, or the ring hangs:\n{self.describe()}",
            yield_counts=self.yield_counts(),
        )
        self._detected.append(error)
        return error

    def error_for(self, ubatch_id: int, error: BaseException) -> UBatchError:
        """What the step ends with when `error` leaves ubatch `ubatch_id`: a mismatch the ring
        detected as it is, anything else (the user's own UBatchError included) wrapped to name
        the ubatch, the original as `__cause__`."""
        if any(error is detected for detected in self._detected):
            return error  # type: ignore[return-value]
        return as_ubatch_error(ubatch_id, error, self.num_ubatches)

    def fail(self, ubatch_id: int, error: BaseException) -> None:
        """Record that `error` left ubatch `ubatch_id` and end the step (the first failure
        wins). Formatting the user's exception cannot make it raise: a failure is never lost
        to a broken `__str__`."""
        try:
            wrapped = self.error_for(ubatch_id, error)
        except BaseException:  # noqa: BLE001 - say what we can rather than lose the failure
            wrapped = UBatchError(
                f"Microbatch {ubatch_id} of {self.num_ubatches} failed", ubatch_id=ubatch_id
            )
            wrapped.__cause__ = error
        self.abort(wrapped)


def _current_frames() -> dict[int, Any]:
    """`sys._current_frames()` with the collector off: CPython builds the frame objects under
    its thread-list lock, and a collection run there may finalize an object whose destructor
    needs that lock (a thread state made or dropped, e.g. by a process group's C++ thread),
    which hangs the process with the GIL held."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return sys._current_frames()
    finally:
        if enabled:
            gc.enable()


def _frame_site(frame: Any) -> str:
    code = frame.f_code
    return f"{code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}:{code.co_name}"


def _user_frame(frame: Any) -> Any:
    """From a parked thread's innermost frame, the first one outside the baton machinery
    (threading's lock wait, the context and helper modules): where the user called a dbo_*
    helper."""
    innermost, inside = frame, None
    while frame is not None:
        if frame.f_code.co_filename in _BATON_FILES:
            inside = frame
        frame = frame.f_back
    if inside is None:  # a running thread outside the baton machinery: where it is now
        return innermost
    return inside.f_back if inside.f_back is not None else inside


def note_yield(state: UBatchProgress, frame: Any) -> None:
    """Record where a ubatch yields: the first frame from `frame` outward outside the baton
    machinery (two attribute reads, no stack formatting)."""
    while frame.f_back is not None and frame.f_code.co_filename in _BATON_FILES:
        frame = frame.f_back
    state.last_yield = (frame.f_code, frame.f_lineno)


def as_ubatch_error(ubatch_id: int, error: BaseException, num_ubatches: int) -> UBatchError:
    """`error`, raised in ubatch `ubatch_id`, as the step's `UBatchError`: vLLM's words first
    ("Microbatch 0 of 2 failed", so handlers matching them keep working), then which
    exception, the original chained as `__cause__`."""
    wrapped = UBatchError(
        f"Microbatch {ubatch_id} of {num_ubatches} failed: ubatch {ubatch_id} raised "
        f"{describe_error(error)}",
        ubatch_id=ubatch_id,
    )
    wrapped.__cause__ = error
    return wrapped
