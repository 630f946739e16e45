"""The ubatch contexts: each ubatch's seat in the ring (its streams, events, forward context
and recv hook), entered by the ubatch's thread, and `make_ubatch_contexts` that builds them."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dbo import ubatch_registry as registry
from dbo.checks import as_int
from dbo.errors import ReadyBarrierBroken, StepAborted
from dbo.frames import register_runtime_file
from dbo.streams import Device, Event, Stream
from dbo.switch_notes import note_switch
from dbo.ubatch_step import (
    ABORTED,
    FAILED,
    FINISHED,
    PARKED,
    RUNNING,
    CpuSignal,
    UBatchStep,
    note_yield,
    plain_switch,
)

# The contexts' methods (the yield and switch calls) sit on every ubatch's stack: race reports
# leave them out of user stacks.
register_runtime_file(__file__)

__all__ = ["UBatchContext", "make_ubatch_contexts", "token_offsets_of"]


class UBatchContext:
    """One ubatch's seat in the ring: its streams, events, forward context and recv hook.

    Each method below says what it records (device events), which stream it leaves the
    calling thread on, whether it waits (the CPU parked for the baton, or a stream made to
    wait on an event), and whether it hands the baton on. The `dbo_*` helpers call them for
    the calling ubatch, are no-ops on any other thread and raise in an abandoned one. In short:

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
        token_offset: int = 0,
    ) -> None:
        self.id = id
        self.token_offset = token_offset  # this ubatch's first row in the whole batch
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
        # Where this ubatch's rows start in the parent batch (vLLM 0.33): code that indexes
        # batch-wide buffers (a router's per-token table, a KV slot map) adds it to its rows.
        self.token_offset = token_offset
        self.current_stream = compute_stream
        self.recv_hook: Callable[[], Any] | None = None
        self.state = step.states[id]  # this ubatch's progress, shared with its step
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
                # A peer failed (or the launcher gave up) while this ubatch waited to start.
                raise ReadyBarrierBroken() from None
            self._wait_for_baton()
            self.state.status = RUNNING
            self.update_stream(self.compute_stream)
        except StepAborted:
            # A peer failed (or the launcher gave up) before this ubatch ran: __exit__ will not
            # be called, so leave the registries here.
            self.state.status = ABORTED
            self._unregister()
            raise
        except BaseException as error:
            self.state.status = FAILED
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
                self.state.status = FAILED
                self._unregister()
                step.fail(self.id, error)
                return False
            self.state.status = FINISHED
            self._unregister()
            self.device.on_handoff()
            self.cpu_signal_event.set()
            return False
        # exc_type None here: fn returned, but the step was aborted meanwhile (a timeout)
        unwound = exc_type is not None and issubclass(exc_type, StepAborted)
        self.state.status = FINISHED if exc_type is None else ABORTED if unwound else FAILED
        self._unregister()
        # A StepAborted unwinds an aborted step; raised while the step is live (by user code,
        # or from another step) it is a failure like any other, or the peers would wait on.
        if exc is not None and not (unwound and step.aborted):
            step.fail(self.id, exc)
        return False

    def _register(self) -> None:
        self.state.thread_ident = threading.get_ident()
        self.state.thread = threading.current_thread()
        registry.register(self)

    def _unregister(self) -> None:
        registry.unregister(self)

    def _check_counts_at_exit(self) -> None:
        mine = self.state.yields
        for i, state in enumerate(self.step.states):
            if i != self.id and state.yields != mine:
                raise self.step.mismatch(f"ubatch {self.id} finished after {mine}")

    # -- the baton ---------------------------------------------------------------------------

    def _wait_for_baton(self) -> None:
        self.cpu_wait_event.wait()
        if self.step.aborted:
            raise StepAborted()

    # -- streams -----------------------------------------------------------------------------

    def update_stream(self, stream: Stream) -> None:
        """Make `stream` the calling thread's current stream. Records nothing, no wait, no
        baton: ordering against the other stream is the caller's business."""
        note_switch(None)  # the callers that leave the stream unordered note it afterwards
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
        note_switch(plain_switch(self.comm_stream.name, sys._getframe(1), "switch_to_comm"))

    def switch_to_compute(self) -> None:
        """Leave the thread on the compute stream. Records nothing, waits for nothing, keeps
        the baton: compute work issued next is NOT ordered after this ubatch's comm work."""
        self.update_stream(self.compute_stream)
        site = plain_switch(self.compute_stream.name, sys._getframe(1), "switch_to_compute")
        note_switch(site)

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
        state = self.state
        step = self.step
        if step.aborted:
            raise StepAborted()
        state.yields += 1
        note_yield(state, sys._getframe(1))
        if self._next_state.status in (FINISHED, FAILED):
            raise step.mismatch(f"ubatch {self.id} yielded to a finished ubatch")
        state.status = PARKED
        self._on_handoff()
        try:
            self._signal_next()
        except RuntimeError:
            pass  # already signalled: only an abort sets a signal twice, and it is seen below
        self._wait_own()
        if step.aborted:
            raise StepAborted()
        state.status = RUNNING

    def yield_and_switch_from_compute_to_comm(self) -> None:
        """Must be called on the compute stream. Record the compute-done event there, hand
        the baton on and park; on resume leave the thread on the comm stream, which waits
        (device-side) on that event, so the comm work reads finished compute results."""
        self._expect_stream(self.compute_stream, "dbo_yield_and_switch_from_compute_to_comm")
        self._signal_compute_done()
        self.yield_()
        self.update_stream(self.comm_stream)
        self._wait_compute_done()

    def yield_and_switch_from_comm_to_compute(self) -> None:
        """Must be called on the comm stream. Record the comm-done event there, hand the
        baton on and park; on resume leave the thread on the compute stream, which waits
        (device-side) on that event, so compute reads what the comm work delivered."""
        self._expect_stream(self.comm_stream, "dbo_yield_and_switch_from_comm_to_compute")
        self._signal_comm_done()
        self.yield_()
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
        return f"<UBatchContext {self.id}/{self.step.num_ubatches} {self.state.status}>"


