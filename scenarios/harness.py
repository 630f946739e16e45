"""Run one workload serially and with DBO on a fresh device, and compare the two runs.

Every measured run follows an inference engine's life cycle (`scenarios.steps.prepare`): init the
workspace, warm up eagerly (the workspace grows to its largest need), lock it, then run the
measured step, which must allocate nothing. The serial run is the same model code with every
dbo_* call a no-op; the DBO run splits the batch with `dbo.split` and runs the ubatch threads
with `dbo.run_ubatches` (both are `scenarios.steps.Step`s).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dbo.devices import resolve_device
from dbo.sim import SimDevice
from dbo.sim.options import SimOptions
from dbo.sim.records import OpRecord, RaceReport
from dbo.sim.report import StepSummary, plot_timeline, summarize, write_chrome_trace
from dbo.streams import Device
from scenarios.model import Batch, ModelConfig, MoEModel
from scenarios.steps import prepare, serial_step, ubatched_step
from workspace import current_workspace_manager
from workspace.testing import record_allocations

__all__ = [
    "RunOptions",
    "StepRun",
    "Comparison",
    "new_device",
    "run_step",
    "measure",
    "compare_serial_dbo",
    "write_artifacts",
    "artifact_title",
    "failure_point",
]


@dataclass(frozen=True)
class RunOptions:
    """What the CLI passes to every scenario."""

    num_ubatches: int = 2
    device: str = "sim"  # "sim" or "cuda"
    profile: str = "h200"
    out_dir: Path | None = None  # traces and PNGs go here; None writes nothing
    timeout_s: float = 60.0

    def artifact_stem(self, name: str, ranks: int = 1) -> str:
        """A scenario's trace and PNG file name without suffix: it carries the ubatch and rank
        counts, so runs with another `-n` or `--ranks` never overwrite each other's files."""
        return f"{name}.n{self.num_ubatches}.r{ranks}"


@dataclass
class StepRun:
    """One measured step: its output, and on the simulated device its timeline."""

    output: torch.Tensor
    step_us: float
    summary: StepSummary | None
    records: list[OpRecord] = field(default_factory=list)
    races: list[RaceReport] = field(default_factory=list)
    workspace_peak_bytes: int = 0
    allocations_during_step: int = 0


@dataclass
class Comparison:
    serial: StepRun
    dbo: StepRun
    outputs_match: bool
    max_abs_diff: float
    tolerance: float
    values_checked: bool = True  # False for `meta` presets: shapes only, nothing to compare
    trace: str | None = None
    timeline_png: str | None = None

    @property
    def speedup(self) -> float:
        return self.serial.step_us / self.dbo.step_us if self.dbo.step_us > 0 else math.nan


def new_device(opts: RunOptions, tensor_device: str = "cpu") -> Device:
    if opts.device == "sim":
        return SimDevice(SimOptions(opts.profile, tensor_device=tensor_device))
    return resolve_device(opts.device)


