"""Verify a user's own forward under DBO: one serial and one ubatched step, compared.

`verify(forward, inputs)` is the whole overlap-correctness check for code this package has
never seen: run `forward` once with DBO off (every dbo_* call a no-op), once split into
ubatches through `run_ubatches` on the same kind of device, and report whether the outputs
match, whether the race checker saw unordered accesses, and whether the ubatched step failed
(a raise, a yield-count mismatch, a hang). It never hangs: the ubatched step runs under
`run_ubatches`' timeout, and every failure of that step comes back as data in the report.

Life cycle, as an engine runs it: if no workspace manager is initialised, one is made for the
device and ubatch count, both paths are warmed up (the workspace grows to its largest need),
it is locked, the two steps are measured, and the previous state (none) is restored. A manager
the caller already initialised is used as it is and left as it was.

`workspace` is imported as a module, not as names: `workspace.manager` imports
`dbo.ubatching`, so `import workspace` first runs this package's `__init__` while `workspace`
is half-imported; its attributes are read only when `verify` runs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import workspace
from dbo.checks import as_int
from dbo.devices import resolve_device, use_device
from dbo.errors import YieldMismatchError
from dbo.jsonsafe import json_safe
from dbo.runner import merge_outputs, run_ubatches
from dbo.sim.device import SimDevice
from dbo.sim.records import HANDOFF, EventWait, HostRange, OpRecord, RaceReport
from dbo.sim.report import plot_runs, summarize, write_chrome_trace_runs
from dbo.sim.summary import fallback_fraction
from dbo.sim.trace import TraceRun, Window
from dbo.split import check_split_inputs, ubatch_cut_points
from dbo.streams import Device

__all__ = ["VerifyError", "VerifyReport", "split_inputs", "verify"]


class VerifyError(AssertionError):
    """A forward failed `verify`; the message is the report's `describe()`."""

    def __init__(self, report: VerifyReport) -> None:
        super().__init__(report.describe())
        self.report = report


