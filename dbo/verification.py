"""Verify a user's own forward under DBO: serial and ubatched steps, compared.

`verify(forward, inputs)` is the whole overlap-correctness check for code this package has
never seen: run `forward` once with DBO off (every dbo_* call a no-op), once split into
ubatches through `run_ubatches` on the same kind of device, and report whether the outputs
match (`dbo.verify_compare` says what that compares), whether the race checker saw unordered
accesses, and whether the ubatched step failed (a raise, a yield-count mismatch, a hang).
It never hangs: both steps run under `timeout`; every failure of the ubatched step comes
back as data in the report, a serial step that fails or hangs raises (nothing to compare).

Every run (warm-up and measured, serial and ubatched) gets its own copy of the batch, and
each output is snapshotted before the next run starts: a forward that writes its input, or
returns a view of memory a later run writes, cannot make two runs agree by accident.

On the simulated device ops execute in issue order, so a race never changes a value there;
`race_order="adversarial"` re-executes the captured ubatched step in a legal order that
runs each race the other way round (`dbo.sim.reorder`) and compares what that computes.

Life cycle, as an engine runs it: if no workspace manager is initialised, one is made for the
device and ubatch count, both paths are warmed up (the workspace grows to its largest need),
it is locked, the steps are measured, and the previous state (none) is restored. A manager
the caller already initialised is used as it is and left as it was.

`workspace` is imported as a module, not as names: `workspace.manager` imports
`dbo.ubatching`, so `import workspace` first runs this package's `__init__` while `workspace`
is half-imported; its attributes are read only when `verify` runs.
"""

from __future__ import annotations

import itertools
import math
import sys
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

import workspace
from dbo.checks import as_int, writable_folder
from dbo.devices import resolve_device, use_device
from dbo.errors import UBatchTimeoutError, YieldMismatchError
from dbo.graph_runner import CUDAGraphRunner, GraphReplay, describe_batch
from dbo.runner import merge_outputs
from dbo.sim.device import SimDevice
from dbo.sim.options import SimOptions
from dbo.sim.records import COMM, HANDOFF, EventWait, HostRange, OpRecord, RaceReport
from dbo.sim.reorder import ReorderOutcome, run_adversarially
from dbo.sim.report import summarize
from dbo.sim.summary import fallback_fraction
from dbo.sim.trace import TraceRun
from dbo.split import UBatchSlice, check_split_inputs, ubatch_cut_points
from dbo.streams import Device
from dbo.ubatch_registry import abandon_thread
from dbo.ubatching import dbo_enabled
from dbo.verify_compare import compare, copy_batch, same_values, snapshot
from dbo.verify_graphs import check_graphs_device, replay_steps
from dbo.verify_layout import SPLIT_RULES, SplitRules, resolve_layout, split_by_layout
from dbo.verify_report import RunRaces, VerifyError, VerifyReport, error_text
from dbo.verify_runtimes import check_runtime, compare_runtimes, record_runtime, ubatch_runner

__all__ = ["RACE_ORDERS", "RunRaces", "VerifyError", "VerifyReport", "split_inputs", "verify"]

# "issue": the ubatched step as issued (on the simulated device ops run in issue order);
# "adversarial": also re-executed in a legal order that runs every race the other way round.
RACE_ORDERS = ("issue", "adversarial")


# --------------------------------------------------------------------------------------------
# Argument checks (all before any work)


def _check_args(
    forward: Any,
    num_ubatches: Any,
    split: Any,
    merge: Any,
    warmup: Any,
    atol: Any,
    rtol: Any,
    timeout: Any,
    artifacts: Any,
    race_order: Any = "issue",
) -> None:
    if not callable(forward):
        raise TypeError(
            f"forward must be callable (forward(batch) -> output), got {type(forward).__name__}"
        )
    as_int("num_ubatches (DBO needs two ubatches or more)", num_ubatches, minimum=2)
    for name, fn in (("split", split), ("merge", merge)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable or None, got {type(fn).__name__}")
    as_int("warmup (steps run before measuring)", warmup)
    for name, tol in (("atol", atol), ("rtol", rtol)):
        if (
            isinstance(tol, bool)
            or not isinstance(tol, (int, float))
            or not (math.isfinite(tol) and tol >= 0)
        ):
            raise ValueError(f"{name} must be a finite number >= 0, got {tol!r}")
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not (math.isfinite(timeout) and timeout > 0)
    ):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if artifacts is not None and not isinstance(artifacts, (str, Path)):
        raise TypeError(f"artifacts must be a folder path or None, got {type(artifacts).__name__}")
    if artifacts is not None:
        writable_folder("artifacts", artifacts)  # before the forward runs, not after
    if race_order not in RACE_ORDERS:
        raise ValueError(f"race_order must be one of {RACE_ORDERS}, got {race_order!r}")
    if dbo_enabled():
        raise RuntimeError(
            "dbo.verify was called inside a ubatch (a thread of a running ubatched step); it "
            "runs steps of its own: call it from outside run_ubatches"
        )


