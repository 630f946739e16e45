"""What one `dbo.verify` call found, as a record (`VerifyReport`) and as readable text.

The text leads with the verdict, then each finding: whether the outputs match (and why not),
the races of each run grouped by cause with the fix, the ubatched step's error, the yield
counts, the step times, and notes that explain a poor speedup (a step with no communication
to overlap, a step too small for the device to be the bottleneck).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dbo.jsonsafe import json_safe
from dbo.sim.records import OpRecord, RaceReport
from dbo.sim.reorder import ReorderOutcome
from dbo.sim.report import plot_runs, write_chrome_trace_runs
from dbo.sim.trace import TraceRun, Window
from dbo.verification.graph_runner import GraphReplay
from dbo.verification.graphs import graph_lines
from dbo.verification.race_causes import group_races

__all__ = ["HOST_BOUND_FRACTION", "RunRaces", "VerifyError", "VerifyReport"]

# Above this share of the DBO step with every stream idle, the host (baton passes, launches)
# is what the step waits for, and overlapping device work cannot shorten it.
HOST_BOUND_FRACTION = 0.5
_RUNS = ("serial", "ubatched")


class VerifyError(AssertionError):
    """A forward failed `verify`; the message is the report's `describe()`."""

    def __init__(self, report: VerifyReport) -> None:
        super().__init__(report.describe())
        self.report = report


class RunRaces(Sequence[RaceReport]):
    """The races of both runs: a sequence of every race (falsy when there is none, `len`
    counts them), with each run's own list as `.serial` / `.ubatched` (or `races["serial"]`)."""

    def __init__(self, serial: Sequence[RaceReport], ubatched: Sequence[RaceReport]) -> None:
        self.serial = list(serial)
        self.ubatched = list(ubatched)

    def __len__(self) -> int:
        return len(self.serial) + len(self.ubatched)

    def __iter__(self) -> Iterator[RaceReport]:
        yield from self.serial
        yield from self.ubatched

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            if key not in _RUNS:
                raise KeyError(f"{key!r}: the runs are 'serial' and 'ubatched'")
            return getattr(self, key)
        return [*self.serial, *self.ubatched][key]

    def get(self, run: str, default: Any = None) -> Any:
        return getattr(self, run) if run in _RUNS else default

    def items(self) -> list[tuple[str, list[RaceReport]]]:
        return [(run, getattr(self, run)) for run in _RUNS]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RunRaces):
            return self.serial == other.serial and self.ubatched == other.ubatched
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RunRaces(serial={len(self.serial)}, ubatched={len(self.ubatched)})"


@dataclass
class VerifyReport:
    """What one `verify` call found. `ok` only when outputs match, no race, and no error."""

    ok: bool
    outputs_match: bool
    max_abs_diff: float | None  # None when nothing was compared (the ubatched step failed)
    races: RunRaces
    error: BaseException | None  # what the ubatched step raised (UBatchError and subclasses)
    yield_counts: list[int] | None  # per ubatch; None where the device cannot count them
    step_us_serial: float
    step_us_dbo: float
    num_ubatches: int = 2
    device: str = "sim"
    atol: float = 0.0
    rtol: float = 0.0
    mismatch: str | None = None  # why the outputs differ (structure, dtype, shape, values)
    # Share of the ubatched run's device-op time no measured kernel covered (the roofline
    # priced it); None on a real GPU.
    roofline_fraction: float | None = None
    input_mutated: bool = False  # the forward wrote the batch it was given (each run had a copy)
    # Share of the DBO step with every stream idle, and the communication time in it; None on
    # a real GPU (no timeline).
    host_bound_fraction: float | None = None
    comm_us: float | None = None
    local_comm: bool | None = None  # every comm op stayed on one GPU (ep_size 1)
    shapes_only: bool = False  # meta tensors: no values to compare, no memory to race on
    race_order: str = "issue"  # "adversarial": the ubatched step re-executed out of issue order
    adversarial: ReorderOutcome | None = None
    # The split's attention metadata breaking an invariant (dbo.split's checker): the cause
    # of what the ubatched step then did, reported beside its error, never in place of it.
    metadata_error: Exception | None = None
    graphs: list[GraphReplay] = field(default_factory=list)  # steps served through CUDA graphs
    trace: str | None = None
    timeline_png: str | None = None
    runtime: str = "dbo"  # whose ring drove the ubatched step: "dbo", "vllm" or "both"
    # runtime="both": where vLLM's ring and dbo's ran the same forward differently
    runtime_differences: list[str] = field(default_factory=list)
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
        lines = [f"dbo.verify: {verdict} ({self.num_ubatches} ubatches on {self.device})"]
        lines += _outputs_lines(self)
        lines += _race_lines(self)
        lines += graph_lines(self.graphs)
        if self.metadata_error is not None:
            lines.append(f"  split metadata   {error_text(self.metadata_error)}")
        lines.append(f"  error            {error_text(self.error)}")
        lines.extend(f"    {line}" for line in _error_detail(self.error))
        counts = "n/a" if self.yield_counts is None else str(self.yield_counts)
        lines.append(f"  yield counts     {counts}")
        if self.runtime != "dbo":
            found = len(self.runtime_differences)
            lines.append(f"  runtime          {self.runtime} ({found} differences)")
            lines.extend(f"    {line}" for line in self.runtime_differences)
        lines += _time_lines(self)
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
        """JSON types only: races as their descriptions (and grouped by cause), the error as
        its type and text."""
        return json_safe(
            {
                "ok": self.ok,
                "outputs_match": self.outputs_match,
                "max_abs_diff": self.max_abs_diff,
                "mismatch": self.mismatch,
                "input_mutated": self.input_mutated,
                "shapes_only": self.shapes_only,
                "races": {run: [r.describe() for r in found] for run, found in self.races.items()},
                "race_causes": {
                    run: [
                        {"ranges": c.ranges, "bytes": c.nbytes, "missing": c.missing, "fix": c.fix}
                        for c in group_races(found)
                    ]
                    for run, found in self.races.items()
                },
                "race_order": self.race_order,
                "adversarial": None if self.adversarial is None else self.adversarial.to_dict(),
                "error": None if self.error is None else error_text(self.error),
                "error_type": None if self.error is None else type(self.error).__name__,
                "metadata_error": None
                if self.metadata_error is None
                else error_text(self.metadata_error),
                "graphs": [
                    {
                        "step": r.step,
                        "mode": r.mode.name,
                        "key": r.key._asdict(),
                        "batch": r.batch._asdict(),
                        "problems": r.problems,
                        "mismatch": r.mismatch,
                        "ok": r.ok,
                    }
                    for r in self.graphs
                ],
                "yield_counts": self.yield_counts,
                "step_us_serial": self.step_us_serial,
                "step_us_dbo": self.step_us_dbo,
                "speedup": self.speedup,
                "roofline_fraction": self.roofline_fraction,
                "host_bound_fraction": self.host_bound_fraction,
                "comm_us": self.comm_us,
                "local_comm": self.local_comm,
                "num_ubatches": self.num_ubatches,
                "device": self.device,
                "trace": self.trace,
                "timeline_png": self.timeline_png,
            }
        )


