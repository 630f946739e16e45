"""The installed vLLM's ubatch runtime, driven on a dbo device: `run_vllm_ubatches`.

vLLM's own `make_ubatch_contexts` builds the ring and vLLM's `UBatchContext` runs it, in
threads started the way vLLM's V2 `UBatchRunner.begin_capturable_run` starts them (one per
ubatch, a ready barrier of N + 1 parties, ubatch 0 released by the launcher). On the simulated
GPU the CUDA facade (`dbo.sim.cuda_facade`) answers the ring's torch.cuda calls, so its ops,
events and stream switches are the device's, with the race checker and timeline.

Each ubatch thread also takes a seat in dbo's registry (`VllmSeat`): dbo's `dbo_*` helpers,
`dbo_current_ubatch_id()` (the workspace's slot) and `current_forward_context()` then answer
through vLLM's context, so one forward written against either module's helpers runs under
this runtime unchanged, which is what `dbo.verify(..., runtime="both")` compares.

Failure semantics are dbo's, not vLLM's: vLLM 0.33 leaves the peers of a failed ubatch parked
on a hand-off that never comes (its V2 runner says so). Here the launcher never waits past
its deadline: when a ubatch fails or time runs out it marks the step aborted, keeps setting
every CPU signal so parked threads wake (a seat raises `StepAborted` in them at their next
dbo call), and raises; a thread still in user code at the deadline is marked abandoned.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from dbo import ubatch_registry as registry
from dbo.devices import use_device
from dbo.errors import StepAborted, UBatchError, UBatchTimeoutError
from dbo.sim.cuda_facade import cuda_facade
from dbo.sim.device import SimDevice
from dbo.ubatch_context import token_offsets_of
from dbo.ubatch_step import RUNNING

__all__ = ["VLLM_UBATCHING", "VllmSeat", "load_vllm_ubatching", "run_vllm_ubatches"]

VLLM_UBATCHING = "vllm.v1.worker.ubatching"
# How often the launcher re-sets the CPU signals of an aborted step (parked threads wake).
_RELEASE_EVERY_S = 0.005


def load_vllm_ubatching() -> Any:
    """vLLM's `vllm.v1.worker.ubatching`, or an ImportError saying how to install it."""
    try:
        return importlib.import_module(VLLM_UBATCHING)
    except ImportError as error:
        raise ImportError(
            f"runtime='vllm' drives the installed vLLM's {VLLM_UBATCHING}, which does not "
            f"import ({error}); install it with `make vllm-oracle`"
        ) from error


class _SeatState:
    """The part of a dbo context's progress record the helpers read."""

    status = RUNNING


class _SeatStep:
    """The step as dbo's registry and helpers see it: its seats and whether it is over."""

    def __init__(self, num_ubatches: int) -> None:
        self.num_ubatches = num_ubatches
        self.contexts: list[VllmSeat] = []
        self.closed = False
        self.aborted = False


class VllmSeat:
    """A vLLM `UBatchContext` registered as a dbo ubatch: dbo's helpers call these methods,
    each checks the step is live and hands over to vLLM's method of the same name."""

    def __init__(self, ctx: Any, step: _SeatStep) -> None:
        self.ctx = ctx
        self.id: int = ctx.id
        self.step = step
        self.state = _SeatState()

    def _live(self) -> None:
        if self.step.aborted:
            raise StepAborted()

    @property
    def forward_context(self) -> Any:
        return self.ctx.forward_context

    @property
    def compute_stream(self) -> Any:
        return self.ctx.compute_stream

    @property
    def comm_stream(self) -> Any:
        return self.ctx.comm_stream

    @property
    def recv_hook(self) -> Callable[[], Any] | None:
        return self.ctx.recv_hook

    @recv_hook.setter
    def recv_hook(self, hook: Callable[[], Any] | None) -> None:
        self.ctx.recv_hook = hook

    def _call(self, name: str) -> None:
        self._live()
        getattr(self.ctx, name)()
        self._live()

    def yield_(self) -> None:
        self._call("yield_")

    def yield_and_switch_from_compute_to_comm(self) -> None:
        self._call("yield_and_switch_from_compute_to_comm")

    def yield_and_switch_from_comm_to_compute(self) -> None:
        self._call("yield_and_switch_from_comm_to_compute")

    def switch_to_comm(self) -> None:
        self._call("switch_to_comm")

    def switch_to_compute(self) -> None:
        self._call("switch_to_compute")

    def switch_to_comm_sync(self) -> None:
        self._call("switch_to_comm_sync")

    def switch_to_compute_sync(self) -> None:
        self._call("switch_to_compute_sync")

    def maybe_run_recv_hook(self) -> None:
        self._call("maybe_run_recv_hook")