def _resolve(device: Any, inputs: Any = None) -> Device:
    """The device to run on; "sim" with meta inputs (shapes only) is a meta simulated device,
    whose race checker knows there are no storages, rather than one that would take every
    meta tensor for memory at one address."""
    if device == "sim" and any(
        isinstance(v, torch.Tensor) and v.device.type == "meta" for v in _leaves(inputs)
    ):
        device = resolve_device("sim", SimOptions(tensor_device="meta"))
    wants_cuda = isinstance(device, str) and (device == "cuda" or device.startswith("cuda:"))
    if wants_cuda and not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r} but this machine has no CUDA device; use "
            f"device='sim' for the simulated one"
        )
    try:
        return resolve_device(device)
    except (TypeError, ValueError) as error:
        raise ValueError(f"verify: {error}") from None


# --------------------------------------------------------------------------------------------
# Splitting the inputs


def _rows(value: Any) -> int | None:
    return value.shape[0] if isinstance(value, torch.Tensor) and value.dim() > 0 else None


def _leaves(inputs: Any) -> list[Any]:
    if isinstance(inputs, Mapping):
        return list(inputs.values())
    if isinstance(inputs, (tuple, list)):
        return list(inputs)
    return [inputs]


def split_inputs(inputs: Any, num_ubatches: int) -> list[Any]:
    """The default split: cut a tensor, or a tuple/list/dict of tensors sharing dim 0, along
    dim 0 at `dbo.split.ubatch_cut_points` (the last ubatch takes the remainder)."""
    leaves = _leaves(inputs)
    rows = {_rows(v) for v in leaves}
    if not leaves or None in rows:
        raise TypeError(
            f"the default split cuts a tensor, or a tuple/list/dict of tensors, along dim 0; "
            f"got {_describe(inputs)}; pass split=fn(inputs, num_ubatches) -> list"
        )
    if len(rows) != 1:
        raise ValueError(
            f"the default split needs every input tensor to have the same dim 0, "
            f"got sizes {sorted(rows)}; pass split=fn(inputs, num_ubatches)"
        )
    (n,) = rows
    if n < num_ubatches:
        raise ValueError(
            f"inputs have {n} rows, fewer than num_ubatches={num_ubatches}: some "
            f"ubatch would be empty"
        )
    bounds = [0, *ubatch_cut_points(n, num_ubatches), n]
    pieces = [slice(a, b) for a, b in itertools.pairwise(bounds)]

    def cut(s: slice) -> Any:
        if isinstance(inputs, torch.Tensor):
            return inputs[s]
        if isinstance(inputs, Mapping):
            return {k: v[s] for k, v in inputs.items()}
        return type(inputs)(v[s] for v in inputs)

    return [cut(s) for s in pieces]


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list, Mapping)):
        return f"a {type(value).__name__} of {[type(v).__name__ for v in _leaves(value)]}"
    return f"a {type(value).__name__}"


def _ubatch_inputs(inputs: Any, num_ubatches: int, split: Callable | None) -> list[Any]:
    if split is None:
        return split_inputs(inputs, num_ubatches)
    pieces = split(inputs, num_ubatches)
    if not isinstance(pieces, (list, tuple)) or len(pieces) != num_ubatches:
        got = len(pieces) if isinstance(pieces, (list, tuple)) else type(pieces).__name__
        raise ValueError(
            f"split must return a list of num_ubatches={num_ubatches} ubatch inputs, got {got}"
        )
    return list(pieces)


# --------------------------------------------------------------------------------------------
# The runs


@dataclass
class _Run:
    output: Any
    step_us: float
    records: list[OpRecord]
    races: list[RaceReport]
    waits: list[EventWait]
    ranges: list[HostRange]
    error: BaseException | None = None


