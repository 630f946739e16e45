"""Verify a user's own forward under DBO: serial and ubatched steps, compared.

`verify(forward, inputs)` is the whole overlap-correctness check for code this package has
never seen: run `forward` once with DBO off (every dbo_* call a no-op), once split into
ubatches through `run_ubatches` on the same kind of device, and report whether the outputs
match (`dbo.verification.compare` says what that compares), whether the race checker saw unordered
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

This module is the driver: the phases in order, each in a module of its own (`arguments`,
`inputs`, `runs`, then the report built here from `compare` and `report`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dbo.errors import YieldMismatchError
from dbo.runner import merge_outputs
from dbo.sim.records import COMM, HANDOFF, OpRecord
from dbo.sim.reorder import ReorderOutcome
from dbo.sim.report import summarize
from dbo.sim.summary import fallback_fraction
from dbo.sim.trace import TraceRun
from dbo.streams import Device
from dbo.verification.arguments import (
    check_adversarial,
    check_args,
    lookup_split_rules,
    verify_device,
)
from dbo.verification.compare import compare
from dbo.verification.graph_runner import CUDAGraphRunner, GraphReplay
from dbo.verification.graphs import check_graphs_device
from dbo.verification.inputs import split_and_check
from dbo.verification.report import RunRaces, VerifyReport
from dbo.verification.runs import MeasuredRun, RunPlan, run_all
from dbo.verification.runtimes import check_runtime, record_runtime

__all__ = ["verify"]


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
    `dbo.verification.layout`) says where the engine runs a ubatch without real tokens, and a
    layout it would not run is refused. Bad arguments raise before any work; a serial forward
    that raises or outlives `timeout` raises (there is nothing to compare); every failure of
    the ubatched step is reported in `error`, a split whose metadata breaks an invariant in
    `metadata_error`. `graphs`: a `CUDAGraphRunner` (`dbo.verification.graph_runner`) with its
    graphs captured; the step is also served through it and each replay checked
    (`report.graphs`). `runtime`: "dbo", "vllm" or "both" (`dbo.verification.runtimes`)."""
    rules = lookup_split_rules(split_rules)
    if num_ubatches is None:  # the layout's count, else two
        num_ubatches = 2 if slices is None or isinstance(slices, (str, bytes)) else len(slices)
    check_args(
        forward, num_ubatches, split, merge, warmup, atol, rtol, timeout, artifacts, race_order
    )
    split, metadata_error = split_and_check(inputs, num_ubatches, split, slices, rules)
    dev = verify_device(device, inputs) if graphs is None else check_graphs_device(graphs, device)
    if race_order == "adversarial":
        check_adversarial(dev, inputs)
    check_runtime(runtime, dev)
    merge = merge or merge_outputs
    plan = RunPlan(forward, inputs, split, num_ubatches, dev, merge, timeout, runtime)
    serial, ubatched, mutated, outcome, replays, differences = run_all(
        plan, warmup, race_order, graphs, atol, rtol
    )
    report = _report(serial, ubatched, num_ubatches, dev, atol, rtol)
    report.input_mutated, report.race_order = mutated, race_order
    record_runtime(report, runtime, differences)
    _add_findings(report, outcome, metadata_error, replays)
    if artifacts is not None:
        report.write_artifacts(artifacts)
    return report


def _yield_counts(run: MeasuredRun, num_ubatches: int) -> list[int] | None:
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
    serial: MeasuredRun,
    ubatched: MeasuredRun,
    num_ubatches: int,
    device: Device,
    atol: float,
    rtol: float,
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