def make_ubatch_contexts(
    num_micro_batches: int,
    compute_stream: Stream,
    comm_stream: Stream,
    forward_contexts: Sequence[Any],
    ready_barrier: threading.Barrier,
    schedule: str = "default",
    token_offsets: Sequence[int] | None = None,
) -> list[UBatchContext]:
    """Build the ring of N contexts (vLLM 0.33's signature). The launcher then calls
    `contexts[0].step.release_first()` (or `contexts[0].cpu_wait_event.set()`) after the
    barrier to let ubatch 0 run. `token_offsets[i]`: the row where ubatch i starts in the
    parent batch (`dbo_current_ubatch_token_offset()`); None or empty: 0 for every ubatch,
    as in vLLM."""
    # Every argument is checked before a registry slot is claimed: a refused ring leaves
    # nothing to release.
    num_micro_batches = _checked_ring_size(num_micro_batches, forward_contexts, ready_barrier)
    device = compute_stream.device
    device.check_stream(compute_stream, "compute_stream")
    device.check_stream(comm_stream, "comm_stream")
    offsets = _token_offsets(token_offsets, num_micro_batches)
    registry.claim_slots(num_micro_batches)
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
            token_offset=offsets[i],
        )
        for i in range(num_micro_batches)
    ]
    return list(step.contexts)


def _checked_ring_size(
    num_micro_batches: Any, forward_contexts: Sequence[Any], ready_barrier: threading.Barrier
) -> int:
    """N, checked against the forward contexts (one per ubatch) and the ready barrier (the N
    ubatch threads and the launcher)."""
    num_micro_batches = as_int("num_micro_batches", num_micro_batches)
    if num_micro_batches < 2:
        raise ValueError(
            f"num_micro_batches must be >= 2 for DBO, got {num_micro_batches}; run the step "
            f"without ubatching instead"
        )
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
    return num_micro_batches


def _token_offsets(token_offsets: Sequence[int] | None, num_micro_batches: int) -> list[int]:
    """One non-negative row offset per ubatch. vLLM reads `token_offsets[i]` unchecked (a short
    list fails in the ubatch's thread, mid-step); here a wrong length fails before any starts."""
    if not token_offsets:
        return [0] * num_micro_batches
    if len(token_offsets) != num_micro_batches:
        raise ValueError(
            f"token_offsets has {len(token_offsets)} entries, expected one per ubatch "
            f"({num_micro_batches})"
        )
    return [as_int(f"token_offsets[{i}]", v) for i, v in enumerate(token_offsets)]


def token_offsets_of(ubatch_inputs: Sequence[Any]) -> list[int] | None:
    """Each ubatch's first row in the whole batch, from the leading dim of its input (a
    tensor, or a tuple/list whose first item is one); None when an input has no rows."""
    offsets, row = [], 0
    for piece in ubatch_inputs:
        tensor = piece
        if isinstance(piece, (tuple, list)) and piece:
            tensor = piece[0]
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            return None
        offsets.append(row)
        row += int(tensor.shape[0])
    return offsets
