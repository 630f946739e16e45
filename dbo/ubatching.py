"""The ubatch contexts and the dbo_* helpers: who may run, on which stream, and when to yield.

N ubatch threads share one compute stream and one comm stream and pass a single baton round a
ring: context i waits on its own CPU signal and, when it yields, sets signal (i + 1) mod N.
Only the holder of the baton runs Python, which is what lets each ubatch own a workspace slot
without locks. Each context also owns a compute-done and a comm-done device event, used by the
yield-and-switch helpers to order the two streams for that ubatch.

Documented registries (the only module state):
- `_THREAD_ID_TO_CONTEXT`: thread ident -> ubatch id, for the threads of the running step;
- `_CURRENT_CONTEXTS`: ubatch id -> its `UBatchContext` while it runs, else None;
- `_forward_context`: the forward context of threads that are not ubatches (serial steps,
  set by `set_forward_context`); a ubatch thread reads its own context's instead, so its
  forward context is restored on every resume and never leaks into the launcher.
Threads register and unregister under `_REGISTRY_LOCK` (once per ubatch per step, never on
the yield path), so a late thread of a finished or aborted step cannot register into the
next one, and a second step cannot take over the slots of a running one.

Differences from vLLM's `vllm/v1/worker/ubatching.py`, all on failure or misuse paths: an
exception or an early exit in one ubatch releases its peers (`UBatchStep.abort`), a yield
count that differs between ubatches is reported instead of hanging, `dbo_current_ubatch_id()`
answers 0 for a thread that is not a ubatch, `dbo_enabled()` and `current_forward_context()`
answer for the calling thread, and a second step started while one runs is refused.
"""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from dbo._checks import as_int
from dbo.errors import UBatchError, YieldMismatchError, _describe, _StepAborted
from dbo.frames import register_runtime_file
from dbo.streams import Device, Event, Stream, stream_context

register_runtime_file(__file__)  # race reports leave the runtime's frames out of user stacks

__all__ = [
    "UBatchContext",
    "UBatchStep",
    "make_ubatch_contexts",
    "dbo_enabled",
    "ubatch_step_active",
    "dbo_current_ubatch_id",
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
]

_THREAD_ID_TO_CONTEXT: dict[int, int] = {}
_CURRENT_CONTEXTS: list[UBatchContext | None] = []
_forward_context: Any = None
# Guards registration and step close. Readers (dbo_current_ubatch_id, the helpers) take no
# lock: a single dict/list read is atomic, and a thread only ever reads its own entry.
_REGISTRY_LOCK = threading.Lock()

_get_ident = threading.get_ident


# --------------------------------------------------------------------------------------------
# The baton


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
class _UBatchState:
    status: str = NOT_STARTED
    yields: int = 0
    # The ubatch's thread: error reports look up where it is parked through
    # sys._current_frames(), so the yield path formats no stack (a stack capture per yield
    # measurably slowed every handoff).
    thread_ident: int | None = None
    # Where the ubatch last yielded (code, line), so a report can place a ubatch that has
    # finished; reading two frame attributes costs far less than formatting a stack.
    last_yield: tuple[Any, int] | None = None


