"""verify's runs: the warm-up, the measured serial and ubatched steps, the adversarial
re-execution, the steps served through CUDA graphs and the second runtime, all under one
workspace manager (made here when the caller has none, and forgotten after).

Every run gets its own copy of the batch, and each output is snapshotted before the next run
starts: a forward that writes its input, or returns a view of memory a later run writes, cannot
make two runs agree by accident.

`workspace` is imported as a module, not as names: its modules stand on `dbo.checks` and
`dbo.ubatching`, so `import workspace` first initialises the `dbo` package, whose facade loads
these tools while `workspace` is half-imported; its attributes are read only when a run starts.
"""

from __future__ import annotations

import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

import workspace
from dbo.devices import use_device
from dbo.errors import UBatchTimeoutError
from dbo.sim.device import SimDevice
from dbo.sim.records import EventWait, HostRange, OpRecord, RaceReport
from dbo.sim.reorder import ReorderOutcome, run_adversarially
from dbo.sim.report import summarize
from dbo.streams import Device
from dbo.ubatch_registry import abandon_thread
from dbo.verification.compare import compare, copy_batch, same_values, snapshot
from dbo.verification.graph_runner import CUDAGraphRunner, GraphReplay, describe_batch
from dbo.verification.graphs import replay_steps
from dbo.verification.inputs import ubatch_inputs
from dbo.verification.report import error_text
from dbo.verification.runtimes import compare_runtimes, ubatch_runner

__all__ = ["MeasuredRun", "RunPlan", "run_all"]


@dataclass
class MeasuredRun:
    """One measured step: its output (snapshotted), time, and what the device saw of it."""

    output: Any
    step_us: float
    records: list[OpRecord]
    races: list[RaceReport]
    waits: list[EventWait]
    ranges: list[HostRange]
    error: BaseException | None = None


def _measure(device: Device, step: Callable[[], Any], catch: tuple[type, ...] = ()) -> MeasuredRun:
    """One measured step: on the simulated device from a reset clock, on CUDA by events.
    Exceptions of the `catch` types become the run's `error`; others propagate. The output
    is snapshotted at once, before any later run can write what it refers to."""
    if isinstance(device, SimDevice):
        device.synchronize()
        device.reset()
        error, output = None, None
        try:
            output = snapshot(step())
        except catch as failure:
            error = failure
        device.synchronize()
        records = list(device.timeline)
        step_us = summarize(records).step_us if records else 0.0
        return MeasuredRun(
            output,
            step_us,
            records,
            list(device.races),
            list(device.event_waits),
            list(device.host_ranges),
            error,
        )
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    device.synchronize()
    start.record()
    error, output = None, None
    try:
        output = step()
    except catch as failure:
        error = failure
    end.record()
    device.synchronize()
    return MeasuredRun(snapshot(output), start.elapsed_time(end) * 1000.0, [], [], [], [], error)


