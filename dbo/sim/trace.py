"""Chrome trace: turn `OpRecord`s and `RaceReport`s into Trace Event Format JSON.

The output opens in Perfetto (ui.perfetto.dev) and chrome://tracing: a process per rank, a
track per stream, complete events for ops, instant events for races.

Layout choices, and why:
- `pid` = rank + 1, with a `process_name` metadata event "rank N". Perfetto treats pid 0 as the
  kernel's idle task and its maintainers advise synthesized traces to start at 1
  (google/perfetto#394); the rank itself is in the name and in every event's args.
- Tracks: "host" first (SYNC and HANDOFF records are drawn there whatever their `stream`), then
  the streams in the order they are first seen in the records, the same order on every rank.
  `tid` = pid * 1000 + position, so a tid is unique across the whole trace and never equals its
  pid (both viewers treat tid == pid as the process's main thread); `thread_sort_index` pins
  the order.
- Ops that overlap on one stream (concurrent transfers on a link stream, say) would be drawn as
  false nesting or cut short, so a track spills them onto extra tracks named "name #2", ...
- `ts`/`dur` are microseconds, as the format requires; `displayTimeUnit: "ns"` only sets how
  the viewer prints them. Every number is finite (`json.dumps(allow_nan=False)` enforces it).
- A `RaceReport` carries no time, so its instant event is placed at the start of the first
  record that matches its second site (op name, ubatch, stream), else at the end of the trace.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from dbo.sim.records import HANDOFF, SYNC, OpRecord, RaceReport, OpSite
from dbo.sim.summary import check_records

__all__ = [
    "HOST_TRACK",
    "chrome_trace",
    "merge_traces",
    "track_of",
    "track_order",
    "write_chrome_trace",
]

HOST_TRACK = "host"

# Keys every op event carries in `args`; a record arg with one of these names is kept under
# "record.<name>" rather than silently overwritten.
_STANDARD_ARGS = ("rank", "ubatch", "stream", "seq", "flops", "bytes", "issue_us", "replayed")

_TID_STRIDE = 1000


def track_of(record: OpRecord) -> str:
    """The track a record is drawn on: host-side kinds on the host track, others on their stream."""
    return HOST_TRACK if record.kind in (SYNC, HANDOFF) else record.stream


def track_order(records: Iterable[OpRecord]) -> list[str]:
    """Host first, then every other track in first-seen order (shared by trace and plot)."""
    seen: dict[str, None] = {HOST_TRACK: None}
    for r in records:
        seen.setdefault(track_of(r), None)
    return list(seen)


def _json_safe(value: Any, depth: int = 0) -> Any:
    """A JSON-safe copy: finite numbers, strings, lists, dicts with string keys."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        # A non-finite number would make the file invalid JSON; keep it readable instead.
        return value if math.isfinite(value) else str(value)
    if depth > 8:
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_json_safe(v, depth + 1) for v in value]
    item = getattr(value, "item", None)  # numpy / torch scalars
    if callable(item) and getattr(value, "ndim", None) == 0:
        try:
            return _json_safe(item(), depth + 1)
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(value)


def _op_args(r: OpRecord) -> dict[str, Any]:
    args: dict[str, Any] = {}
    for k, v in (r.args or {}).items():
        key = str(k)
        args[f"record.{key}" if key in _STANDARD_ARGS else key] = _json_safe(v)
    args.update(
        rank=r.rank,
        ubatch=r.ubatch,
        stream=r.stream,
        seq=r.seq,
        flops=_json_safe(float(r.flops)),
        bytes=_json_safe(float(r.bytes)),
        issue_us=float(r.issue_us),
        replayed=bool(r.replayed),
    )
    return args


def _site_args(s: OpSite) -> dict[str, Any]:
    return {
        "op": s.op,
        "ubatch": s.ubatch,
        "stream": s.stream,
        "byte_range": [s.start, s.end],
        "is_write": s.is_write,
        "stack": list(s.stack),
    }


