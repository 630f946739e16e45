"""Step summary: reduce a list of `OpRecord`s to step time, overlap and idle figures.

Everything here is computed from records only, with exact interval arithmetic (sort, merge,
sum of merged lengths), so the numbers do not depend on how the simulator produced them.

Definitions (all times in microseconds of virtual time; "device ops" are the COMPUTE and COMM
records; SYNC and HANDOFF are host-side and never make the device busy):

- window: `[start, end]`. `start` defaults to the earliest issue or start time of any record,
  `end` to the latest end of any record. Every interval is clipped to the window.
- `step_us` = end - start.
- `busy_us_per_stream[s]` = length of the union of the intervals of all records on stream `s`
  (the host stream included: there it is the time spent in syncs and handoffs).
- `compute_us` = length of the union of all COMPUTE intervals, whatever their stream.
- `comm_us` = length of the union of all COMM intervals.
- `hidden_comm_us` = length of (COMM union) intersected with (COMPUTE union): communication
  that ran while some compute ran.
- `overlap_fraction` = hidden_comm_us / comm_us, and 0.0 when comm_us == 0 (no communication
  means none was hidden; this keeps the field a plain finite number).
- `exposed_comm_us` = comm_us - hidden_comm_us.
- `host_bound_fraction` = (step_us - length of the union of all device ops) / step_us: the share
  of the step in which no stream runs device work (the device waits, typically on host
  launches). 0.0 when step_us == 0.
- `fallback_fraction` = device-op time priced by the roofline fallback (a record's
  `args["fallback_us"]`: no measured kernel covered it) / summed device-op time (each record's
  own duration, unclipped and not merged): how much of the step rests on the roofline rather
  than on measured kernels. 0.0 with no device ops; on an uncalibrated profile, every compute
  op's time (link transfers are the comm model's, not a fallback).

Several ranks: each rank gets a `RankSummary` over a window that starts at the common start
and ends at that rank's own last op. The top-level time fields are those of the slowest rank
(latest end; ties go to the lowest rank id), so `step_us` is the slowest rank's step time.
`num_ops` counts the records of every rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from dbo.sim.records import COMM, COMPUTE, OpRecord, RaceReport

__all__ = [
    "Interval",
    "RankSummary",
    "StepSummary",
    "check_records",
    "clip_intervals",
    "fallback_fraction",
    "format_summary",
    "intersect_intervals",
    "summarize",
    "total_length",
    "union_intervals",
]

Interval = tuple[float, float]

_DEVICE_KINDS = (COMPUTE, COMM)


# ---------------------------------------------------------------------------------------------
# Interval arithmetic (pure functions)
# ---------------------------------------------------------------------------------------------


def union_intervals(intervals: Iterable[Interval]) -> list[Interval]:
    """Merge closed intervals into a sorted list of disjoint ones.

    Touching intervals ([0, 1] and [1, 2]) merge, so a back-to-back stream reads as one busy
    span. Empty intervals (end <= start) carry no time and are dropped.
    """
    spans = sorted((s, e) for s, e in intervals if e > s)
    merged: list[Interval] = []
    for s, e in spans:
        if merged and s <= merged[-1][1]:
            if e > merged[-1][1]:
                merged[-1] = (merged[-1][0], e)
        else:
            merged.append((s, e))
    return merged


def intersect_intervals(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """Intersection of two unions; both inputs must be sorted and disjoint (see `union_intervals`).

    A two-pointer sweep: linear in the input sizes. Zero-length contacts are not kept.
    """
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        s = max(a[i][0], b[j][0])
        e = min(a[i][1], b[j][1])
        if e > s:
            out.append((s, e))
        # Advance whichever interval ends first: it cannot meet anything later in the other list.
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def clip_intervals(intervals: Iterable[Interval], lo: float, hi: float) -> list[Interval]:
    """Each interval cut to [lo, hi]; those left empty are dropped."""
    out: list[Interval] = []
    for s, e in intervals:
        s, e = max(s, lo), min(e, hi)
        if e > s:
            out.append((s, e))
    return out


def total_length(intervals: Iterable[Interval]) -> float:
    """Sum of lengths; exact union length when given the output of `union_intervals`."""
    return float(sum(e - s for s, e in intervals))


# ---------------------------------------------------------------------------------------------
# Record checks
# ---------------------------------------------------------------------------------------------


def check_records(records: Iterable[OpRecord]) -> None:
    """Raise ValueError on a record whose times are not finite or that ends before it starts.

    Reports must not turn a simulator bug into a silently wrong number or an unloadable trace.
    """
    for r in records:
        for name in ("issue_us", "start_us", "end_us"):
            v = getattr(r, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"record seq={r.seq} ({r.name!r}): {name}={v!r} is not finite")
        if r.end_us < r.start_us:
            raise ValueError(
                f"record seq={r.seq} ({r.name!r}): end_us={r.end_us} < start_us={r.start_us}"
            )


# ---------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------


def _frozen_map(d: Mapping[str, float]) -> Mapping[str, float]:
    return MappingProxyType(dict(d))


@dataclass(frozen=True)
class RankSummary:
    """The summary figures of one rank (definitions in the module docstring)."""

    rank: int
    start_us: float
    end_us: float
    step_us: float
    busy_us_per_stream: Mapping[str, float]
    compute_us: float
    comm_us: float
    hidden_comm_us: float
    overlap_fraction: float
    exposed_comm_us: float
    host_bound_fraction: float
    num_ops: int
    fallback_fraction: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return _plain(self)


@dataclass(frozen=True)
class StepSummary:
    """One step, as the slowest rank saw it, plus counts over all ranks."""

    step_us: float
    busy_us_per_stream: Mapping[str, float]
    compute_us: float
    comm_us: float
    hidden_comm_us: float
    overlap_fraction: float
    exposed_comm_us: float
    host_bound_fraction: float
    num_ops: int
    num_races: int
    workspace_peak_bytes: int
    slowest_rank: int | None  # None when there are no records
    ranks: tuple[RankSummary, ...] = field(default=())  # one per rank, by rank id
    fallback_fraction: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of JSON types (finite floats, ints, strs, lists, dicts)."""
        return _plain(self)