def _count_allocations(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run fn, counting the workspace manager's slot allocations."""
    with record_allocations(current_workspace_manager()) as sizes:
        result = fn()
    return result, len(sizes)


def run_step(
    model: MoEModel,
    x: torch.Tensor,
    *,
    device: Device,
    num_ubatches: int | None,
    mode: str,
    timeout_s: float = 60.0,
    warmups: int = 1,
    graph: bool = False,
) -> StepRun:
    """Warm up, lock the workspace, and measure one step (serial when num_ubatches is None):
    run eagerly, or (`graph`) captured once after the lock and measured as one replay, as an
    engine runs decode. `timeout_s` bounds the serial forward, and each ubatch's waits."""
    if num_ubatches is None:
        step = serial_step(model, x, device, mode=mode, timeout_s=timeout_s)
    else:
        step = ubatched_step(
            model, x, device, mode=mode, num_ubatches=num_ubatches, timeout_s=timeout_s
        )
    prepare(device.torch_device, step.num_ubatches, [step.output], rounds=warmups)
    if not graph:
        return measure(step.output, device)
    captured = device.graph()
    output = step.capture(captured)

    def replay() -> torch.Tensor:
        captured.replay()
        return output

    return measure(replay, device)


def measure(step: Callable[[], torch.Tensor], device: Device) -> StepRun:
    """One measured run of a prepared `step`: its allocations, its output, and its time (the
    simulated timeline, or CUDA events around it on a real GPU)."""
    if isinstance(device, SimDevice):
        device.synchronize()
        device.reset()
        output, allocations = _count_allocations(step)
        device.synchronize()
        records, races = list(device.timeline), list(device.races)
        peak = current_workspace_manager().stats().peak_bytes
        summary = summarize(records, races=races, workspace_peak_bytes=peak)
        return StepRun(output, summary.step_us, summary, records, races, peak, allocations)
    # A real GPU: time the step with CUDA events around it.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    device.synchronize()
    start.record()
    output, allocations = _count_allocations(step)
    end.record()
    device.synchronize()
    peak = current_workspace_manager().stats().peak_bytes
    return StepRun(output, start.elapsed_time(end) * 1000.0, None, [], [], peak, allocations)


def compare_serial_dbo(
    name: str,
    config: ModelConfig,
    batch: Batch,
    mode: str,
    opts: RunOptions,
    *,
    tolerance: float = 1e-9,
    graph: bool = False,
) -> Comparison:
    """The overlap-correctness check: same outputs, no race, and what the overlap buys;
    with `graph`, both steps are measured as replays of a captured graph."""
    if opts.device != "sim" and config.tensor_device == "cpu":
        config = config.with_(tensor_device=opts.device)  # real streams need the tensors there
    model = MoEModel(config, batch)
    x = model.inputs()
    serial = run_step(
        model,
        x,
        device=new_device(opts, config.tensor_device),
        num_ubatches=None,
        mode=mode,
        timeout_s=opts.timeout_s,
        graph=graph,
    )
    model = MoEModel(config, batch)  # a fresh KV cache, so both runs start from the same state
    ubatched = run_step(
        model,
        x,
        device=new_device(opts, config.tensor_device),
        num_ubatches=opts.num_ubatches,
        mode=mode,
        timeout_s=opts.timeout_s,
        graph=graph,
    )
    if config.tensor_device == "meta":
        match, diff = True, 0.0  # shapes only: there are no values to compare
    else:
        diff = (serial.output.double() - ubatched.output.double()).abs().max().item()
        match = diff <= tolerance
    comparison = Comparison(
        serial, ubatched, match, diff, tolerance, values_checked=config.tensor_device != "meta"
    )
    if opts.out_dir is not None and ubatched.records:
        comparison.trace, comparison.timeline_png = write_artifacts(name, ubatched, opts)
    return comparison


def write_artifacts(
    name: str,
    run: StepRun,
    opts: RunOptions,
    *,
    failure: BaseException | None = None,
    caught: str | None = None,
) -> tuple[str, str]:
    """`<out_dir>/<stem>.trace.json` and `<stem>.png`, the stem from `opts.artifact_stem`.
    The PNG marks the run's races, and where a step that failed with `failure` stopped; its
    title says what a negative scenario `caught`."""
    if opts.out_dir is None:
        raise ValueError("write_artifacts needs opts.out_dir (None means: write nothing)")
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    stem = opts.out_dir / opts.artifact_stem(name)
    trace = write_chrome_trace(
        Path(f"{stem}.trace.json"), run.records, races=run.races, metadata={"scenario": name}
    )
    mark = None if failure is None else failure_point(run.records, failure)
    png = plot_timeline(
        Path(f"{stem}.png"),
        run.records,
        title=artifact_title(name, failure, caught),
        races=run.races,
        failure=mark,
    )
    return str(trace), str(png)


def artifact_title(name: str, failure: BaseException | None, caught: str | None) -> str:
    """A scenario PNG's title: what a negative scenario caught, else what stopped the step."""
    if caught is not None:
        return f"{name} (DBO), fault caught: {caught}"
    return f"{name} (DBO)" + ("" if failure is None else f": stopped by {type(failure).__name__}")


def failure_point(records: Sequence[OpRecord], failure: BaseException) -> tuple[float, str]:
    """Where a failed step stopped on the timeline: the end of the last op of the ubatch
    that failed (of any ubatch when the error names none), and what stopped it."""
    ubatch = getattr(failure, "ubatch_id", None)
    own = [r for r in records if r.ubatch == ubatch] or list(records)
    at = max((r.end_us for r in own), default=0.0)
    return at, f"{type(failure).__name__}: the step stopped here"
