"""Run one ubatched step: N threads in the ring, started together, joined, and never left hung.

`run_ubatches(fn, inputs)` is the launcher half of vLLM's `UBatchWrapper`: it builds the
contexts, hands each ubatch to a worker thread (long-lived, reused across steps, unlike
vLLM's thread per ubatch per step: see `_UBatchWorker`), waits for all of them at the ready
barrier, releases ubatch 0, and waits for the step to finish. Unlike the reference it always
comes back: a raising ubatch, a yield-count mismatch, a stuck thread or a failing launcher
ends the step with one error (`dbo.errors`), the peers released, the registries empty and
every worker thread either back in the pool or, if stuck in user code, ending when it returns.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
from typing import Any, Callable, Sequence

import torch

from dbo import ubatching
from dbo.errors import UBatchError, UBatchTimeoutError, _StepAborted
from dbo.devices import resolve_device, use_device
from dbo.streams import Device, Stream
from dbo.ubatching import UBatchContext, _as_ubatch_error, make_ubatch_contexts

__all__ = ["run_ubatches", "merge_outputs", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 60.0


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
) -> list[Any]:
    """Run `fn(ubatch_inputs[i])` in ubatch i's thread and return the outputs in ubatch order.

    `device`: a `dbo.streams.Device`, "sim", "cuda" or None (the calling thread's device).
    `timeout`: seconds for the whole step; past it, `UBatchTimeoutError` with every thread's
    stack. `graph`: a capture from `device.graph()`, entered after every thread is ready (so
    threads create their handles before capture, as vLLM does) and exited after they finish.

    One step at a time per process: a call made while another step runs (from another
    thread, or from inside a ubatch) raises RuntimeError at once. If the launcher itself
    fails (the graph cannot be entered, KeyboardInterrupt), every ubatch is released first
    and that exception is raised.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    num = len(ubatch_inputs)
    if num < 2:
        raise ValueError(
            f"run_ubatches needs >= 2 ubatch inputs, got {num}; call fn directly for one"
        )
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    device = resolve_device(device)
    # Non-blocking: the holder may be this very thread's caller (fn calling run_ubatches),
    # which would deadlock a blocking acquire.
    if not _STEP_LOCK.acquire(blocking=False):
        raise RuntimeError(
            "another ubatched step is still running in this process (started from another "
            "thread, or fn called run_ubatches); DBO runs one step at a time (the registries "
            "are process-wide)"
        )
    try:
        return _run_step(
            fn, ubatch_inputs, device, timeout, forward_contexts, compute_stream, comm_stream,
            schedule, graph,
        )
    finally:
        _STEP_LOCK.release()


# Held by the launcher for a whole step: two launcher threads racing past
# make_ubatch_contexts' check would otherwise both run, each taking over the other's slots.
_STEP_LOCK = threading.Lock()


def _run_step(
    fn: Callable[[Any], Any],
    ubatch_inputs: Sequence[Any],
    device: Device,
    timeout: float,
    forward_contexts: Sequence[Any] | None,
    compute_stream: Stream | None,
    comm_stream: Stream | None,
    schedule: str,
    graph: Any,
) -> list[Any]:
    num = len(ubatch_inputs)
    default_compute, default_comm = device.ubatch_streams()
    compute_stream = compute_stream or default_compute
    comm_stream = comm_stream or default_comm
    barrier = threading.Barrier(num + 1)
    contexts = make_ubatch_contexts(
        num,
        compute_stream,
        comm_stream,
        list(forward_contexts) if forward_contexts is not None else [None] * num,
        barrier,
        schedule,
    )
    step = contexts[0].step
    outputs: list[Any] = [None] * num
    remaining = [num]
    all_done = threading.Event()
    done_lock = threading.Lock()

    def on_done() -> None:
        with done_lock:
            remaining[0] -= 1
            if remaining[0] == 0:
                all_done.set()

    deadline = time.monotonic() + timeout
    launch_stream = device.current_stream()
    # The ubatches' streams start after whatever the launcher issued before the step.
    compute_stream.wait_stream(launch_stream)
    comm_stream.wait_stream(launch_stream)
    workers = _WORKERS.acquire(num)
    threads = [w.thread for w in workers]

    def on_timeout(where: str) -> None:
        if step.error is None:
            step.abort(_timeout_error(step, threads, timeout, where))

    launcher_error: BaseException | None = None
    try:
        try:
            for ctx, worker in zip(contexts, workers):
                worker.submit(
                    on_done, _ubatch_main, ctx, fn, ubatch_inputs[ctx.id], outputs, device
                )
            try:
                barrier.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except threading.BrokenBarrierError:
                on_timeout("at the ready barrier")  # no-op if a ubatch broke it by failing
            if step.error is None:
                if graph is not None:
                    # Entered only now, with every thread parked at its baton: their per-thread
                    # set-up (device scope, handles) happened before capture, as in vLLM.
                    graph.capture_stream = compute_stream
                    with graph:
                        _release_and_wait(
                            step, comm_stream, compute_stream, all_done, deadline, on_timeout
                        )
                else:
                    _release_and_wait(
                        step, comm_stream, compute_stream, all_done, deadline, on_timeout
                    )
        except BaseException as error:  # noqa: BLE001 - re-raised below, after the peers go
            # The launcher's own failure: without an abort the parked ubatches would wait for
            # a baton that never comes, holding their worker threads forever.
            if step.error is None:
                launcher_error = error
                step.abort(
                    UBatchError(f"the launcher failed: {type(error).__name__}: {error}")
                )
            elif not isinstance(error, Exception):
                launcher_error = error  # an interrupt is never swallowed by a step's error
        # Peers wake promptly after an abort; a thread stuck in user code cannot be stopped,
        # so it is left behind (and never reused) instead of hanging the caller.
        all_done.wait(timeout=max(deadline - time.monotonic(), 0.0) + 1.0)
    finally:
        step.close()
        _WORKERS.release(workers)
    if launcher_error is not None:
        raise launcher_error
    if step.error is not None:
        raise step.error
    launch_stream.wait_stream(compute_stream)
    launch_stream.wait_stream(comm_stream)
    return outputs


class _UBatchWorker:
    """One long-lived ubatch thread: it runs one ubatch per step, then waits for the next.

    Measured on an H200 (torch 2.11): the first step a thread runs costs ~40 ms more host time
    than later ones (per-thread CUDA and cuBLAS set-up inside torch), so a fresh thread per
    ubatch per step made every eager DBO step ~10x slower on the host than serial. Reusing the
    threads pays that once.
    """

    def __init__(self, index: int) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.busy = False
        self.abandoned = False  # stuck in user code past a timeout: never handed a job again
        self.thread = threading.Thread(
            target=self._loop,
            name=f"dbo-ubatch-worker-{index}",
            daemon=True,  # a thread stuck in user code must not keep the process alive
        )
        self.thread.start()

    def submit(self, on_done: Callable[[], None], job: Callable[..., None], *args: Any) -> None:
        """Run `job(*args)` on this thread, then `on_done()` once the thread is free again."""
        self.busy = True
        self._jobs.put((on_done, job, args))

    def abandon(self) -> None:
        """Let the thread end as soon as its current job (if any) returns."""
        self.abandoned = True
        # The thread may already be back in _jobs.get() (it finished between the pool's
        # `busy` check and the flag above): the sentinel ends it there too.
        self._jobs.put(None)

    def _loop(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            on_done, job, args = item
            try:
                job(*args)
            finally:
                self.busy = False
                on_done()
            if self.abandoned:
                return


class _WorkerPool:
    """The process's idle ubatch threads (a documented registry: `dbo.runner._WORKERS`)."""

    def __init__(self) -> None:
        self._idle: list[_UBatchWorker] = []
        self._created = 0
        self._lock = threading.Lock()

    def acquire(self, num: int) -> list[_UBatchWorker]:
        with self._lock:
            # Most recently used first, so a steady N-ubatch loop keeps the same N threads.
            self._idle = [w for w in self._idle if w.thread.is_alive()]
            keep = max(len(self._idle) - num, 0)
            taken, self._idle = self._idle[keep:], self._idle[:keep]
            try:
                while len(taken) < num:
                    taken.append(_UBatchWorker(self._created))
                    self._created += 1
            except BaseException:  # thread creation failed: keep what we have for later
                self._idle.extend(taken)
                raise
            return taken

    def release(self, workers: list[_UBatchWorker]) -> None:
        with self._lock:
            for worker in workers:
                if worker.busy or not worker.thread.is_alive():
                    worker.abandon()
                else:
                    self._idle.append(worker)

    def idle_count(self) -> int:
        """Idle threads ready for the next step (for tests and reports)."""
        with self._lock:
            return len(self._idle)


_WORKERS = _WorkerPool()


def _release_and_wait(
    step: ubatching.UBatchStep,
    comm_stream: Stream,
    compute_stream: Stream,
    all_done: threading.Event,
    deadline: float,
    on_timeout: Callable[[str], None],
) -> None:
    # Under graph capture the comm stream must fork from, and join back into, the capturing
    # stream; outside capture these waits are free ordering.
    comm_stream.wait_stream(compute_stream)
    step.release_first()
    all_done.wait(timeout=max(deadline - time.monotonic(), 0.0))
    if all_done.is_set():
        compute_stream.wait_stream(comm_stream)
    else:
        # Still inside a graph capture, if any: the peers are released before it ends.
        on_timeout("while running")


def _ubatch_main(
    ctx: UBatchContext,
    fn: Callable[[Any], Any],
    ubatch_input: Any,
    outputs: list[Any],
    device: Device,
) -> None:
    try:
        with use_device(device), device.thread_scope(ctx.id):
            with ctx:
                outputs[ctx.id] = fn(ubatch_input)
    except _StepAborted:
        pass  # a peer failed; the step already holds that error
    except BaseException as error:  # noqa: BLE001 - every failure ends the step, never a thread
        # ctx.__exit__ has recorded errors raised inside the context; this catches failures
        # around it (entering the device scope, say).
        if ctx.step.error is None:
            ctx.step.abort(
                error if isinstance(error, UBatchError) else _as_ubatch_error(ctx.id, error)
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