class _VllmStep:
    """One step's threads, outputs and errors, and the abort that releases them."""

    def __init__(self, fn: Callable[[Any], Any], device: SimDevice, ctxs: list[Any]) -> None:
        self.fn, self.device, self.ctxs = fn, device, ctxs
        self.seats = _SeatStep(len(ctxs))
        self.seats.contexts = [VllmSeat(ctx, self.seats) for ctx in ctxs]
        self.outputs: dict[int, Any] = {}
        self.errors: dict[int, BaseException] = {}
        self.threads: list[threading.Thread] = []

    def ubatch_main(self, i: int, piece: Any) -> None:
        seat = self.seats.contexts[i]
        try:
            registry.register(seat)
            try:
                with use_device(self.device), self.device.thread_scope(i), self.ctxs[i]:
                    self.outputs[i] = self.fn(piece)
            finally:
                registry.unregister(seat)
        except StepAborted:
            pass  # released by an abort: the ubatch that failed is the one reported
        except BaseException as error:  # noqa: BLE001 - reported by the launcher
            self.errors[i] = error

    def start(self, pieces: Sequence[Any]) -> None:
        for i, piece in enumerate(pieces):
            thread = threading.Thread(
                target=self.ubatch_main, args=(i, piece), name=f"vllm-ubatch-{i}", daemon=True
            )
            self.threads.append(thread)
            thread.start()

    def wait(self, deadline: float) -> bool:
        """Join the threads; on the first error, abort and release the rest. True if every
        thread ended before `deadline`."""
        while time.monotonic() < deadline:
            if not any(t.is_alive() for t in self.threads):
                return True
            if self.errors and not self.seats.aborted:
                self.seats.aborted = True
            if self.seats.aborted:
                for ctx in self.ctxs:
                    ctx.cpu_wait_event.set()
            time.sleep(_RELEASE_EVERY_S)
        return not any(t.is_alive() for t in self.threads)

    def abandon(self, why: str) -> None:
        """Give up on threads still running: free their seats (a later step may start) and
        mark them abandoned, so their next dbo call raises instead of reaching that step."""
        self.seats.aborted = True
        for ctx in self.ctxs:
            ctx.cpu_wait_event.set()
        for seat, thread in zip(self.seats.contexts, self.threads):
            registry.unregister(seat)
            if thread.is_alive():
                registry.abandon_thread(thread, why)


def run_vllm_ubatches(
    fn: Callable[[Any], Any],
    ubatch_inputs: Sequence[Any],
    *,
    device: SimDevice,
    timeout: float = 60.0,
) -> list[Any]:
    """Run `fn(ubatch_inputs[i])` in ubatch i's thread through the installed vLLM's ring on
    `device` (a SimDevice, through the CUDA facade) and return the outputs in ubatch order.

    A ubatch that raises ends the step with `UBatchError` naming it (vLLM 0.33 would hang);
    past `timeout` seconds, `UBatchTimeoutError`."""
    ubatching = load_vllm_ubatching()
    forward_context = importlib.import_module("vllm.forward_context")
    pieces = list(ubatch_inputs)
    n = len(pieces)
    if n < 2:
        raise ValueError(f"run_vllm_ubatches needs >= 2 ubatch inputs, got {n}")
    registry.claim_slots(n)
    with cuda_facade(device), forward_context.override_forward_context(None):
        compute, comm = device.ubatch_streams()
        barrier = threading.Barrier(n + 1)
        ctxs = ubatching.make_ubatch_contexts(
            num_micro_batches=n,
            compute_stream=compute,
            comm_stream=comm,
            forward_contexts=[f"forward-context-{i}" for i in range(n)],
            ready_barrier=barrier,
            token_offsets=token_offsets_of(pieces),
        )
        step = _VllmStep(fn, device, ctxs)
        comm.wait_stream(compute)  # as dbo's launcher: the comm stream forks from compute
        step.start(pieces)
        deadline = time.monotonic() + timeout
        try:
            barrier.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except threading.BrokenBarrierError:
            step.seats.aborted = True
        ctxs[0].cpu_wait_event.set()
        finished = step.wait(deadline)
        if not finished:
            step.abandon(f"the vLLM runtime's step passed its {timeout:g} s timeout")
            raise UBatchTimeoutError(
                f"the vLLM ubatched step did not finish within {timeout:g} s; ubatches "
                f"{[i for i, t in enumerate(step.threads) if t.is_alive()]} are still running",
                stacks={},
            )
        compute.wait_stream(comm)
    if step.errors:
        failed = min(step.errors)
        raise UBatchError(
            f"ubatch {failed} of {n} failed under vLLM's runtime: {step.errors[failed]!r}",
            ubatch_id=failed,
        ) from step.errors[failed]
    missing = [i for i in range(n) if i not in step.outputs]
    if missing:
        raise UBatchError(f"ubatches {missing} returned no output under vLLM's runtime")
    return [step.outputs[i] for i in range(n)]