class UBatchStep:
    """The shared state of one ubatched step: yield counts, status, and the first failure.

    Every context of the step holds it. `abort` records the first error and wakes every parked
    thread, which then unwinds with `_StepAborted` instead of running on.
    """

    def __init__(self, num_ubatches: int, ready_barrier: threading.Barrier) -> None:
        self.num_ubatches = num_ubatches
        self.ready_barrier = ready_barrier
        self.signals = [CpuSignal() for _ in range(num_ubatches)]
        self.states = [_UBatchState() for _ in range(num_ubatches)]
        self.contexts: list[UBatchContext] = []  # filled by make_ubatch_contexts
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

    def close(self) -> None:
        """End the step for the registries: drop every registration it still has and refuse
        late ones (a thread left behind by a timeout that reaches `__enter__` afterwards).
        The launcher calls it once the step is over, whatever the outcome."""
        with _REGISTRY_LOCK:
            self.closed = True
            for ctx in self.contexts:
                ctx._unregister_locked()

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

    def _mismatch(self, reason: str) -> YieldMismatchError:
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
        return _as_ubatch_error(ubatch_id, error)

    def fail(self, ubatch_id: int, error: BaseException) -> None:
        """Record that `error` left ubatch `ubatch_id` and end the step (the first failure
        wins). Formatting the user's exception cannot make it raise: a failure is never lost
        to a broken `__str__`."""
        try:
            wrapped = self.error_for(ubatch_id, error)
        except BaseException:  # noqa: BLE001 - say what we can rather than lose the failure
            wrapped = UBatchError(f"ubatch {ubatch_id} failed", ubatch_id=ubatch_id)
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
    (threading's lock wait, this module): where the user called a dbo_* helper."""
    innermost, inside = frame, None
    while frame is not None:
        if frame.f_code.co_filename == __file__:
            inside = frame
        frame = frame.f_back
    if inside is None:  # a running thread outside the baton machinery: where it is now
        return innermost
    return inside.f_back if inside.f_back is not None else inside


# --------------------------------------------------------------------------------------------
# Contexts


class UBatchContext:
    """One ubatch's seat in the ring: its streams, events, forward context and recv hook.

    Each method below says what it records (device events), which stream it leaves the
    calling thread on, whether it waits (the CPU parked for the baton, or a stream made to
    wait on an event), and whether it hands the baton on. The `dbo_*` helpers call them for
    the calling ubatch and are no-ops on any other thread. In short:

    method                                  records        leaves on  waits            baton
    yield_                                  nothing        unchanged  CPU, for baton   yes
    yield_and_switch_from_compute_to_comm   compute-done   comm       CPU; comm waits  yes
    yield_and_switch_from_comm_to_compute   comm-done      compute    CPU; compute w.  yes
    switch_to_comm / switch_to_compute      nothing        comm / cp  no               no
    switch_to_comm_sync                     compute-done   comm       comm waits       no
    switch_to_compute_sync                  comm-done      compute    compute waits    no
    maybe_run_recv_hook                     (the hook's)   unchanged  (the hook's)     no
    """

    def __init__(
        self,
        id: int,
        step: UBatchStep,
        compute_stream: Stream,
        comm_stream: Stream,
        forward_context: Any,
        cpu_wait_event: CpuSignal,
        cpu_signal_event: CpuSignal,
        gpu_compute_done_event: Event,
        gpu_comm_done_event: Event,
        schedule: str = "default",
    ) -> None:
        self.id = id
        self.step = step
        self.device: Device = compute_stream.device
        self.compute_stream = compute_stream
        self.comm_stream = comm_stream
        self.forward_context = forward_context
        self.ready_barrier = step.ready_barrier
        self.cpu_wait_event = cpu_wait_event
        self.cpu_signal_event = cpu_signal_event
        self.gpu_compute_done_event = gpu_compute_done_event
        self.gpu_comm_done_event = gpu_comm_done_event
        self.schedule = schedule
        self.current_stream = compute_stream
        self.recv_hook: Callable[[], Any] | None = None
        self._registered_ident: int | None = None
        self._state = step.states[id]
        self._next_state = step.states[(id + 1) % step.num_ubatches]
        # The hand-off's calls, bound once: see CpuSignal.
        self._on_handoff = self.device.on_handoff
        self._signal_next = cpu_signal_event.release
        self._wait_own = cpu_wait_event.acquire

    # -- enter / exit ------------------------------------------------------------------------

    def __enter__(self) -> UBatchContext:
        """Register this thread as the ubatch, wait at the ready barrier with its peers, then
        park until the baton arrives (ubatch 0 gets it from the launcher). Records nothing;
        leaves the thread on the compute stream; hands nothing on."""
        try:
            self._register()
            try:
                self.ready_barrier.wait()
            except threading.BrokenBarrierError:
                raise _StepAborted() from None
            self._wait_for_baton()
            self._state.status = RUNNING
            self.update_stream(self.compute_stream)
        except _StepAborted:
            # A peer failed (or the launcher gave up) before this ubatch ran: __exit__ will not
            # be called, so leave the registries here.
            self._state.status = ABORTED
            self._unregister()
            raise
        except BaseException as error:
            self._state.status = FAILED
            self._unregister()
            self.step.fail(self.id, error)
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        """On a normal finish: run a pending recv hook, check every ubatch yielded as often,
        unregister and hand the baton on for the last time (so the peers can finish). On a
        failure: abort the step, which releases every parked peer. Records nothing itself."""
        step = self.step
        if exc_type is None and not step.aborted:
            try:
                self.maybe_run_recv_hook()
                self._check_counts_at_exit()
            except BaseException as error:  # noqa: BLE001 - reported through the step
                self._state.status = FAILED
                self._unregister()
                step.fail(self.id, error)
                return False
            self._state.status = FINISHED
            self._unregister()
            self.device.on_handoff()
            self.cpu_signal_event.set()
            return False
        # exc_type None here: fn returned, but the step was aborted meanwhile (a timeout)
        self._state.status = (
            FINISHED if exc_type is None else ABORTED if exc_type is _StepAborted else FAILED
        )
        self._unregister()
        # A _StepAborted unwinds an aborted step; raised while the step is live (by user code,
        # or from another step) it is a failure like any other, or the peers would wait on.
        if exc is not None and not (exc_type is _StepAborted and step.aborted):
            step.fail(self.id, exc)
        return False

    def _register(self) -> None:
        ident = _get_ident()
        self._state.thread_ident = ident
        with _REGISTRY_LOCK:
            if self.step.closed or self.step.aborted:
                raise _StepAborted()  # a late thread of a step that is already over
            occupant = _CURRENT_CONTEXTS[self.id]
            if occupant is not None and occupant is not self:
                raise RuntimeError(
                    f"ubatch {self.id} cannot start: ubatch {self.id} of another step is "
                    f"still running in this process; DBO runs one step at a time (the "
                    f"registries are process-wide)"
                )
            _THREAD_ID_TO_CONTEXT[ident] = self.id
            _CURRENT_CONTEXTS[self.id] = self
            self._registered_ident = ident

    def _unregister(self) -> None:
        with _REGISTRY_LOCK:
            self._unregister_locked()

    def _unregister_locked(self) -> None:
        # Only this context's own entries: the thread ident may already serve a newer step
        # (workers are reused), and the slot may hold a newer step's context.
        ident = self._registered_ident
        if ident is not None and _THREAD_ID_TO_CONTEXT.get(ident) == self.id:
            del _THREAD_ID_TO_CONTEXT[ident]
        self._registered_ident = None
        if self.id < len(_CURRENT_CONTEXTS) and _CURRENT_CONTEXTS[self.id] is self:
            _CURRENT_CONTEXTS[self.id] = None

    def _check_counts_at_exit(self) -> None:
        mine = self._state.yields
        for i, state in enumerate(self.step.states):
            if i != self.id and state.yields != mine:
                raise self.step._mismatch(f"ubatch {self.id} finished after {mine}")

    # -- the baton ---------------------------------------------------------------------------

    def _wait_for_baton(self) -> None:
        self.cpu_wait_event.wait()
        if self.step.aborted:
            raise _StepAborted()

    def _cpu_yield(self) -> None:
        state = self._state
        step = self.step
        if step.aborted:
            raise _StepAborted()
        state.yields += 1
        caller = sys._getframe(1)
        while caller.f_back is not None and caller.f_code.co_filename == __file__:
            caller = caller.f_back
        state.last_yield = (caller.f_code, caller.f_lineno)
        if self._next_state.status in (FINISHED, FAILED):
            raise step._mismatch(f"ubatch {self.id} yielded to a finished ubatch")
        state.status = PARKED
        self._on_handoff()
        try:
            self._signal_next()
        except RuntimeError:
            pass  # already signalled: only an abort sets a signal twice, and it is seen below
        self._wait_own()
        if step.aborted:
            raise _StepAborted()
        state.status = RUNNING

    # -- streams -----------------------------------------------------------------------------

    def update_stream(self, stream: Stream) -> None:
        """Make `stream` the calling thread's current stream. Records nothing, no wait, no
        baton: ordering against the other stream is the caller's business."""
        self.current_stream = stream
        if self.device.current_stream() is not stream:
            self.device.set_stream(stream)

    def _signal_comm_done(self) -> None:
        self.gpu_comm_done_event.record(self.comm_stream)

    def _signal_compute_done(self) -> None:
        self.gpu_compute_done_event.record(self.compute_stream)

    def _wait_compute_done(self) -> None:
        self.comm_stream.wait_event(self.gpu_compute_done_event)

    def _wait_comm_done(self) -> None:
        self.compute_stream.wait_event(self.gpu_comm_done_event)

    def switch_to_comm(self) -> None:
        """Leave the thread on the comm stream. Records nothing, waits for nothing, keeps the
        baton: comm work issued next is NOT ordered after this ubatch's compute work (use
        `switch_to_comm_sync` when it reads what compute wrote)."""
        self.update_stream(self.comm_stream)

    def switch_to_compute(self) -> None:
        """Leave the thread on the compute stream. Records nothing, waits for nothing, keeps
        the baton: compute work issued next is NOT ordered after this ubatch's comm work."""
        self.update_stream(self.compute_stream)

    def switch_to_comm_sync(self) -> None:
        """Record this ubatch's compute-done event on the compute stream, leave the thread on
        the comm stream and make the comm stream wait on that event (a device-side wait; the
        CPU does not block). Keeps the baton."""
        self._signal_compute_done()
        self.update_stream(self.comm_stream)
        self._wait_compute_done()

    def switch_to_compute_sync(self) -> None:
        """Record this ubatch's comm-done event on the comm stream, leave the thread on the
        compute stream and make the compute stream wait on that event (device-side; the CPU
        does not block). Keeps the baton."""
        self._signal_comm_done()
        self.update_stream(self.compute_stream)
        self._wait_comm_done()

    def maybe_run_recv_hook(self) -> None:
        """Run, once, the recv hook the previous ubatch registered on this one (normally a
        wait of the current stream on a low-latency transfer's arrival event). Records and
        waits only as the hook does, on the current stream, which it leaves unchanged; keeps
        the baton. Also run when the ubatch finishes, so no hook is left behind."""
        hook = self.recv_hook
        if hook is not None:
            self.recv_hook = None
            hook()

    def yield_(self) -> None:
        """Hand the baton to the next ubatch in the ring and park the CPU until it comes back.
        Records nothing on the device and leaves the thread on the stream it was on."""
        # vLLM saves the current stream here and restores it on resume. The current stream is
        # per thread on every device (as in torch.cuda), so no peer can change it while this
        # ubatch is parked: the save/restore pair would only cost time on every handoff.
        self._cpu_yield()

    def yield_and_switch_from_compute_to_comm(self) -> None:
        """Must be called on the compute stream. Record the compute-done event there, hand
        the baton on and park; on resume leave the thread on the comm stream, which waits
        (device-side) on that event, so the comm work reads finished compute results."""
        self._expect_stream(self.compute_stream, "dbo_yield_and_switch_from_compute_to_comm")
        self._signal_compute_done()
        self._cpu_yield()
        self.update_stream(self.comm_stream)
        self._wait_compute_done()

    def yield_and_switch_from_comm_to_compute(self) -> None:
        """Must be called on the comm stream. Record the comm-done event there, hand the
        baton on and park; on resume leave the thread on the compute stream, which waits
        (device-side) on that event, so compute reads what the comm work delivered."""
        self._expect_stream(self.comm_stream, "dbo_yield_and_switch_from_comm_to_compute")
        self._signal_comm_done()
        self._cpu_yield()
        self.update_stream(self.compute_stream)
        self._wait_comm_done()

    def _expect_stream(self, stream: Stream, helper: str) -> None:
        current = self.device.current_stream()
        if current is not stream:
            raise RuntimeError(
                f"{helper}() called in ubatch {self.id} on stream {current.name!r}, but it "
                f"must be called on {stream.name!r}; switch streams first"
            )

    def __repr__(self) -> str:
        return f"<UBatchContext {self.id}/{self.step.num_ubatches} {self._state.status}>"


def _as_ubatch_error(ubatch_id: int, error: BaseException) -> UBatchError:
    wrapped = UBatchError(f"ubatch {ubatch_id} raised {_describe(error)}", ubatch_id=ubatch_id)
    wrapped.__cause__ = error
    return wrapped


def make_ubatch_contexts(
    num_micro_batches: int,
    compute_stream: Stream,
    comm_stream: Stream,
    forward_contexts: Sequence[Any],
    ready_barrier: threading.Barrier,
    schedule: str = "default",
) -> list[UBatchContext]:
    """Build the ring of N contexts (vLLM's signature). The launcher then calls
    `contexts[0].step.release_first()` (or `contexts[0].cpu_wait_event.set()`) after the
    barrier to let ubatch 0 run."""
    num_micro_batches = as_int("num_micro_batches", num_micro_batches)
    if num_micro_batches < 2:
        raise ValueError(
            f"num_micro_batches must be >= 2 for DBO, got {num_micro_batches}; run the step "
            f"without ubatching instead"
        )
    device = compute_stream.device
    device.check_stream(compute_stream, "compute_stream")
    device.check_stream(comm_stream, "comm_stream")
    if len(forward_contexts) != num_micro_batches:
        raise ValueError(
            f"forward_contexts has {len(forward_contexts)} entries, expected one per ubatch "
            f"({num_micro_batches})"
        )
    if ready_barrier.parties != num_micro_batches + 1:
        raise ValueError(
            f"ready_barrier must have num_micro_batches + 1 = {num_micro_batches + 1} parties "
            f"(the ubatch threads and the launcher), got {ready_barrier.parties}"
        )
    with _REGISTRY_LOCK:
        # Catches a step started while another runs (a nested call from inside a ubatch, a
        # second launcher thread); one that slips in before the first step's threads have
        # registered is refused when its threads try to (UBatchContext._register).
        if any(ctx is not None for ctx in _CURRENT_CONTEXTS):
            raise RuntimeError(
                "another ubatched step is still running in this process; DBO runs one step "
                "at a time (the registries are process-wide)"
            )
        if len(_CURRENT_CONTEXTS) < num_micro_batches:
            _CURRENT_CONTEXTS.extend([None] * (num_micro_batches - len(_CURRENT_CONTEXTS)))
    step = UBatchStep(num_micro_batches, ready_barrier)
    step.contexts = [
        UBatchContext(
            id=i,
            step=step,
            compute_stream=compute_stream,
            comm_stream=comm_stream,
            forward_context=forward_contexts[i],
            cpu_wait_event=step.signals[i],
            cpu_signal_event=step.signals[(i + 1) % num_micro_batches],
            gpu_compute_done_event=device.Event(),
            gpu_comm_done_event=device.Event(),
            schedule=schedule,
        )
        for i in range(num_micro_batches)
    ]
    return list(step.contexts)


# --------------------------------------------------------------------------------------------
# Helpers: each is a no-op on a thread that is not a ubatch thread, as in vLLM.


def _current_context() -> UBatchContext | None:
    ubatch_id = _THREAD_ID_TO_CONTEXT.get(_get_ident())
    if ubatch_id is None:
        return None
    return _CURRENT_CONTEXTS[ubatch_id]


def ubatch_step_active() -> bool:
    """True while any thread is registered as a ubatch or any context is live (between steps,
    and after every failed one, this is False)."""
    return bool(_THREAD_ID_TO_CONTEXT) or any(ctx is not None for ctx in _CURRENT_CONTEXTS)


def dbo_enabled() -> bool:
    """True on a thread that runs a ubatch of the current step. A query: records nothing,
    waits for nothing, keeps the baton.

    vLLM answers True on every thread while any step runs; this answers for the caller, so
    a launcher or helper thread is never told to yield or switch streams it does not own."""
    return _get_ident() in _THREAD_ID_TO_CONTEXT


def dbo_current_ubatch_id() -> int:
    """The calling thread's ubatch id; 0 for any other thread (it is not a ubatch). A query:
    records nothing, waits for nothing, keeps the baton.

    vLLM raises KeyError for a non-ubatch thread while a step runs; 0 keeps serial code on
    such a thread working. Its workspace calls then share ubatch 0's slot, as every caller
    outside a step does, so such a thread must not hold workspace views across a step."""
    return _THREAD_ID_TO_CONTEXT.get(_get_ident(), 0)


def _ubatch_helper(method: Callable[[UBatchContext], None]) -> Callable[[], None]:
    def helper() -> None:
        ctx = _current_context()
        if ctx is not None:
            method(ctx)

    helper.__name__ = f"dbo_{method.__name__.rstrip('_')}"
    helper.__doc__ = (
        f"`UBatchContext.{method.__name__}` for the calling ubatch; a no-op on any other "
        f"thread (a serial step).\n\n" + (method.__doc__ or "").replace("\n        ", "\n")
    )
    return helper


def dbo_yield() -> None:
    """`UBatchContext.yield_` for the calling ubatch; no-op elsewhere."""
    # Written out rather than made by _ubatch_helper: it is the hot path, and two fewer
    # Python frames per pass show in the bench's baton figures.
    ubatch_id = _THREAD_ID_TO_CONTEXT.get(_get_ident())
    if ubatch_id is not None:
        ctx = _CURRENT_CONTEXTS[ubatch_id]
        if ctx is not None:
            ctx._cpu_yield()


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
    if nxt._state.status in (FINISHED, FAILED, ABORTED):
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
