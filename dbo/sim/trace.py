"""Chrome trace: turn `OpRecord`s and `RaceReport`s into Trace Event Format JSON.

The output opens in Perfetto (ui.perfetto.dev) and chrome://tracing: a process per rank (per
run and rank when several runs, a serial and a DBO one, share the trace), a track per stream,
complete events for ops and for named host ranges (record_function, NVTX), flow arrows from an
event's record to each stream that waits on it, instant events for races.

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
  record that matches its second site (op name, ubatch, stream), else at the end of the trace;
  both sites' ops carry the report in `args["races"]`.
- Several runs stack in order: run k's rank r is pid 1 + k * (ranks) + r, named "label · rank
  r"; all runs share the time axis (each starts at its device's reset), so a serial step sits
  right above its DBO step.
- A flow arrow starts on the op an event follows (the last op of the recording stream that
  ended by the event's time) and ends on the first op the waiting stream ran after the wait;
  a wait with no such op on either side draws no arrow.
- The build runs in phases, one per kind of event (`_Layout`: placement on lanes, metadata,
  ops, ranges, flows, races), then sorts the complete events by time.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dbo.sim.records import (
    HANDOFF,
    SYNC,
    EventWait,
    HostRange,
    OpRecord,
    OpSite,
    RaceReport,
)
from dbo.sim.summary import check_records
from dbo.sim.window import TraceRun, Window, WindowSpec, layer_starts, windowed

__all__ = [
    "HOST_TRACK",
    "STANDARD_ARGS",
    "TraceRun",
    "Window",
    "WindowSpec",
    "chrome_trace",
    "chrome_trace_runs",
    "layer_starts",
    "merge_traces",
    "race_sites",
    "track_of",
    "track_order",
    "windowed",
    "write_chrome_trace",
    "write_chrome_trace_runs",
]

HOST_TRACK = "host"

# Keys every op event carries in `args`; a record arg with one of these names is kept under
# "record.<name>" rather than silently overwritten.
STANDARD_ARGS = ("rank", "ubatch", "stream", "seq", "flops", "bytes", "issue_us", "replayed")

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
        args[f"record.{key}" if key in STANDARD_ARGS else key] = _json_safe(v)
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


def _assign_lanes(spans: Sequence[tuple[float, float, int]]) -> list[int]:
    """Greedy lane per (start, end, key) span so no two spans on one lane overlap (touching
    is fine); ties in start go by key."""
    order = sorted(range(len(spans)), key=lambda i: (spans[i][0], spans[i][2]))
    lane_end: list[float] = []
    lanes = [0] * len(spans)
    for i in order:
        start, end, _ = spans[i]
        free = (k for k, busy_until in enumerate(lane_end) if start >= busy_until)
        lane = next(free, len(lane_end))
        if lane == len(lane_end):
            lane_end.append(start)
        lanes[i] = lane
        lane_end[lane] = max(lane_end[lane], end)
    return lanes


def chrome_trace(
    records: Iterable[OpRecord],
    *,
    races: Sequence[RaceReport] = (),
    metadata: Mapping[str, Any] | None = None,
    waits: Sequence[EventWait] = (),
    ranges: Sequence[HostRange] = (),
    window: Window | None = None,
) -> dict[str, Any]:
    """The Trace Event Format dict for records of one or many ranks (keyed by `record.rank`).

    `waits` become flow arrows, `ranges` named spans on the host track, `window` keeps only
    what overlaps it."""
    return chrome_trace_runs(
        [TraceRun(None, list(records), races, waits, ranges)], metadata=metadata, window=window
    )


def chrome_trace_runs(
    runs: Sequence[TraceRun],
    *,
    metadata: Mapping[str, Any] | None = None,
    window: Window | None = None,
) -> dict[str, Any]:
    """One trace of several runs (a serial and a DBO run, say), one above the other: each
    (run, rank) is a process, in run order."""
    runs = [windowed(run, window) for run in runs]
    for run in runs:
        check_records(run.records)
    tracks = track_order(r for run in runs for r in run.records)
    stride = max((r.rank for run in runs for r in run.records), default=0) + 1
    events: list[dict[str, Any]] = []
    flows: list[dict[str, Any]] = []
    meta: list[dict[str, Any]] = []
    num_races = 0
    for index, run in enumerate(runs):
        layout = _Layout(run, tracks, pid_base=1 + index * stride)
        meta += layout.meta_events()
        events += layout.op_events()
        events += layout.range_events()
        flows += layout.flow_events(first_id=len(flows) // 2 + 1)
        events += layout.race_events()
        num_races += len(run.races)
    # Sorted by time (longest first on ties) so parents precede children for both viewers.
    ops = sorted(
        (e for e in events if e["ph"] == "X"),
        key=lambda e: (e["ts"], -e["dur"], e["pid"], e["tid"]),
    )
    instants = [e for e in events if e["ph"] != "X"]
    other: dict[str, Any] = {"generator": "dbo-sim", "time_unit": "us", "num_races": num_races}
    if window is not None:
        other["window_us"] = [window.start_us, window.end_us]
    if metadata:
        other.update(_json_safe(dict(metadata)))
    return {
        "traceEvents": meta + ops + flows + instants,
        "displayTimeUnit": "ns",
        "otherData": other,
    }


class _Layout:
    """Where one run's events go: its processes (one per rank), tracks and lanes."""

    def __init__(self, run: TraceRun, tracks: list[str], pid_base: int) -> None:
        self.run = run
        self.records = list(run.records)
        self.label = run.label
        self.pid_base = pid_base
        self.ranks = sorted({r.rank for r in self.records} | {g.rank for g in run.ranges})
        # (rank, track) -> tids of its lanes; record seq -> (pid, tid) where it is drawn.
        self.tids: dict[tuple[int, str], list[int]] = {}
        self.where: dict[tuple[int, int], tuple[int, int]] = {}
        self.lane_of: dict[int, int] = {}
        self._place(tracks)
        self.race_args = self._race_args()

    def pid(self, rank: int) -> int:
        return self.pid_base + rank

    def _place(self, tracks: list[str]) -> None:
        for rank in self.ranks:
            pid = self.pid(rank)
            per_track: dict[str, list[OpRecord]] = {t: [] for t in tracks}
            for r in self.records:
                if r.rank == rank:
                    per_track[track_of(r)].append(r)
            ranges = [(k, g) for k, g in enumerate(self.run.ranges) if g.rank == rank]
            position = 0
            for track in tracks:
                recs = per_track[track]
                spans = [(r.start_us, r.end_us, r.seq) for r in recs]
                if track == HOST_TRACK:
                    # Named ranges share the host track's lanes, so they nest or spill there.
                    spans += [(g.start_us, g.end_us, -1 - k) for k, g in ranges]
                if not spans:
                    continue
                lanes = _assign_lanes(spans)
                n_lanes = max(lanes) + 1
                tids = [pid * _TID_STRIDE + position + k for k in range(n_lanes)]
                position += n_lanes
                self.tids[(rank, track)] = tids
                for (_, _, key), lane in zip(spans, lanes):
                    self.where[(rank, key)] = (pid, tids[lane])

    def meta_events(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for rank in self.ranks:
            pid = self.pid(rank)
            name = f"rank {rank}" if self.label is None else f"{self.label} · rank {rank}"
            out.append(_meta("process_name", pid, 0, name=name))
            out.append(_meta("process_sort_index", pid, 0, sort_index=pid))
        for (rank, track), tids in self.tids.items():
            pid = self.pid(rank)
            for k, tid in enumerate(tids):
                name = track if k == 0 else f"{track} #{k + 1}"
                out.append(_meta("thread_name", pid, tid, name=name))
                out.append(_meta("thread_sort_index", pid, tid, sort_index=tid - pid * _TID_STRIDE))
        return out

    def op_events(self) -> list[dict[str, Any]]:
        out = []
        for r in self.records:
            pid, tid = self.where[(r.rank, r.seq)]
            args = _op_args(r)
            if r.seq in self.race_args:
                args["races"] = self.race_args[r.seq]
            out.append(
                {
                    "ph": "X",
                    "name": r.name,
                    "cat": r.kind,
                    "pid": pid,
                    "tid": tid,
                    "ts": float(r.start_us),
                    "dur": float(r.end_us - r.start_us),
                    "args": args,
                }
            )
        return out

    def range_events(self) -> list[dict[str, Any]]:
        out = []
        for k, g in enumerate(self.run.ranges):
            pid, tid = self.where[(g.rank, -1 - k)]
            out.append(
                {
                    "ph": "X",
                    "name": g.name,
                    "cat": f"range.{g.source}",
                    "pid": pid,
                    "tid": tid,
                    "ts": float(g.start_us),
                    "dur": float(g.end_us - g.start_us),
                    "args": {"rank": g.rank, "ubatch": g.ubatch, "source": g.source},
                }
            )
        return out

    # -- flow arrows: an event's record to its waits ----------------------------------------

    def flow_events(self, first_id: int) -> list[dict[str, Any]]:
        by_track: dict[tuple[int, str], list[OpRecord]] = {}
        for r in sorted(self.records, key=lambda r: r.seq):
            by_track.setdefault((r.rank, r.stream), []).append(r)
        out: list[dict[str, Any]] = []
        for wait in self.run.waits:
            source = _last_before(by_track.get((wait.rank, wait.record_stream), ()), wait)
            target = _first_after(by_track.get((wait.rank, wait.wait_stream), ()), wait.wait_seq)
            if source is None or target is None:
                continue  # nothing drawn before the record or after the wait: no arrow to draw
            flow_id = first_id + len(out) // 2
            common = {"name": "event", "cat": "event-wait", "id": flow_id}
            spid, stid = self.where[(source.rank, source.seq)]
            tpid, ttid = self.where[(target.rank, target.seq)]
            out.append(
                {
                    **common,
                    "ph": "s",
                    "pid": spid,
                    "tid": stid,
                    "ts": float(source.start_us),
                    "args": {"record_stream": wait.record_stream, "record_us": wait.record_us},
                }
            )
            out.append(
                {
                    **common,
                    "ph": "f",
                    "bp": "e",
                    "pid": tpid,
                    "tid": ttid,
                    "ts": float(target.start_us),
                    "args": {"wait_stream": wait.wait_stream, "ubatch": wait.ubatch},
                }
            )
        return out

    # -- races ------------------------------------------------------------------------------

    def _race_args(self) -> dict[int, list[str]]:
        marked: dict[int, list[str]] = {}
        for race in self.run.races:
            for record in race_sites(self.records, race):
                if record is not None:
                    marked.setdefault(record.seq, []).append(race.describe())
        return marked

    def race_events(self) -> list[dict[str, Any]]:
        out = []
        trace_end = max((r.end_us for r in self.records), default=0.0)
        for race in self.run.races:
            _, match = race_sites(self.records, race)
            if match is not None:
                pid, ts = self.pid(match.rank), float(match.start_us)
                tid = self.tids[(match.rank, track_of(match))][0]
            else:
                pid = self.pid(self.ranks[0] if self.ranks else 0)
                ts, tid = float(trace_end), pid * _TID_STRIDE
            out.append(
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
        return out


def race_sites(
    records: Sequence[OpRecord], race: RaceReport
) -> tuple[OpRecord | None, OpRecord | None]:
    """The records of a race's two sites: the earliest match (op, ubatch, stream) of the
    second site, and the latest match of the first that starts no later (a race report
    carries no time, so this is the first place the pair can have met)."""

    def matches(s: OpSite) -> list[OpRecord]:
        return [r for r in records if (r.name, r.ubatch, r.stream) == (s.op, s.ubatch, s.stream)]

    second = min(matches(race.second), key=lambda r: (r.start_us, r.seq), default=None)
    firsts = matches(race.first)
    if second is not None:
        firsts = [r for r in firsts if r.start_us <= second.start_us] or firsts
    first = max(firsts, key=lambda r: (r.start_us, r.seq), default=None)
    return first, second


def _last_before(recs: Sequence[OpRecord], wait: EventWait) -> OpRecord | None:
    """The op an event follows: the last one issued before the wait that ended by its time."""
    best = None
    for r in recs:
        if r.seq >= wait.wait_seq:
            break
        if r.end_us <= wait.record_us + 1e-9:
            best = r
    return best


def _first_after(recs: Sequence[OpRecord], seq: int) -> OpRecord | None:
    for r in recs:
        if r.seq >= seq:
            return r
    return None


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
    waits: Sequence[EventWait] = (),
    ranges: Sequence[HostRange] = (),
    window: Window | None = None,
) -> Path:
    """Write `chrome_trace(...)` as JSON to `path` (parent folders created); returns the path."""
    run = TraceRun(None, list(records), races, waits, ranges)
    return write_chrome_trace_runs(path, [run], metadata=metadata, window=window)


def write_chrome_trace_runs(
    path: str | Path,
    runs: Sequence[TraceRun],
    *,
    metadata: Mapping[str, Any] | None = None,
    window: Window | None = None,
) -> Path:
    """Write `chrome_trace_runs(...)` as JSON to `path`; returns the path."""
    path = Path(path)
    trace = chrome_trace_runs(runs, metadata=metadata, window=window)
    path.parent.mkdir(parents=True, exist_ok=True)
    # allow_nan=False turns any non-finite number that slipped through into an error here,
    # not a file the viewers refuse to open.
    text = json.dumps(trace, allow_nan=False, separators=(",", ":"))
    path.write_text(text, encoding="utf-8")
    return path