def _plain(summary: Any) -> dict[str, Any]:
    """A summary record's fields as JSON types: maps become dicts, nested records dicts."""

    def plain(value: Any) -> Any:
        if isinstance(value, Mapping):
            return dict(value)
        if isinstance(value, tuple):
            return [v.to_dict() if hasattr(v, "to_dict") else v for v in value]
        return value

    return {f.name: plain(getattr(summary, f.name)) for f in fields(summary)}


def _summarize_rank(rank: int, records: Sequence[OpRecord], lo: float, hi: float) -> RankSummary:
    step = hi - lo
    by_stream: dict[str, list[Interval]] = {}
    compute: list[Interval] = []
    comm: list[Interval] = []
    for r in records:
        iv = (r.start_us, r.end_us)
        by_stream.setdefault(r.stream, []).append(iv)
        if r.kind == COMPUTE:
            compute.append(iv)
        elif r.kind == COMM:
            comm.append(iv)
    busy = {
        s: total_length(union_intervals(clip_intervals(ivs, lo, hi)))
        for s, ivs in by_stream.items()
    }
    compute_u = union_intervals(clip_intervals(compute, lo, hi))
    comm_u = union_intervals(clip_intervals(comm, lo, hi))
    compute_us = total_length(compute_u)
    comm_us = total_length(comm_u)
    hidden = total_length(intersect_intervals(comm_u, compute_u))
    device_us = total_length(union_intervals(compute_u + comm_u))
    return RankSummary(
        fallback_fraction=fallback_fraction(records),
        rank=rank,
        start_us=lo,
        end_us=hi,
        step_us=step,
        busy_us_per_stream=_frozen_map(busy),
        compute_us=compute_us,
        comm_us=comm_us,
        hidden_comm_us=hidden,
        overlap_fraction=hidden / comm_us if comm_us > 0 else 0.0,
        exposed_comm_us=comm_us - hidden,
        # max() guards against a float residue making an all-busy step read as -1e-17.
        host_bound_fraction=max(0.0, (step - device_us) / step) if step > 0 else 0.0,
        num_ops=len(records),
    )