def _meta(event: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    """A metadata event; `args` may hold "name", hence the other parameter's name."""
    return {"ph": "M", "name": event, "pid": pid, "tid": tid, "args": args}


def _assign_lanes(records: Sequence[OpRecord]) -> list[int]:
    """Greedy lane per record so no two records on one lane overlap (touching is fine)."""
    order = sorted(range(len(records)), key=lambda i: (records[i].start_us, records[i].seq))
    lane_end: list[float] = []
    lanes = [0] * len(records)
    for i in order:
        r = records[i]
        for lane, end in enumerate(lane_end):
            if r.start_us >= end:
                break
        else:
            lane = len(lane_end)
            lane_end.append(r.start_us)
        lanes[i] = lane
        lane_end[lane] = max(lane_end[lane], r.end_us)
    return lanes


def chrome_trace(
    records: Iterable[OpRecord],
    *,
    races: Sequence[RaceReport] = (),
    metadata: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The Trace Event Format dict for records of one or many ranks (keyed by `record.rank`)."""
    records = list(records)
    check_records(records)
    tracks = track_order(records)
    ranks = sorted({r.rank for r in records})

    meta_events: list[dict[str, Any]] = []
    op_events: list[dict[str, Any]] = []
    # (rank, track) -> tid of its first lane, for placing race markers.
    first_tid: dict[tuple[int, str], int] = {}

    for rank in ranks:
        pid = rank + 1
        meta_events.append(_meta("process_name", pid, 0, name=f"rank {rank}"))
        meta_events.append(_meta("process_sort_index", pid, 0, sort_index=pid))
        per_track: dict[str, list[OpRecord]] = {t: [] for t in tracks}
        for r in records:
            if r.rank == rank:
                per_track[track_of(r)].append(r)
        position = 0
        for track in tracks:
            recs = per_track[track]
            if not recs:
                continue
            lanes = _assign_lanes(recs)
            n_lanes = max(lanes) + 1
            tids = [pid * _TID_STRIDE + position + k for k in range(n_lanes)]
            position += n_lanes
            first_tid[(rank, track)] = tids[0]
            for k, tid in enumerate(tids):
                name = track if k == 0 else f"{track} #{k + 1}"
                meta_events.append(_meta("thread_name", pid, tid, name=name))
                meta_events.append(
                    _meta("thread_sort_index", pid, tid, sort_index=tid - pid * _TID_STRIDE)
                )
            for r, lane in zip(recs, lanes):
                op_events.append(
                    {
                        "ph": "X",
                        "name": r.name,
                        "cat": r.kind,
                        "pid": pid,
                        "tid": tids[lane],
                        "ts": float(r.start_us),
                        "dur": float(r.end_us - r.start_us),
                        "args": _op_args(r),
                    }
                )

    # Sorted by time (longest first on ties) so parents precede children for both viewers.
    op_events.sort(key=lambda e: (e["ts"], -e["dur"], e["pid"], e["tid"]))

    trace_end = max((r.end_us for r in records), default=0.0)
    # Earliest record per (op name, ubatch, stream): the anchor for a race's second site.
    anchor: dict[tuple[str, int | None, str], OpRecord] = {}
    for r in sorted(records, key=lambda r: (r.start_us, r.seq)):
        anchor.setdefault((r.name, r.ubatch, r.stream), r)
    race_events: list[dict[str, Any]] = []
    for race in races:
        site = race.second
        match = anchor.get((site.op, site.ubatch, site.stream))
        if match is not None:
            pid, ts = match.rank + 1, float(match.start_us)
            tid = first_tid[(match.rank, track_of(match))]
        else:
            pid, ts = (ranks[0] + 1 if ranks else 1), float(trace_end)
            tid = pid * _TID_STRIDE
        race_events.append(
            {
                "ph": "i",
                "s": "g",
                "name": "race",
                "cat": "race",
                "pid": pid,
                "tid": tid,
                "ts": ts,
                "args": {
                    "description": race.describe(),
                    "storage": f"{race.storage:#x}",
                    "first": _site_args(race.first),
                    "second": _site_args(race.second),
                    "placed_at_matching_op": match is not None,
                },
            }
        )

    other: dict[str, Any] = {"generator": "dbo-sim", "time_unit": "us", "num_races": len(races)}
    if metadata:
        other.update(_json_safe(dict(metadata)))
    return {
        "traceEvents": meta_events + op_events + race_events,
        "displayTimeUnit": "ns",
        "otherData": other,
    }


def merge_traces(
    per_rank_records: Sequence[Sequence[OpRecord]],
    *,
    races: Sequence[RaceReport] = (),
    metadata: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One trace from record lists produced separately (one list per rank's device).

    Ranks come from `record.rank`. A rank found in two lists raises ValueError: it almost always
    means the rank was never set, and overlaying two devices on one process would mislead.
    """
    owner: dict[int, int] = {}
    for i, recs in enumerate(per_rank_records):
        for rank in {r.rank for r in recs}:
            if owner.setdefault(rank, i) != i:
                raise ValueError(
                    f"rank {rank} appears in record lists {owner[rank]} and {i}; "
                    "set OpRecord.rank per device before merging"
                )
    merged = [r for recs in per_rank_records for r in recs]
    return chrome_trace(merged, races=races, metadata=metadata)


def write_chrome_trace(
    path: str | Path,
    records: Iterable[OpRecord],
    *,
    races: Sequence[RaceReport] = (),
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write `chrome_trace(...)` as JSON to `path` (parent folders created); returns the path."""
    path = Path(path)
    trace = chrome_trace(records, races=races, metadata=metadata)
    path.parent.mkdir(parents=True, exist_ok=True)
    # allow_nan=False turns any non-finite number that slipped through into an error here,
    # not a file the viewers refuse to open.
    text = json.dumps(trace, allow_nan=False, separators=(",", ":"))
    path.write_text(text, encoding="utf-8")
    return path
