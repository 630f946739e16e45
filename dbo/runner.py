"""Run one ubatched step: N threads in the ring, started together, joined, and never left hung.

`run_ubatches(fn, inputs)` is the launcher half of vLLM's `UBatchWrapper`: it builds the
contexts, hands each ubatch to a worker thread (long-lived, reused across steps, unlike
vLLM's thread per ubatch per step: see `dbo.workers`), waits for all of them at the ready
barrier, releases ubatch 0, and waits for the step to finish. Unlike the reference it always
comes back: a raising ubatch, a yield-count mismatch, a stuck thread or a failing launcher
ends the step with one error (`dbo.errors`), the peers released, the registries empty and
every worker thread either back in the pool or, if stuck in user code, ending when it returns.

No failure is lost on the way: whatever a ubatch raises (any BaseException, one whose
`__str__` raises included) ends the step as one `UBatchError` naming it, the original as
`__cause__`; an output is returned only when every ubatch returned one. The launcher never
blocks for long in one wait (`_wait_until` waits in slices), so Ctrl-C reaches the caller
promptly even while a ubatch runs long user code, and `timeout=math.inf` (no timeout) needs no
special path. A step that fails under `graph=` leaves a graph that refuses to replay: it
captured part of a step.
"""

from __future__ import annotations

import math
import numbers
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from dbo import ubatch_registry, ubatching
from dbo.devices import resolve_device, use_device
from dbo.errors import StepAborted, UBatchError, UBatchTimeoutError, describe_error
from dbo.frames import register_runtime_file
from dbo.streams import Device, Stream
from dbo.ubatching import UBatchContext, make_ubatch_contexts
from dbo.workers import WORKERS

register_runtime_file(__file__)  # race reports leave the runtime's frames out of user stacks