def _empty_summary(
    w_lo: float | None, w_hi: float | None, num_races: int, workspace_peak_bytes: int
) -> StepSummary:
    """A step with no op: all of its window (if any) is idle."""
    lo = w_lo if w_lo is not None else 0.0
    hi = w_hi if w_hi is not None else lo
    step = max(0.0, float(hi - lo))
    return StepSummary(
        step_us=step,
        busy_us_per_stream=_frozen_map({}),
        compute_us=0.0,
        comm_us=0.0,
        hidden_comm_us=0.0,
        overlap_fraction=0.0,
        exposed_comm_us=0.0,
        # An empty window of positive length is all idle.
        host_bound_fraction=1.0 if step > 0 else 0.0,
        num_ops=0,
        num_races=num_races,
        workspace_peak_bytes=int(workspace_peak_bytes),
        slowest_rank=None,
        ranks=(),
    )


def summarize(
    records: Sequence[OpRecord],
    *,
    races: Sequence[RaceReport] = (),
    workspace_peak_bytes: int = 0,
    window: tuple[float | None, float | None] | None = None,
) -> StepSummary:
    """Summarize one step (definitions in the module docstring).

    `window=(start, end)` fixes the step's bounds (either may be None for its default); ops are
    clipped to it. With no window, the step runs from the earliest issue/start time to the
    latest end; each rank's window then ends at its own last op.
    """
    records = list(records)
    check_records(records)
    w_lo, w_hi = window if window is not None else (None, None)
    if w_lo is not None and w_hi is not None and w_hi < w_lo:
        raise ValueError(f"window end {w_hi} is before its start {w_lo}")

    if not records:
        return _empty_summary(w_lo, w_hi, len(races), workspace_peak_bytes)

    lo = float(w_lo) if w_lo is not None else min(min(r.issue_us, r.start_us) for r in records)
    by_rank: dict[int, list[OpRecord]] = {}
    for r in records:
        by_rank.setdefault(r.rank, []).append(r)

    ranks: list[RankSummary] = []
    for rank in sorted(by_rank):
        rs = by_rank[rank]
        hi = float(w_hi) if w_hi is not None else max(r.end_us for r in rs)
        ranks.append(_summarize_rank(rank, rs, lo, max(lo, hi)))

    # Strict '>' keeps the lowest rank id on ties, so the choice is deterministic.
    slow = ranks[0]
    for rs in ranks[1:]:
        if rs.step_us > slow.step_us:
            slow = rs

    return StepSummary(
        step_us=slow.step_us,
        busy_us_per_stream=slow.busy_us_per_stream,
        compute_us=slow.compute_us,
        comm_us=slow.comm_us,
        hidden_comm_us=slow.hidden_comm_us,
        overlap_fraction=slow.overlap_fraction,
        exposed_comm_us=slow.exposed_comm_us,
        host_bound_fraction=slow.host_bound_fraction,
        num_ops=len(records),
        num_races=len(races),
        workspace_peak_bytes=int(workspace_peak_bytes),
        slowest_rank=slow.rank,
        ranks=tuple(ranks),
        fallback_fraction=slow.fallback_fraction,
    )


def fallback_fraction(records: Iterable[OpRecord]) -> float:
    """Share of summed device-op time priced by the roofline fallback (see the module doc)."""
    total = fallback = 0.0
    for r in records:
        if r.kind in _DEVICE_KINDS:
            total += r.end_us - r.start_us
            fallback += min(float(r.args.get("fallback_us", 0.0)), r.end_us - r.start_us)
    return fallback / total if total > 0 else 0.0


def format_summary(summary: StepSummary) -> str:
    """A short human-readable block: step time, overlap, exposed comm, host-bound share, races."""
    s = summary
    lines = [
        f"step time        {s.step_us:12.1f} us"
        + (f"  (slowest rank {s.slowest_rank} of {len(s.ranks)})" if len(s.ranks) > 1 else ""),
        f"compute          {s.compute_us:12.1f} us",
        f"comm             {s.comm_us:12.1f} us  overlap {100.0 * s.overlap_fraction:5.1f}%",
        f"exposed comm     {s.exposed_comm_us:12.1f} us",
        f"host-bound       {100.0 * s.host_bound_fraction:12.1f} %   (device idle)",
        f"roofline-priced  {100.0 * s.fallback_fraction:12.1f} %   (of device-op time)",
        f"ops              {s.num_ops:12d}",
        f"races            {s.num_races:12d}" + ("  <-- check the trace" if s.num_races else ""),
    ]
    if s.workspace_peak_bytes:
        lines.append(f"workspace peak   {s.workspace_peak_bytes / 2**20:12.2f} MiB")
    return "\n".join(lines)