@dataclass
class VerifyReport:
    """What one `verify` call found. `ok` only when outputs match, no race, and no error."""

    ok: bool
    outputs_match: bool
    max_abs_diff: float | None  # None when nothing was compared (the ubatched step failed)
    races: dict[str, list[RaceReport]]  # "serial" and "ubatched"
    error: BaseException | None  # what the ubatched step raised (UBatchError and subclasses)
    yield_counts: list[int] | None  # per ubatch; None where the device cannot count them
    step_us_serial: float
    step_us_dbo: float
    num_ubatches: int = 2
    device: str = "sim"
    atol: float = 0.0
    rtol: float = 0.0
    mismatch: str | None = None  # why the outputs differ (structure, shape, values)
    # Share of the ubatched run's device-op time no measured kernel covered (the roofline
    # priced it); None on a real GPU.
    roofline_fraction: float | None = None
    trace: str | None = None
    timeline_png: str | None = None
    records: dict[str, list[OpRecord]] = field(default_factory=dict, repr=False)
    runs: list[TraceRun] = field(default_factory=list, repr=False)  # what the pictures draw

    @property
    def speedup(self) -> float:
        """Serial step time over DBO step time (nan when either was not measured)."""
        if self.step_us_dbo > 0 and self.step_us_serial > 0:
            return self.step_us_serial / self.step_us_dbo
        return math.nan

    def describe(self) -> str:
        """The report as readable text: the verdict first, then each finding."""
        verdict = "OK" if self.ok else "FAILED"
        lines = [
            f"dbo.verify: {verdict} ({self.num_ubatches} ubatches on {self.device})",
            f"  outputs match    {_yes_no(self.outputs_match)}" + _diff_text(self),
        ]
        if self.mismatch:
            lines.append(f"    {self.mismatch}")
        for run in ("serial", "ubatched"):
            found = self.races.get(run, [])
            lines.append(f"  races ({run}){' ' * (9 - len(run))}{len(found)}")
            lines.extend(f"    {race.describe()}" for race in found[:5])
            if len(found) > 5:
                lines.append(f"    ... and {len(found) - 5} more")
        lines.append(f"  error            {_error_text(self.error)}")
        lines.extend(f"    {line}" for line in _error_detail(self.error))
        counts = "n/a" if self.yield_counts is None else str(self.yield_counts)
        lines.append(f"  yield counts     {counts}")
        if self.error is None:
            lines.append(
                f"  step time        serial {self.step_us_serial:.1f} us, DBO "
                f"{self.step_us_dbo:.1f} us, speedup {self.speedup:.2f}x"
            )
            if self.roofline_fraction is not None:
                lines.append(
                    f"  roofline-priced  {100.0 * self.roofline_fraction:.0f}% of device time "
                    f"(no measured kernel covered it)"
                )
        else:
            lines.append(f"  step time        serial {self.step_us_serial:.1f} us, DBO step failed")
        if self.trace:
            lines.append(f"  trace            {self.trace}")
        if self.timeline_png:
            lines.append(f"  timeline         {self.timeline_png}")
        return "\n".join(lines)

    def raise_for_failure(self) -> None:
        """Raise `VerifyError` (message: `describe()`) unless the report is ok."""
        if not self.ok:
            raise VerifyError(self)

    def write_artifacts(self, folder: str | Path, *, window: Window | None = None) -> None:
        """Write `verify.trace.json` and `verify.png` (serial above DBO, one time axis) to
        `folder`, `window` narrowing both; sets `trace` and `timeline_png`. Nothing to draw
        (a real GPU keeps no timeline) writes nothing."""
        if not any(run.records for run in self.runs):
            return
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        verdict = "ok" if self.ok else "FAILED"
        self.trace = str(
            write_chrome_trace_runs(
                folder / "verify.trace.json",
                self.runs,
                metadata={"verify": self.to_dict()},
                window=window,
            )
        )
        self.timeline_png = str(
            plot_runs(
                folder / "verify.png",
                self.runs,
                window=window,
                title=f"verify: {verdict}, serial {self.step_us_serial:.1f} us vs DBO "
                f"{self.step_us_dbo:.1f} us",
            )
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON types only: races as their descriptions, the error as its type and text."""
        return json_safe(
            {
                "ok": self.ok,
                "outputs_match": self.outputs_match,
                "max_abs_diff": self.max_abs_diff,
                "mismatch": self.mismatch,
                "races": {run: [r.describe() for r in found] for run, found in self.races.items()},
                "error": None if self.error is None else _error_text(self.error),
                "error_type": None if self.error is None else type(self.error).__name__,
                "yield_counts": self.yield_counts,
                "step_us_serial": self.step_us_serial,
                "step_us_dbo": self.step_us_dbo,
                "speedup": self.speedup,
                "roofline_fraction": self.roofline_fraction,
                "num_ubatches": self.num_ubatches,
                "device": self.device,
                "trace": self.trace,
                "timeline_png": self.timeline_png,
            }
        )


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "NO"


def _diff_text(report: VerifyReport) -> str:
    if report.max_abs_diff is None:
        return " (not compared)"
    return f" (max abs diff {report.max_abs_diff:.3g}; atol {report.atol:g}, rtol {report.rtol:g})"


_DETAIL_LINES = 20


def _error_detail(error: BaseException | None) -> list[str]:
    """The error message past its first line (where each ubatch stood), cut to stay readable."""
    if error is None:
        return []
    rest = str(error).splitlines()[1:]
    if len(rest) > _DETAIL_LINES:
        more = len(rest) - _DETAIL_LINES
        rest = [*rest[:_DETAIL_LINES], f"... ({more} more lines in report.error)"]
    return rest


def _error_text(error: BaseException | None) -> str:
    if error is None:
        return "none"
    first = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {first}"


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


def _resolve(device: Any) -> Device:
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
# Comparing outputs


def _compare(
    expected: Any, got: Any, atol: float, rtol: float, where: str = "output"
) -> tuple[float, str | None]:
    """(max abs diff, why they differ or None)."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return math.inf, f"{where}: serial gave a tensor, DBO a {type(got).__name__}"
        if expected.shape != got.shape:
            return math.inf, (
                f"{where}: shape {tuple(got.shape)} under DBO, {tuple(expected.shape)} serially"
            )
        if expected.device.type == "meta" or expected.numel() == 0:
            return 0.0, None  # shapes only: no values to compare
        a, b = expected.detach().double().cpu(), got.detach().double().cpu()
        close = torch.isclose(b, a, atol=atol, rtol=rtol, equal_nan=True)
        both_nan = a.isnan() & b.isnan()
        diff = (a - b).abs().masked_fill(both_nan, 0.0).nan_to_num(nan=math.inf)
        worst = diff.max().item()
        if bool(close.all()):
            return worst, None
        bad = int((~close).sum().item())
        return worst, f"{where}: {bad} of {a.numel()} values differ (max abs diff {worst:.3g})"
    if isinstance(expected, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(expected):
            return math.inf, f"{where}: a {type(expected).__name__} of {len(expected)} serially"
        return _worst(
            _compare(e, g, atol, rtol, f"{where}[{i}]")
            for i, (e, g) in enumerate(zip(expected, got))
        )
    if isinstance(expected, Mapping):
        if not isinstance(got, Mapping) or set(got) != set(expected):
            return math.inf, f"{where}: keys differ from the serial output's"
        return _worst(
            _compare(expected[k], got[k], atol, rtol, f"{where}[{k!r}]") for k in expected
        )
    if expected == got:
        return 0.0, None
    return math.inf, f"{where}: {got!r} under DBO, {expected!r} serially"


def _worst(results: Any) -> tuple[float, str | None]:
    worst, why = 0.0, None
    for diff, reason in results:
        worst = max(worst, diff)
        why = why or reason
    return worst, why


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
    Exceptions of the `catch` types become the run's `error`; others propagate."""
    if isinstance(device, SimDevice):
        device.synchronize()
        device.reset()
        error, output = None, None
        try:
            output = step()
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
    return _Run(output, start.elapsed_time(end) * 1000.0, [], [], [], [], error)


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


def verify(
    forward: Callable[[Any], Any],
    inputs: Any,
    *,
    num_ubatches: int = 2,
    device: Device | str = "sim",
    split: Callable[[Any, int], Sequence[Any]] | None = None,
    merge: Callable[[list[Any]], Any] | None = None,
    warmup: int = 1,
    atol: float = 0.0,
    rtol: float = 0.0,
    timeout: float = 60.0,
    artifacts: str | Path | None = None,
) -> VerifyReport:
    """Run `forward(inputs)` serially and as `num_ubatches` ubatches, and compare.

    `split(inputs, num_ubatches) -> list` gives the ubatch inputs (default: `split_inputs`);
    `merge(outputs) -> output` joins the ubatch outputs (default: `dbo.merge_outputs`).
    `device`: "sim" (a fresh simulated H200), "cuda", or a `Device` (reset between runs when
    simulated). `artifacts`: a folder for a Chrome trace and a PNG of both runs. Bad
    arguments raise before any work; a serial forward that raises is re-raised (there is
    nothing to compare); every failure of the ubatched step is reported in `error`.
    """
    _check_args(forward, num_ubatches, split, merge, warmup, atol, rtol, timeout, artifacts)
    pieces = _ubatch_inputs(inputs, num_ubatches, split)
    # Attention metadata the pieces carry must describe exactly their part of the batch
    # (dbo.split's checker); a wrong split is the cause of whatever the step then does.
    metadata_error = check_split_inputs(inputs, pieces)
    dev = _resolve(device)
    merge = merge or merge_outputs
    owns_workspace = _check_workspace(num_ubatches)
    if owns_workspace:
        workspace.init_workspace_manager(dev.torch_device, num_ubatches)
    try:
        serial, ubatched = _run_both(
            forward, inputs, pieces, dev, merge, warmup, timeout, owns_workspace
        )
    finally:
        if owns_workspace:
            workspace.reset_workspace_manager()
    report = _report(serial, ubatched, num_ubatches, dev, atol, rtol)
    if metadata_error is not None:
        report.ok, report.error = False, metadata_error
    if artifacts is not None:
        report.write_artifacts(artifacts)
    return report


def _check_workspace(num_ubatches: int) -> bool:
    """True when verify must make (and later forget) the workspace manager itself; refuses
    an initialised one with too few slots, before any work."""
    if not workspace.is_workspace_manager_initialized():
        return True
    slots = workspace.current_workspace_manager().num_ubatches
    if slots < num_ubatches:
        raise ValueError(
            f"the initialised workspace manager has {slots} slot(s), fewer than "
            f"num_ubatches={num_ubatches}; init_workspace_manager(device, {num_ubatches}) "
            f"or reset it and let verify make one"
        )
    return False


def _run_both(
    forward: Callable,
    inputs: Any,
    pieces: list[Any],
    device: Device,
    merge: Callable,
    warmup: int,
    timeout: float,
    lock: bool,
) -> tuple[_Run, _Run]:
    def serial_step() -> Any:
        with use_device(device), device.thread_scope(None):
            return forward(inputs)

    def ubatched_step() -> Any:
        return merge(run_ubatches(forward, pieces, device=device, timeout=timeout))

    warm_error: BaseException | None = None
    for _ in range(warmup):
        serial_step()
        if warm_error is None:
            try:
                ubatched_step()
            except Exception as error:  # noqa: BLE001 - a finding, reported in the report
                warm_error = error  # measured below all the same, from a reset device
    if lock:
        workspace.lock_workspace()
    serial = _measure(device, serial_step)
    # Any failure of the ubatched step (the step's errors, or merge refusing its outputs) is
    # a finding; the serial step's failures propagate from the call above.
    ubatched = _measure(device, ubatched_step, catch=(Exception,))
    if ubatched.error is None and warm_error is not None:
        ubatched.error = warm_error
    return serial, ubatched


def _report(
    serial: _Run, ubatched: _Run, num_ubatches: int, device: Device, atol: float, rtol: float
) -> VerifyReport:
    if ubatched.error is None:
        diff, why = _compare(serial.output, ubatched.output, atol, rtol)
        match = why is None
    else:
        diff, why, match = None, None, False
    races = {"serial": serial.races, "ubatched": ubatched.races}
    ok = match and ubatched.error is None and not serial.races and not ubatched.races
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
        records={"serial": serial.records, "ubatched": ubatched.records},
        runs=[
            TraceRun("serial", serial.records, serial.races, serial.waits, serial.ranges),
            TraceRun("DBO", ubatched.records, ubatched.races, ubatched.waits, ubatched.ranges),
        ],
    )