__all__ = ["run_ubatches", "merge_outputs", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 60.0
# How long the launcher waits, after it gave up on a step (timeout, Ctrl-C), for the ubatches
# it released to unwind: enough for parked threads to return to the pool, short enough that
# the error reaches the caller right after the timeout. A thread still busy after it is
# abandoned (it ends when its user code returns).
_UNWIND_GRACE_S = 0.05
# The longest single wait of the launcher: a signal handler (Ctrl-C) runs between slices even
# if the signal was delivered to another thread.
_WAIT_SLICE_S = 0.1
_LONGEST_BARRIER_WAIT_S = 1e6


def run_ubatches(
    fn: Callable[[Any], Any],
    ubatch_inputs: Sequence[Any],
    *,
    device: Device | str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    forward_contexts: Sequence[Any] | None = None,
    compute_stream: Stream | None = None,
    comm_stream: Stream | None = None,
    schedule: str = "default",
    graph: Any = None,
    token_offsets: Sequence[int] | None = None,
) -> list[Any]:
    """Run `fn(ubatch_inputs[i])` in ubatch i's thread and return the outputs in ubatch order.

    `ubatch_inputs`: a sequence indexed 0..N-1 (a list or tuple), N >= 2; sets and mappings
    are refused (their order is not a ubatch order). `device`: a `dbo.streams.Device`, "sim",
    "cuda" or None (the calling thread's device). `timeout`: seconds for the whole step (
    `math.inf`: none); past it, `UBatchTimeoutError` with every thread's stack. `graph`: a
    capture from `device.graph()`, entered after every thread is ready (so threads create
    their handles before capture, as vLLM does) and exited after they finish; if the step
    fails, its `replay()` raises instead of replaying the partial step. `token_offsets`: each
    ubatch's first row in the parent batch (`dbo_current_ubatch_token_offset()`). One step
    runs at a time per process; a failing launcher (the graph cannot be entered, Ctrl-C)
    releases every ubatch, waits a short grace for them, then raises its own exception.
    """
    request = _StepRequest(
        fn=fn,
        inputs=_checked_inputs(fn, ubatch_inputs),
        timeout=_check_timeout(timeout),
        forward_contexts=_optional_indexed("forward_contexts", forward_contexts),
        device=resolve_device(device),
        compute_stream=compute_stream,
        comm_stream=comm_stream,
        schedule=schedule,
        graph=graph,
        token_offsets=token_offsets,
    )
    with _one_step_at_a_time():
        return _run_step(request)


@contextmanager
def _one_step_at_a_time() -> Iterator[None]:
    """The process's one step: a call made while another step runs (from another thread, or
    from inside a ubatch) raises RuntimeError at once, as the registries are process-wide."""
    # Non-blocking: the holder may be this very thread's caller (fn calling run_ubatches),
    # which would deadlock a blocking acquire.
    if not _STEP_LOCK.acquire(blocking=False):
        raise RuntimeError(
            "another ubatched step is still running in this process (started from another "
            "thread, or fn called run_ubatches); DBO runs one step at a time (the registries "
            "are process-wide)"
        )
    try:
        yield
    finally:
        _STEP_LOCK.release()


def _optional_indexed(name: str, values: Sequence[Any] | None) -> list[Any] | None:
    return None if values is None else _indexed(name, values)


def _checked_inputs(fn: Any, ubatch_inputs: Sequence[Any]) -> list[Any]:
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    inputs = _indexed("ubatch_inputs", ubatch_inputs)
    if len(inputs) < 2:
        raise ValueError(
            f"run_ubatches needs >= 2 ubatch inputs, got {len(inputs)}; call fn directly for one"
        )
    return inputs


# Held by the launcher for a whole step: two launcher threads racing past
# make_ubatch_contexts' check would otherwise both run, each taking over the other's slots.
_STEP_LOCK = threading.Lock()


def _indexed(name: str, values: Any) -> list[Any]:
    """`values[0..len-1]` as a list, or a TypeError saying why not: done before any thread
    starts, so that input a worker could not index fails here and not as a timeout."""
    kind = type(values).__name__
    if isinstance(values, (Mapping, AbstractSet)):
        raise TypeError(
            f"{name} must be a sequence indexed 0..N-1 in ubatch order (a list or tuple), got "
            f"a {kind}; pass a list, e.g. list(d.values()) in the order the ubatches run"
        )
    try:
        num = len(values)
    except TypeError:
        raise TypeError(
            f"{name} must be a sequence with a length (a list or tuple), got a {kind}; "
            f"materialise it first, e.g. list(...)"
        ) from None
    try:
        return [values[i] for i in range(num)]
    except (TypeError, KeyError, IndexError) as error:
        raise TypeError(
            f"{name} must be a sequence indexed 0..{num - 1} (a list or tuple), but a {kind} "
            f"of length {num} refused an index ({describe_error(error)})"
        ) from error


def _check_timeout(timeout: Any) -> float:
    # Any real number (numpy scalars included); bools are Integral but never a duration.
    ok = isinstance(timeout, numbers.Real) and not isinstance(timeout, bool)
    if ok and isinstance(timeout, numbers.Integral) and int(timeout) > 1e300:
        return math.inf  # beyond a float: no timeout, as math.inf
    seconds = float(timeout) if ok else math.nan
    if math.isnan(seconds) or seconds <= 0:
        try:
            shown = repr(timeout)[:80]
        except Exception:  # noqa: BLE001 - the message must not fail on odd input
            shown = f"a {type(timeout).__name__}"
        raise ValueError(
            f"timeout must be a positive number of seconds (math.inf for none), got {shown}"
        )
    return seconds


def _barrier_timeout(deadline: float) -> float | None:
    # The ready barrier cannot be waited for in slices (a timed-out wait breaks it), and
    # threading overflows on waits near TIMEOUT_MAX: a wait beyond this is simply unbounded.
    left = max(deadline - time.monotonic(), 0.0)
    return None if left > _LONGEST_BARRIER_WAIT_S else left


def _wait_until(event: threading.Event, deadline: float) -> bool:
    """Wait for `event` until `deadline` (time.monotonic(); inf: forever), in slices."""
    while not event.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        event.wait(min(left, _WAIT_SLICE_S))
    return True


@dataclass(frozen=True)
class _StepRequest:
    """One validated `run_ubatches` call."""

    fn: Callable[[Any], Any]
    inputs: list[Any]
    device: Device
    timeout: float
    forward_contexts: list[Any] | None
    compute_stream: Stream | None
    comm_stream: Stream | None
    schedule: str
    graph: Any
    token_offsets: Sequence[int] | None


class _Launch:
    """The launcher's side of one step, in its phases: `__init__` builds the contexts and
    takes worker threads, `run` hands each thread its ubatch and releases the ring (inside
    the graph capture, if any), `unwind` waits for the threads to leave, `result` returns the
    outputs or raises the one error the step ends with."""

    def __init__(self, request: _StepRequest) -> None:
        self.request = request
        device, num = request.device, len(request.inputs)
        default_compute, default_comm = device.ubatch_streams()
        self.compute_stream = request.compute_stream or default_compute
        self.comm_stream = request.comm_stream or default_comm
        self.barrier = threading.Barrier(num + 1)
        contexts = request.forward_contexts
        self.contexts = make_ubatch_contexts(
            num,
            self.compute_stream,
            self.comm_stream,
            contexts if contexts is not None else [None] * num,
            self.barrier,
            request.schedule,
            request.token_offsets,
        )
        self.step = self.contexts[0].step
        self.outputs: list[Any] = [None] * num
        self.returned = [False] * num  # set only once a ubatch's fn returned and exited
        self.remaining = num
        self.all_done = threading.Event()
        self.done_lock = threading.Lock()
        self.deadline = time.monotonic() + request.timeout
        self.launch_stream = device.current_stream()
        # The ubatches' streams start after whatever the launcher issued before the step.
        self.compute_stream.wait_stream(self.launch_stream)
        self.comm_stream.wait_stream(self.launch_stream)
        self.workers = WORKERS.acquire(num)
        self.threads = [w.thread for w in self.workers]
        self.gave_up = False  # the launcher ended the step itself (timeout, interrupt)
        self.launcher_error: BaseException | None = None
        self.launcher_first = False
        self.capturing = False

    def on_done(self) -> None:
        with self.done_lock:
            self.remaining -= 1
            if self.remaining == 0:
                self.all_done.set()

    def on_timeout(self, where: str) -> None:
        if self.step.error is None:
            self.gave_up = True
            self.step.abort(_timeout_error(self.step, self.threads, self.request.timeout, where))
            # A thread in user code now cannot be stopped: cut it off from the runtime, so
            # that when its blocking call returns it unwinds instead of reaching a later step.
            self.step.cut_off_running()

    def run(self) -> None:
        """Submit every ubatch, wait for all to be ready, then release the ring."""
        try:
            for ctx, worker in zip(self.contexts, self.workers):
                worker.submit(self.on_done, self.ubatch_main, ctx)
            try:
                self.barrier.wait(timeout=_barrier_timeout(self.deadline))
            except threading.BrokenBarrierError:
                self.on_timeout("at the ready barrier")  # no-op if a ubatch broke it by failing
            if self.step.error is None:
                self._release()
        except BaseException as error:  # noqa: BLE001 - re-raised by result(), after the peers go
            # The launcher's own failure: without an abort the parked ubatches would wait for
            # a baton that never comes, holding their worker threads forever.
            self.launcher_error, self.launcher_first = error, self.step.error is None
            if self.launcher_first:
                self.step.abort(UBatchError(f"the launcher failed: {describe_error(error)}"))

    def _release(self) -> None:
        graph = self.request.graph
        if graph is None:
            self._release_and_wait()
            return
        # Entered only now, with every thread parked at its baton: their per-thread set-up
        # (device scope, handles) happened before capture, as in vLLM.
        graph.capture_stream = self.compute_stream
        with graph:
            self.capturing = True
            self._release_and_wait()

    def _release_and_wait(self) -> None:
        # Under graph capture the comm stream must fork from, and join back into, the capturing
        # stream; outside capture these waits are free ordering.
        self.comm_stream.wait_stream(self.compute_stream)
        self.step.release_first()
        if _wait_until(self.all_done, self.deadline):
            self.compute_stream.wait_stream(self.comm_stream)
        else:
            # Still inside a graph capture, if any: the peers are released before it ends.
            self.on_timeout("while running")

    def ubatch_main(self, ctx: UBatchContext) -> None:
        """The job of ubatch `ctx.id`'s worker thread: run fn on its input inside its context."""
        request = self.request
        try:
            with use_device(request.device), request.device.thread_scope(ctx.id), ctx:
                output = request.fn(request.inputs[ctx.id])
            self.outputs[ctx.id] = output
            self.returned[ctx.id] = True
        except StepAborted:
            pass  # an unwind (UBatchAbandoned included); the context reported a live-step one
        except BaseException as error:  # noqa: BLE001 - every failure ends the step, never a thread
            # ctx.__exit__ has recorded errors raised inside the context (the first one wins);
            # this catches failures around it (entering the device scope, say).
            ctx.step.fail(ctx.id, error)
        finally:
            # The job is over: if the launcher abandoned this thread, it runs no more of that
            # step's user code, and may serve a later step when its worker is reused.
            ubatch_registry.clear_abandoned_mark()

    @property
    def interrupted(self) -> bool:
        error = self.launcher_error
        return error is not None and not isinstance(error, Exception)

    def unwind(self) -> None:
        """Wait for the ubatch threads to leave, then give them back to the pool.

        Peers wake promptly after an abort; a thread stuck in user code cannot be stopped, so
        it is left behind (and never reused) instead of hanging the caller. After a ubatch
        failed, its peers' unwinding (their finally blocks) finishes before the caller sees
        the error; after the launcher gave up, only a short grace is given."""
        try:
            if self.gave_up or self.interrupted:
                _wait_until(self.all_done, time.monotonic() + _UNWIND_GRACE_S)
            else:
                _wait_until(self.all_done, self.deadline)
        finally:
            self.step.close()
            WORKERS.release(self.workers)

    def result(self) -> list[Any]:
        failure = self.step.error if self.step.error is not None else self.launcher_error
        if failure is None and not all(self.returned):
            failure = _lost_outputs(self.returned)
        if failure is not None:
            if self.capturing:
                self.request.graph.refuse_replay(describe_error(failure).splitlines()[0])
            # The launcher's own error if it came first, an interrupt always; else the step's.
            if self.launcher_error is not None and (self.launcher_first or self.interrupted):
                raise self.launcher_error
            raise failure
        self.launch_stream.wait_stream(self.compute_stream)
        self.launch_stream.wait_stream(self.comm_stream)
        return self.outputs


def _run_step(request: _StepRequest) -> list[Any]:
    launch = _Launch(request)
    try:
        launch.run()
    finally:
        launch.unwind()
    return launch.result()


def _lost_outputs(returned: list[bool]) -> UBatchError:
    # Defensive: every failure path aborts the step, so this means one was lost on the way;
    # returning None in place of an output would be a silent wrong result.
    missing = [i for i, ok in enumerate(returned) if not ok]
    return UBatchError(
        f"ubatch(es) {missing} ended without returning an output or reporting an error",
        ubatch_id=missing[0] if len(missing) == 1 else None,
    )


def _timeout_error(
    step: ubatching.UBatchStep, threads: list[threading.Thread], timeout: float, where: str
) -> UBatchTimeoutError:
    frames = sys._current_frames()
    stacks: dict[int, str] = {}
    for i, thread in enumerate(threads):
        frame = frames.get(thread.ident) if thread.ident is not None else None
        stacks[i] = "".join(traceback.format_stack(frame)) if frame is not None else "(exited)"
    detail = "\n".join(f"--- ubatch {i} ---\n{stack}" for i, stack in stacks.items())
    return UBatchTimeoutError(
        f"ubatched step did not finish within {timeout:g} s ({where}); a ubatch is stuck "
        f"outside the dbo primitives:\n{step.describe()}\n{detail}",
        stacks=stacks,
    )


def merge_outputs(outputs: Sequence[Any]) -> Any:
    """Concatenate per-ubatch outputs along dim 0: tensors, and tuples/lists of tensors
    (element-wise); None stays None."""
    if len(outputs) == 0:
        raise ValueError("merge_outputs needs at least one output")
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(o, torch.Tensor) for o in outputs):
            raise TypeError("merge_outputs: every ubatch must return a tensor when ubatch 0 does")
        return torch.cat(list(outputs), dim=0)
    if isinstance(first, (tuple, list)):
        if not all(isinstance(o, (tuple, list)) and len(o) == len(first) for o in outputs):
            raise TypeError(
                "merge_outputs: every ubatch must return a tuple/list of the same length, got "
                f"lengths {[len(o) if isinstance(o, (tuple, list)) else None for o in outputs]}"
            )
        return type(first)(merge_outputs([o[k] for o in outputs]) for k in range(len(first)))
    if first is None and all(o is None for o in outputs):
        return None
    raise TypeError(
        f"merge_outputs handles tensors and tuples/lists of tensors, got {type(first).__name__}"
    )