def _bounded(step: Callable[[], Any], timeout: float) -> Any:
    """Run the serial step on a thread of its own and wait at most `timeout` seconds, as
    `run_ubatches` bounds the ubatched one; a hang raises UBatchTimeoutError with its stack."""
    box: dict[str, Any] = {}
    grad = torch.is_grad_enabled()

    def target() -> None:
        try:
            with torch.set_grad_enabled(grad):
                box["output"] = step()
        except BaseException as error:  # noqa: BLE001 - re-raised on the calling thread
            box["error"] = error

    thread = threading.Thread(target=target, name="dbo-verify-serial", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        frame = sys._current_frames().get(thread.ident or -1)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
        where = stack.strip().splitlines()[-2].strip() if stack else "unknown"
        abandon_thread(thread, f"verify's serial run passed its {timeout:g} s timeout")
        raise UBatchTimeoutError(
            f"the serial run of forward did not finish within {timeout:g} s (timeout=); it is "
            f"stuck at {where}; its thread is left running",
            stacks={-1: stack},  # -1: the serial run, which is no ubatch
        )
    if "error" in box:
        raise box["error"]
    return box.get("output")


def run_all(
    plan: RunPlan,
    warmup: int,
    race_order: str,
    graphs: CUDAGraphRunner | None,
    atol: float,
    rtol: float,
) -> tuple[MeasuredRun, MeasuredRun, bool, ReorderOutcome | None, list[GraphReplay], list[str]]:
    """Every run, with a workspace manager made for them if none is initialised: the serial
    and ubatched steps, the adversarial re-execution, the steps served through graphs, and
    the two rings' differences under `runtime="both"`."""
    owns_workspace = _own_workspace(plan.num_ubatches, plan.device)
    try:
        serial, ubatched, mutated = _run_both(plan, warmup, owns_workspace)
        outcome = None
        if race_order == "adversarial" and ubatched.error is None:
            outcome = _adversarial(plan, atol, rtol)
        replays = []
        if graphs is not None:
            replays = replay_steps(
                graphs, plan.inputs, serial.output, plan.num_ubatches, atol, rtol
            )
        differences = _runtime_differences(plan)
    finally:
        if owns_workspace:
            workspace.reset_workspace_manager()
    return serial, ubatched, mutated, outcome, replays, differences


def _own_workspace(num_ubatches: int, device: Device) -> bool:
    """True when verify makes (and must later forget) the workspace manager itself, which it
    then has; refuses an initialised one with too few slots, before any work."""
    if not workspace.is_workspace_manager_initialized():
        workspace.init_workspace_manager(device.torch_device, num_ubatches)
        return True
    slots = workspace.current_workspace_manager().num_ubatches
    if slots < num_ubatches:
        raise ValueError(
            f"the initialised workspace manager has {slots} slot(s), fewer than "
            f"num_ubatches={num_ubatches}; init_workspace_manager(device, {num_ubatches}) "
            f"or reset it and let verify make one"
        )
    return False


@dataclass
class RunPlan:
    """What every run needs: the forward, the pristine batch and how to cut it."""

    forward: Callable
    inputs: Any
    split: Callable | None
    num_ubatches: int
    device: Device
    merge: Callable
    timeout: float
    runtime: str = "dbo"

    def serial_step(self, batch: Any) -> Any:
        def step() -> Any:
            with use_device(self.device), self.device.thread_scope(None):
                return self.forward(batch)

        # Labelled for the workspace: a locked one's refusal names the run that sized it.
        with workspace.workspace_step("serial step", num_tokens=self.num_tokens()):
            return _bounded(step, self.timeout)

    def ubatch_outputs(self, batch: Any) -> list[Any]:
        pieces = ubatch_inputs(batch, self.num_ubatches, self.split)
        tokens, n = self.num_tokens(), self.num_ubatches
        with workspace.workspace_step("DBO step", num_tokens=tokens, num_ubatches=n):
            runner = ubatch_runner(self.runtime)
            return runner(self.forward, pieces, self.device, self.timeout)

    def num_tokens(self) -> int:
        return describe_batch(self.inputs).num_tokens

    def ubatched_step(self, batch: Any) -> Any:
        return self.merge(self.ubatch_outputs(batch))


def _run_both(plan: RunPlan, warmup: int, lock: bool) -> tuple[MeasuredRun, MeasuredRun, bool]:
    """Warm up, then measure one serial and one ubatched step, each on its own copy of the
    batch; also says whether any run wrote its copy."""
    pristine = snapshot(plan.inputs)
    mutated = False
    warm_error: BaseException | None = None
    for _ in range(warmup):
        batch = copy_batch(plan.inputs)
        plan.serial_step(batch)
        mutated = mutated or not same_values(pristine, snapshot(batch))
        if warm_error is None:
            batch = copy_batch(plan.inputs)
            try:
                plan.ubatched_step(batch)
            except Exception as error:  # noqa: BLE001 - a finding, reported in the report
                warm_error = error  # measured below all the same, from a reset device
    if lock:
        workspace.lock_workspace()
    batch = copy_batch(plan.inputs)
    serial = _measure(plan.device, lambda: plan.serial_step(batch))
    mutated = mutated or not same_values(pristine, snapshot(batch))
    # Any failure of the ubatched step (the step's errors, or merge refusing its outputs) is
    # a finding; the serial step's failures propagate from the call above.
    batch = copy_batch(plan.inputs)
    ubatched = _measure(plan.device, lambda: plan.ubatched_step(batch), catch=(Exception,))
    if ubatched.error is None:
        mutated = mutated or not same_values(pristine, snapshot(batch))
    if ubatched.error is None and warm_error is not None:
        ubatched.error = warm_error
    return serial, ubatched, mutated


def _adversarial(plan: RunPlan, atol: float, rtol: float) -> ReorderOutcome:
    """Capture one more ubatched step and re-execute it twice from the same memory, in issue
    order and in the adversarial order, and compare the two. Never against the serial output:
    the re-executions start from memory as the capture left it, so a step that rewrites what
    it read (its input, a running statistic) would differ from the serial run with no race."""
    batch = copy_batch(plan.inputs)
    try:
        outcome = run_adversarially(
            plan.device,
            lambda: plan.ubatch_outputs(batch),
            read=lambda outputs: snapshot(plan.merge(outputs)),
        )
    except Exception as error:  # noqa: BLE001 - the measured runs stand; say why this did not
        return ReorderOutcome(0, 0, [], skipped=f"the captured step raised {error_text(error)}")
    found = compare(
        outcome.issue_value, outcome.adversarial_value, atol, rtol, "adversarial output"
    )
    if found.match:
        return outcome
    return replace(outcome, mismatch=found.mismatch, max_abs_diff=found.max_abs_diff)


def _runtime_differences(plan: RunPlan) -> list[str]:
    if plan.runtime != "both":
        return []
    assert isinstance(plan.device, SimDevice)  # check_runtime refused any other device
    return compare_runtimes(
        plan.forward,
        plan.inputs,
        lambda batch: ubatch_inputs(batch, plan.num_ubatches, plan.split),
        plan.merge,
        plan.device,
        plan.timeout,
    )
