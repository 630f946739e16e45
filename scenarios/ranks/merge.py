"""Merging the ranks' outcomes of a scenario into one result and one trace, a process per rank."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from dbo.sim.records import OpRecord, RaceReport
from dbo.sim.report import merge_traces, plot_timeline, summarize
from scenarios.harness import RunOptions
from scenarios.ranks.records import RankOutcome
from scenarios.registry import SCENARIOS, ScenarioResult, caught_line

__all__ = ["merge_outcomes"]


def merge_outcomes(
    name: str, outcomes: Sequence[RankOutcome | None], opts: RunOptions, *, missing: str = ""
) -> ScenarioResult:
    """One `ScenarioResult` from every rank's outcome (None: the rank reported nothing): passed
    only if every rank passed, the slowest rank's step time, one Chrome trace for all ranks."""
    present = [o for o in outcomes if o is not None]
    absent = [r for r, o in enumerate(outcomes) if o is None]
    errors = [o.error for o in present if o.error]
    if absent:
        errors.insert(0, f"rank(s) {absent} reported nothing{': ' + missing if missing else ''}")
    result = _merged_result(name, present, absent, errors, world=len(outcomes))
    traced = [records for o in present if (records := o.dbo_records or o.trace_records)]
    if opts.out_dir is not None and traced:
        races = [race for o in present for race in o.races]
        ran_dbo = any(o.dbo_records for o in present)
        _write_trace(result, traced, races, opts, world=len(outcomes), ran_dbo=ran_dbo)
    return result


def _merged_result(
    name: str,
    present: Sequence[RankOutcome],
    absent: Sequence[int],
    errors: Sequence[str],
    *,
    world: int,
) -> ScenarioResult:
    serial_records = [r for o in present for r in o.serial_records]
    dbo_records = [r for o in present for r in o.dbo_records]
    races = [race for o in present for race in o.races]
    serial = summarize(serial_records) if serial_records else None
    ubatched = summarize(dbo_records, races=races) if dbo_records else None
    matches = [o.outputs_match for o in present if o.outputs_match is not None]
    diffs = [o.max_abs_diff for o in present if o.max_abs_diff is not None]
    peaks = [o.workspace_peak_bytes for o in present if o.workspace_peak_bytes is not None]
    return ScenarioResult(
        scenario=name,
        passed=not absent and all(o.passed for o in present),
        negative=SCENARIOS[name].negative,
        outputs_match=(all(matches) and not absent) if matches else None,
        max_abs_diff=max(diffs) if diffs else None,
        races=len(races),
        error="; ".join(errors) or None,
        caught=next((caught_line(c) for o in present if (c := o.details.get("caught"))), None),
        step_us_serial=serial.step_us if serial else None,
        step_us_dbo=ubatched.step_us if ubatched else None,
        speedup=serial.step_us / ubatched.step_us
        if serial and ubatched and ubatched.step_us > 0
        else None,
        overlap_fraction=ubatched.overlap_fraction if ubatched else None,
        exposed_comm_us=ubatched.exposed_comm_us if ubatched else None,
        workspace_peak_bytes=max(peaks) if peaks else None,
        details={
            "ranks": world,
            "slowest_rank": ubatched.slowest_rank if ubatched else None,
            "per_rank": [
                {"rank": o.rank, "passed": o.passed, "wall_s": round(o.wall_s, 3), **o.details}
                for o in present
            ],
        },
    )


def _write_trace(
    result: ScenarioResult,
    traced: Sequence[list[OpRecord]],
    races: list[RaceReport],
    opts: RunOptions,
    *,
    world: int,
    ran_dbo: bool,
) -> None:
    """The merged Chrome trace and PNG timeline, their paths set on `result`."""
    assert opts.out_dir is not None
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    name = result.scenario
    trace = merge_traces(traced, races=races, metadata={"scenario": name, "ranks": world})
    stem = opts.out_dir / opts.artifact_stem(name, ranks=world)
    path = Path(f"{stem}.trace.json")
    path.write_text(json.dumps(trace, allow_nan=False, separators=(",", ":")), encoding="utf-8")
    result.trace = str(path)
    what = "DBO" if ran_dbo else "what ran"
    result.timeline_png = str(
        plot_timeline(
            Path(f"{stem}.png"),
            [r for records in traced for r in records],
            title=f"{name} ({what}, {world} ranks)"
            + (f", fault caught: {result.caught}" if result.caught else ""),
        )
    )
