"""What the scenarios share: a comparison or a workspace case as a verdict, a fresh device
and workspace for a case, and the trace and PNG of whatever ran (up to a caught fault)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import dbo
from dbo import ubatching
from dbo.sim import SimDevice
from scenarios.harness import (
    Comparison,
    RunOptions,
    StepRun,
    new_device,
    write_artifacts,
)
from scenarios.registry import ScenarioResult
from workspace import (
    current_workspace_manager,
    init_workspace_manager,
    reset_workspace_manager,
)

__all__ = [
    "case_result",
    "fresh_device",
    "registries_empty",
    "result_from_comparison",
    "run_ubatched",
    "with_artifacts",
]


def result_from_comparison(name: str, c: Comparison, **details: Any) -> ScenarioResult:
    """A serial-vs-DBO comparison as a scenario verdict: outputs match, no race, nothing
    allocated in the measured step; `details` land in the JSON report."""
    races = len(c.dbo.races) + len(c.serial.races)
    summary = c.dbo.summary
    passed = c.outputs_match and races == 0 and c.dbo.allocations_during_step == 0
    return ScenarioResult(
        scenario=name,
        passed=passed,
        outputs_match=c.outputs_match if c.values_checked else None,
        max_abs_diff=c.max_abs_diff if c.values_checked else None,
        races=races,
        error=None if passed else _why(c, races),
        step_us_serial=c.serial.step_us,
        step_us_dbo=c.dbo.step_us,
        speedup=c.speedup,
        overlap_fraction=summary.overlap_fraction if summary else None,
        exposed_comm_us=summary.exposed_comm_us if summary else None,
        roofline_fraction=summary.fallback_fraction if summary else None,
        workspace_peak_bytes=c.dbo.workspace_peak_bytes,
        trace=c.trace,
        timeline_png=c.timeline_png,
        details=details,
    )


def _why(c: Comparison, races: int) -> str:
    reasons = []
    if not c.outputs_match:
        reasons.append(f"outputs differ (max abs diff {c.max_abs_diff:.3g} > {c.tolerance:g})")
    if races:
        first = (c.dbo.races or c.serial.races)[0]
        reasons.append(f"{races} race(s), first: {first.describe()}")
    if c.dbo.allocations_during_step:
        reasons.append(f"{c.dbo.allocations_during_step} workspace allocation(s) after lock")
    return "; ".join(reasons)


def fresh_device(opts: RunOptions, *, watch_pointers: bool = False) -> tuple[Any, Any]:
    """A new device and a new workspace manager with one slot per ubatch; with
    `watch_pointers`, graph replay on the device checks the manager's slot pointers."""
    device = new_device(opts)
    reset_workspace_manager()
    init_workspace_manager(device.torch_device, opts.num_ubatches)
    manager = current_workspace_manager()
    if watch_pointers:
        device.add_buffer_owner(manager)
    return device, manager


def run_ubatched(opts: RunOptions, fn: Callable[[int], Any]) -> tuple[SimDevice, list[Any]]:
    """Run `fn(ubatch id)` as one ubatched step on a fresh device and workspace."""
    device, _ = fresh_device(opts)
    outs = dbo.run_ubatches(
        fn, list(range(opts.num_ubatches)), device=device, timeout=opts.timeout_s
    )
    device.synchronize()
    return device, outs


def with_artifacts(
    result: ScenarioResult, device: Any, opts: RunOptions, failure: BaseException | None = None
) -> ScenarioResult:
    """Write the device's timeline (whatever ran, up to a caught fault) as the scenario's trace
    and PNG, when there is an output folder and the device kept a timeline (the simulator);
    the PNG marks the races, and where the step stopped when it failed with `failure`."""
    records = list(getattr(device, "timeline", []))
    if opts.out_dir is not None and records:
        run = StepRun(torch.empty(0), 0.0, None, records, list(getattr(device, "races", [])))
        result.trace, result.timeline_png = write_artifacts(
            result.scenario, run, opts, failure=failure, caught=result.caught
        )
    return result


def case_result(
    name: str, device: Any, checks: dict[str, bool], opts: RunOptions, **details: Any
) -> ScenarioResult:
    """The verdict of a workspace case: every named check holds and nothing raced."""
    races = list(getattr(device, "races", []))
    failed = [k for k, ok in checks.items() if not ok]
    error = None
    if failed:
        error = "failed: " + ", ".join(failed)
    elif races:
        error = races[0].describe()
    result = ScenarioResult(
        name,
        passed=not failed and not races,
        outputs_match=checks.get("outputs match"),
        races=len(races),
        error=error,
        workspace_peak_bytes=current_workspace_manager().stats().peak_bytes,
        details={**details, "checks": checks},
    )
    return with_artifacts(result, device, opts)


def registries_empty() -> bool:
    """No ubatched step is registered as running: a failed step left nothing behind."""
    return not ubatching.ubatch_step_active()