def _outputs_lines(report: VerifyReport) -> list[str]:
    if report.max_abs_diff is None:
        lines = ["  outputs match    not compared (the ubatched step failed)"]
    elif report.shapes_only:
        flag = "yes" if report.outputs_match else "NO"
        lines = [
            f"  outputs match    {flag} in structure, dtype and shape (meta tensors: no values)"
        ]
    else:
        flag = "yes" if report.outputs_match else "NO"
        reordered = report.adversarial is not None and report.adversarial.mismatch is not None
        order = "in the adversarial order; issue order: " if reordered else ""
        lines = [
            f"  outputs match    {flag} ({order}max abs diff {report.max_abs_diff:.3g}; atol "
            f"{report.atol:g}, rtol {report.rtol:g})"
        ]
    if report.mismatch:
        lines.append(f"    {report.mismatch}")
    if report.input_mutated:
        lines.append(
            "    note: the forward mutated its input; each run was given its own copy of the "
            "batch, so no run saw another's writes"
        )
    if report.adversarial is not None:
        lines += [f"    {line}" for line in report.adversarial.describe().splitlines()]
    return lines


_SHOWN_CAUSES = 5


def _race_lines(report: VerifyReport) -> list[str]:
    if report.shapes_only:
        return ["  races            not checked (meta tensors have no memory to race on)"]
    lines = []
    for run, found in report.races.items():
        causes = group_races(found)
        grouped = f" in {len(causes)} cause(s)" if found else ""
        lines.append(f"  races ({run}){' ' * (9 - len(run))}{len(found)}{grouped}")
        for cause in causes[:_SHOWN_CAUSES]:
            lines.extend(f"    {line}" for line in cause.describe().splitlines())
        if len(causes) > _SHOWN_CAUSES:
            lines.append(f"    ... and {len(causes) - _SHOWN_CAUSES} more cause(s)")
    return lines


def _time_lines(report: VerifyReport) -> list[str]:
    if report.error is not None:
        return [f"  step time        serial {report.step_us_serial:.1f} us, DBO step failed"]
    lines = [
        f"  step time        serial {report.step_us_serial:.1f} us, DBO "
        f"{report.step_us_dbo:.1f} us, speedup {report.speedup:.2f}x"
    ]
    if report.roofline_fraction is not None:
        lines.append(
            f"  roofline-priced  {100.0 * report.roofline_fraction:.0f}% of device time "
            f"(no measured kernel covered it)"
        )
    if report.comm_us is not None and report.comm_us == 0.0:
        lines.append(
            "  note             no communication: nothing in the step is marked as "
            "communication (device.comm_region or dbo.comm.EPGroup), so DBO has nothing to overlap "
            "and only adds baton passes"
        )
    if report.local_comm:
        lines.append(
            "  note             all communication is local (comm_regions with ep_size 1): no "
            "byte leaves the GPU, so it runs as full-grid kernels in turn with compute and "
            "there is little to overlap; give comm_region the EP size (ep_size=8) or use "
            "dbo.comm.EPGroup"
        )
    fraction = report.host_bound_fraction
    if fraction is not None and fraction > HOST_BOUND_FRACTION:
        lines.append(
            f"  note             host-bound: every stream is idle {100.0 * fraction:.0f}% of "
            f"the DBO step, waiting for the host (baton passes, op launches); a step this "
            f"small cannot gain from overlap, try a larger batch"
        )
    return lines


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


def error_text(error: BaseException | None) -> str:
    """`Type: first line of the message`, or "none"."""
    if error is None:
        return "none"
    first = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {first}"