def _measure(device: Device, step: Callable[[], Any], catch: tuple[type, ...] = ()) -> _Run:
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
        return _Run(
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
    return _Run(snapshot(output), start.elapsed_time(end) * 1000.0, [], [], [], [], error)


def _yield_counts(run: _Run, num_ubatches: int) -> list[int] | None:
    if isinstance(run.error, YieldMismatchError):
        return list(run.error.yield_counts)
    if not run.records:
        return None
    # One handoff per yield, plus one when a ubatch finishes (it passes the baton on).
    counts = [0] * num_ubatches
    for r in run.records:
        if r.kind == HANDOFF and r.ubatch is not None and 0 <= r.ubatch < num_ubatches:
            counts[r.ubatch] += 1
    if run.error is None:
        counts = [c - 1 for c in counts]
    return counts


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


def verify(
    forward: Callable[[Any], Any],
    inputs: Any,
    *,
    num_ubatches: int | None = None,
    device: Device | str = "sim",
    split: Callable[[Any, int], Sequence[Any]] | None = None,
    merge: Callable[[list[Any]], Any] | None = None,
    warmup: int = 1,
    atol: float = 0.0,
    rtol: float = 0.0,
    timeout: float = 60.0,
    artifacts: str | Path | None = None,
    race_order: str = "issue",
    slices: Sequence[Any] | None = None,
    split_rules: str = "vllm-v1",
    graphs: CUDAGraphRunner | None = None,
    runtime: str = "dbo",
) -> VerifyReport:
    """Run `forward(inputs)` serially and as `num_ubatches` ubatches (default 2, or as many
    as `slices` lists), and compare.

    `split(inputs, num_ubatches) -> list` gives the ubatch inputs (default: `split_inputs`);
    `merge(outputs) -> output` joins the ubatch outputs (default: `dbo.merge_outputs`).
    `device`: "sim" (a fresh simulated H200), "cuda", or a `Device` (reset between runs when
    simulated). `artifacts`: a folder for a Chrome trace and a PNG of both runs.
    `race_order="adversarial"` (simulated device, real tensors) also re-executes the
    ubatched step in an order that runs each race the other way round and reports what it
    changes. `slices` (`UBatchSlice`s or token `slice`s): an explicit ubatch layout, which
    also cuts the batch when `split` is None; `split_rules` ("vllm-v1", "vllm-v2", "sglang",
    `dbo.verify_layout`) says where the engine runs a ubatch without real tokens, and a
    layout it would not run is refused. Bad arguments raise before any work; a serial forward
    that raises or outlives `timeout` raises (there is nothing to compare); every failure of
    the ubatched step is reported in `error`, a split whose metadata breaks an invariant in
    `metadata_error`. `graphs`: a `dbo.graph_runner.CUDAGraphRunner` with its graphs
    captured; the step is also served through it and each replay checked (`report.graphs`,
    `dbo.verify_graphs`). `runtime`: "dbo", "vllm" or "both" (`dbo.verify_runtimes`)."""
    rules = _rules(split_rules)
    if num_ubatches is None:  # the layout's count, else two
        num_ubatches = 2 if slices is None or isinstance(slices, (str, bytes)) else len(slices)
    _check_args(
        forward, num_ubatches, split, merge, warmup, atol, rtol, timeout, artifacts, race_order
    )
    split, metadata_error = _split_and_check(inputs, num_ubatches, split, slices, rules)
    dev = _resolve(device, inputs) if graphs is None else check_graphs_device(graphs, device)
    if race_order == "adversarial":
        _check_adversarial(dev, inputs)
    check_runtime(runtime, dev)
    merge = merge or merge_outputs
    plan = _Plan(forward, inputs, split, num_ubatches, dev, merge, timeout, runtime)
    serial, ubatched, mutated, outcome, replays, differences = _run_all(
        plan, warmup, race_order, graphs, atol, rtol
    )
    report = _report(serial, ubatched, num_ubatches, dev, atol, rtol)
    report.input_mutated, report.race_order = mutated, race_order
    record_runtime(report, runtime, differences)
    _add_findings(report, outcome, metadata_error, replays)
    if artifacts is not None:
        report.write_artifacts(artifacts)
    return report


def _run_all(
    plan: _Plan,
    warmup: int,
    race_order: str,
    graphs: CUDAGraphRunner | None,
    atol: float,
    rtol: float,
) -> tuple[_Run, _Run, bool, ReorderOutcome | None, list[GraphReplay], list[str]]:
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


def _split_and_check(
    inputs: Any, num_ubatches: int, split: Callable | None, slices: Any, rules: SplitRules
) -> tuple[Callable | None, Exception | None]:
    """The split to run (the layout's, given `slices` and no `split`) and the error of the
    first attention metadata its pieces carry that breaks an invariant, all before work."""
    layout = None if slices is None else resolve_layout(slices, inputs, num_ubatches, rules)
    if layout is not None and split is None:
        split = partial(_layout_split, layout=layout, allow_empty=rules.empty != "never")
    pieces = _ubatch_inputs(inputs, num_ubatches, split)  # a bad split: refused before work
    # Attention metadata the pieces carry must describe exactly their part of the batch
    # (dbo.split's checker); a wrong split is the cause of whatever the step then does.
    found = check_split_inputs(
        inputs, pieces, layout, padding_in_last_ubatch=rules.empty == "never"
    )
    return split, found


def _rules(split_rules: Any) -> SplitRules:
    if split_rules not in SPLIT_RULES:
        raise ValueError(f"split_rules must be one of {sorted(SPLIT_RULES)}, got {split_rules!r}")
    return SPLIT_RULES[split_rules]


def _layout_split(
    inputs: Any, num_ubatches: int, *, layout: list[UBatchSlice], allow_empty: bool
) -> list[Any]:
    return split_by_layout(inputs, layout, allow_empty)


def _check_adversarial(device: Device, inputs: Any) -> None:
    if not isinstance(device, SimDevice):
        raise ValueError(
            "race_order='adversarial' re-executes a captured step on the simulated device; "
            "use device='sim'"
        )
    meta = any(isinstance(v, torch.Tensor) and v.device.type == "meta" for v in _leaves(inputs))
    if meta or device.torch_device.type == "meta":
        raise ValueError(
            "race_order='adversarial' compares values, and meta tensors have none; give "
            "inputs on the CPU"
        )


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
class _Plan:
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
        pieces = _ubatch_inputs(batch, self.num_ubatches, self.split)
        tokens, n = self.num_tokens(), self.num_ubatches
        with workspace.workspace_step("DBO step", num_tokens=tokens, num_ubatches=n):
            runner = ubatch_runner(self.runtime)
            return runner(self.forward, pieces, self.device, self.timeout)

    def num_tokens(self) -> int:
        return describe_batch(self.inputs).num_tokens

    def ubatched_step(self, batch: Any) -> Any:
        return self.merge(self.ubatch_outputs(batch))


def _run_both(plan: _Plan, warmup: int, lock: bool) -> tuple[_Run, _Run, bool]:
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


def _adversarial(plan: _Plan, atol: float, rtol: float) -> ReorderOutcome:
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


def _runtime_differences(plan: _Plan) -> list[str]:
    if plan.runtime != "both":
        return []
    assert isinstance(plan.device, SimDevice)  # check_runtime refused any other device
    return compare_runtimes(
        plan.forward,
        plan.inputs,
        lambda batch: _ubatch_inputs(batch, plan.num_ubatches, plan.split),
        plan.merge,
        plan.device,
        plan.timeout,
    )


def _add_findings(
    report: VerifyReport,
    outcome: ReorderOutcome | None,
    metadata_error: Exception | None,
    replays: list[GraphReplay],
) -> None:
    """What the adversarial order changed, a split that broke the metadata's invariants, and
    the steps served through CUDA graphs."""
    report.graphs = replays
    if not all(r.ok for r in replays):
        report.ok = False
    if outcome is not None:
        report.adversarial = outcome
        if outcome.mismatch is not None:
            report.outputs_match = report.ok = False
    if metadata_error is not None:  # the cause; the ubatched step's own error stays its own
        report.ok, report.metadata_error = False, metadata_error


def _report(
    serial: _Run, ubatched: _Run, num_ubatches: int, device: Device, atol: float, rtol: float
) -> VerifyReport:
    if ubatched.error is None:
        found = compare(serial.output, ubatched.output, atol, rtol)
        diff, why, match = found.max_abs_diff, found.mismatch, found.match
    else:
        diff, why, match = None, None, False
    races = RunRaces(serial.races, ubatched.races)
    ok = match and ubatched.error is None and not races
    summary = summarize(ubatched.records) if ubatched.records else None
    return VerifyReport(
        ok=ok,
        outputs_match=match,
        max_abs_diff=diff,
        races=races,
        error=ubatched.error,
        yield_counts=_yield_counts(ubatched, num_ubatches),
        step_us_serial=serial.step_us,
        step_us_dbo=ubatched.step_us,
        num_ubatches=num_ubatches,
        device=device.kind,
        atol=float(atol),
        rtol=float(rtol),
        mismatch=why,
        roofline_fraction=fallback_fraction(ubatched.records) if ubatched.records else None,
        host_bound_fraction=None if summary is None else summary.host_bound_fraction,
        comm_us=None if summary is None else summary.comm_us,
        local_comm=_all_local(ubatched.records) if ubatched.records else None,
        shapes_only=device.torch_device.type == "meta",
        records={"serial": serial.records, "ubatched": ubatched.records},
        runs=[
            TraceRun("serial", serial.records, serial.races, serial.waits, serial.ranges),
            TraceRun("DBO", ubatched.records, ubatched.races, ubatched.waits, ubatched.ranges),
        ],
    )


def _all_local(records: list[OpRecord]) -> bool:
    """Whether every comm op of the run stayed on one GPU (comm_regions with ep_size 1)."""
    comm = [r for r in records if r.kind == COMM]
    return bool(comm) and all(r.args.get("link") == "local" for r in comm)
