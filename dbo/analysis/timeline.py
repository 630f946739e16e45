"""A trace's device work and host activity as the simulator's records, split into steps.

One job: normalise what a profiler wrote into one shape that every report reads. Device work
(kernels, memcpys, memsets) becomes `dbo.sim.records.OpRecord`s, the same records the
simulator produces, so the simulator's own summary, PNG timeline and Chrome trace apply to a
real GPU run unchanged; host activity (runtime calls, CPU ops, annotations) becomes
`HostSpan`s. The rules, fixed before looking at any figure:

- Times are microseconds from the trace's first kept event.
- A kernel's launch is the runtime or driver call with its `correlation` id (the earliest if
  both); its thread is the thread that launched it, its `issue_us` the call's start.
- Ubatch threads: the threads that launched device work, each with at least a tenth of the
  busiest one's launches. Two or more are the ubatch threads of a DBO step, numbered in the
  order of their first launch; a single one (a serial step) gives records with no ubatch.
- Streams: the compute stream is the one with the most busy time of non-communication
  kernels. Another stream is a comm stream when it runs a communication kernel, or when no
  stream does (one-GPU expert parallelism: dispatch and combine are local gathers and
  scatter-adds on their own stream); otherwise a side stream. A record's kind is COMM for a
  communication kernel on any stream and for everything on a comm stream, COMPUTE otherwise.
- Steps: `ProfilerStep#N` ranges when the trace has them (a step is the device work launched
  inside one, its window the range widened to that work: the host began the step when the
  range began); else the host's device or stream synchronizations split the trace (a step is
  the device work launched after one and up to the next, its window from its first launch, or
  first device op, to its last device op's end); else the whole trace is one step.
- A trace written by `dbo-sim` itself (otherData.generator "dbo-sim") is read back as the
  simulator wrote it (`dbo.sim.trace_read.runs_from_trace`): one step per run.
"""

from __future__ import annotations

import bisect
import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dbo.analysis.events import DEVICE_CATS, HOST_CATS, skipped_note
from dbo.analysis.kernels import COMM_CLASS, class_of_sim_op, classify_kernel
from dbo.analysis.reader import RawTrace, TraceError
from dbo.sim.records import COMM, COMPUTE, HANDOFF, SYNC, OpRecord

__all__ = [
    "STEP_RANGE",
    "DeviceTimeline",
    "HostSpan",
    "HostThread",
    "Step",
    "build_timeline",
    "split_steps",
]

_SYNC_CALLS = re.compile(r"^(cudaDeviceSynchronize|cudaStreamSynchronize|cuCtxSynchronize)")
STEP_RANGE = re.compile(r"^ProfilerStep#(\d+)$")
_UBATCH_SHARE = 0.1  # a launching thread with fewer launches than this share is not a ubatch's


@dataclass(frozen=True, slots=True)
class HostSpan:
    """A host-side interval on one thread: a runtime call, a CPU op or an annotation."""

    thread: int
    name: str
    cat: str  # "cuda_runtime", "cuda_driver", "cpu_op", "user_annotation", "sync", "step"
    start_us: float
    end_us: float


@dataclass
class HostThread:
    """A host thread that launched device work."""

    tid: int
    name: str
    launches: int
    ubatch: int | None  # its ubatch id, None when the trace has one launching thread
    first_launch_us: float


@dataclass(frozen=True)
class Step:
    """One step: its label, window and the ids of its device ops (`OpRecord.seq`)."""

    index: int
    label: str
    start_us: float
    end_us: float
    seqs: frozenset[int]

    @property
    def step_us(self) -> float:
        return self.end_us - self.start_us


@dataclass
class DeviceTimeline:
    """A trace normalised: device records, host spans, threads, stream roles and steps."""

    source: str  # "torch.profiler" or "dbo-sim"
    device_name: str | None
    records: list[OpRecord]
    host: list[HostSpan]
    threads: list[HostThread]
    streams: dict[str, str]  # trace stream id -> role name ("compute", "comm", ...)
    steps: list[Step]
    total_events: int = 0
    notes: list[str] = field(default_factory=list)
    _host_starts: list[float] | None = field(default=None, repr=False)
    _longest: float = field(default=0.0, repr=False)

    def step_records(self, step: Step) -> list[OpRecord]:
        """The step's records in issue order (a record's seq is its index in `records`)."""
        return [self.records[seq] for seq in sorted(step.seqs)]

    def host_between(self, lo: float, hi: float) -> list[HostSpan]:
        """The host spans that overlap [lo, hi] (`host` is sorted by start)."""
        if self._host_starts is None:
            self._host_starts = [h.start_us for h in self.host]
            self._longest = max((h.end_us - h.start_us for h in self.host), default=0.0)
        first = bisect.bisect_left(self._host_starts, lo - self._longest)
        last = bisect.bisect_right(self._host_starts, hi)
        return [h for h in self.host[first:last] if h.end_us >= lo]


def build_timeline(raw: RawTrace) -> DeviceTimeline:
    """Normalise a read trace (see the module docstring); TraceError when it holds no
    device activity."""
    other = raw.fields.get("otherData")
    if isinstance(other, dict) and other.get("generator") == "dbo-sim":
        return _from_sim(raw)
    device = [e for e in raw.events if e.get("cat") in DEVICE_CATS and e.get("ph", "X") == "X"]
    if not device:
        raise TraceError(
            f"{raw.path}: no GPU activity in this trace (a CPU-only profile?): profile with "
            f"ProfilerActivity.CUDA as well as CPU"
        )
    origin = min(
        float(e["ts"])
        for e in raw.events
        if e.get("cat") in DEVICE_CATS | HOST_CATS and e.get("ph", "X") == "X"
    )
    host = _host_spans(raw.events, origin)
    launches = _launches(raw.events)
    threads = _threads(raw.events, device, launches, origin)
    classes = {name: classify_kernel(name) for name in {str(e["name"]) for e in device}}
    streams = _stream_roles(device, classes)
    records = _records(device, launches, threads, streams, origin, classes)
    steps = _steps(raw.events, records, host, origin)
    note = skipped_note(raw.skipped)
    return DeviceTimeline(
        "torch.profiler",
        _device_name(raw.fields.get("deviceProperties")),
        records,
        host,
        threads,
        streams,
        steps,
        raw.total_events,
        [note] if note else [],
    )


def _device_name(props: object) -> str | None:
    """The first GPU's name in `deviceProperties`, when it has one."""
    first = props[0] if isinstance(props, list) and props else None
    name = first.get("name") if isinstance(first, dict) else None
    return name if isinstance(name, str) else None


# --------------------------------------------------------------------------------------------
# torch.profiler traces


def _host_spans(events: Iterable[dict[str, Any]], origin: float) -> list[HostSpan]:
    out = []
    for e in events:
        cat = e.get("cat")
        if cat not in HOST_CATS or e.get("ph", "X") != "X":
            continue
        start = float(e["ts"]) - origin
        name = str(e.get("name", ""))
        # A ProfilerStep#N range is the profiler's mark, not work the thread did.
        kind = "sync" if _SYNC_CALLS.match(name) else "step" if STEP_RANGE.match(name) else cat
        out.append(HostSpan(int(e["tid"]), str(e["name"]), kind, start, start + e.get("dur", 0)))
    out.sort(key=lambda h: (h.start_us, -h.end_us))
    return out


def _launches(events: Iterable[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """correlation id -> the earliest runtime or driver call carrying it."""
    out: dict[int, dict[str, Any]] = {}
    for e in events:
        if e.get("cat") not in ("cuda_runtime", "cuda_driver"):
            continue
        corr = e.get("args", {}).get("correlation")
        if corr is None:
            continue
        if corr not in out or e["ts"] < out[corr]["ts"]:
            out[corr] = e
    return out


def _threads(
    events: Sequence[dict[str, Any]],
    device: Sequence[dict[str, Any]],
    launches: dict[int, dict[str, Any]],
    origin: float,
) -> list[HostThread]:
    names = {
        e["tid"]: str(e["args"].get("name", ""))
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name" and "args" in e
    }
    counts: Counter[int] = Counter()
    first: dict[int, float] = {}
    for e in device:
        launch = launches.get(e.get("args", {}).get("correlation"))
        if launch is None:
            continue
        tid = int(launch["tid"])
        counts[tid] += 1
        first[tid] = min(first.get(tid, float("inf")), float(launch["ts"]) - origin)
    if not counts:
        return []
    busiest = max(counts.values())
    ubatch_tids = [t for t, n in counts.items() if n >= _UBATCH_SHARE * busiest]
    ubatch_tids.sort(key=lambda t: first[t])
    numbered = len(ubatch_tids) >= 2
    out = [
        HostThread(t, names.get(t, f"thread {t}"), counts[t], k if numbered else None, first[t])
        for k, t in enumerate(ubatch_tids)
    ]
    out += [
        HostThread(t, names.get(t, f"thread {t}"), n, None, first[t])
        for t, n in counts.items()
        if t not in ubatch_tids
    ]
    return out


def _stream_roles(device: Sequence[dict[str, Any]], classes: dict[str, str]) -> dict[str, str]:
    busy: Counter[str] = Counter()
    has_comm: set[str] = set()
    for e in device:
        stream = str(e.get("args", {}).get("stream", e.get("tid")))
        if classes[str(e["name"])] == COMM_CLASS:
            has_comm.add(stream)
        else:
            busy[stream] += float(e.get("dur", 0.0))
    streams = {str(e.get("args", {}).get("stream", e.get("tid"))) for e in device}
    compute = max(streams, key=lambda s: (busy[s], s))
    roles = {compute: "compute"}
    seen: Counter[str] = Counter()
    for s in sorted(streams - {compute}, key=lambda s: -busy[s]):
        role = "comm" if (s in has_comm or not has_comm) else "side"
        seen[role] += 1
        roles[s] = role if seen[role] == 1 else f"{role} #{seen[role]}"
    return roles


def _records(
    device: Sequence[dict[str, Any]],
    launches: dict[int, dict[str, Any]],
    threads: Sequence[HostThread],
    streams: dict[str, str],
    origin: float,
    classes: dict[str, str],
) -> list[OpRecord]:
    ubatch_of = {t.tid: t.ubatch for t in threads}
    out = []
    for seq, e in enumerate(sorted(device, key=lambda e: (e["ts"], e.get("tid", 0)))):
        args = e.get("args", {})
        stream = streams[str(args.get("stream", e.get("tid")))]
        name = str(e["name"])
        cls = classes[name]
        launch = launches.get(args.get("correlation"))
        start = float(e["ts"]) - origin
        issue = float(launch["ts"]) - origin if launch is not None else start
        comm = cls == COMM_CLASS or stream.startswith("comm")
        extra = {"class": cls, "stream_id": args.get("stream"), "kernel": name}
        if launch is not None:
            extra["thread"] = int(launch["tid"])
        for key in ("grid", "block", "bytes"):
            if key in args:
                extra[key] = args[key]
        out.append(
            OpRecord(
                seq=seq,
                name=_short(name),
                kind=COMM if comm else COMPUTE,
                rank=0,
                ubatch=ubatch_of.get(int(launch["tid"])) if launch is not None else None,
                stream=stream,
                issue_us=min(issue, start),
                start_us=start,
                end_us=start + float(e.get("dur", 0.0)),
                bytes=float(args.get("bytes", 0.0) or 0.0),
                args=extra,
            )
        )
    return out


def _short(name: str, limit: int = 60) -> str:
    """A kernel's name without its template arguments and parameter list, for display; a
    mangled C++ name gives its leading nested name (`_ZN7cutlass13device_kernel...` ->
    `cutlass::device_kernel`)."""
    if name.startswith("_ZN"):
        parts, pos = [], 3
        while (m := re.match(r"(\d+)", name[pos:])) is not None:
            n = int(m.group(1))
            start = pos + len(m.group(1))
            parts.append(name[start : start + n])
            pos = start + n
        if parts:
            name = "::".join(parts)
    text = name.removeprefix("void ")
    for stop in ("<", "("):
        cut = text.find(stop)
        if cut > 0:
            text = text[:cut]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _steps(
    events: Sequence[dict[str, Any]],
    records: Sequence[OpRecord],
    host: Sequence[HostSpan],
    origin: float,
) -> list[Step]:
    marks = sorted(
        (float(e["ts"]) - origin, float(e["ts"]) - origin + e.get("dur", 0), int(m.group(1)))
        for e in events
        if e.get("ph") == "X" and (m := STEP_RANGE.match(str(e.get("name", ""))))
    )
    if marks:
        groups = [[r for r in records if lo <= r.issue_us < hi] for lo, hi, _ in marks]
        labels = [f"ProfilerStep#{n}" for *_, n in marks]
        spans: list[tuple[float, float]] = [(lo, hi) for lo, hi, _ in marks]
    else:
        syncs = sorted(h.end_us for h in host if h.cat == "sync")
        groups = _split_at(records, syncs)
        labels = [f"step {k}" for k in range(len(groups))]
        spans = [(float("inf"), float("-inf"))] * len(groups)
    steps = []
    for label, group, (mark_lo, mark_hi) in zip(labels, groups, spans):
        if not group:
            continue
        start = min(mark_lo, *(min(r.issue_us, r.start_us) for r in group))
        end = max(mark_hi, *(r.end_us for r in group))
        steps.append(Step(len(steps), label, start, end, frozenset(r.seq for r in group)))
    return steps


def _split_at(records: Sequence[OpRecord], syncs: Sequence[float]) -> list[list[OpRecord]]:
    """The records in groups launched between consecutive synchronizations."""
    groups: list[list[OpRecord]] = [[] for _ in range(len(syncs) + 1)]
    for r in records:
        groups[bisect.bisect_left(syncs, r.issue_us)].append(r)
    return [g for g in groups if g]


# --------------------------------------------------------------------------------------------
# dbo-sim's own traces


def _from_sim(raw: RawTrace) -> DeviceTimeline:
    from dbo.sim.trace_read import runs_from_trace  # the simulator's own reader of its format

    trace = {"traceEvents": raw.events, "otherData": raw.fields.get("otherData", {})}
    try:
        runs = runs_from_trace(trace)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        # The simulator's reader trusts its own format; a damaged file is refused whole.
        raise TraceError(
            f"{raw.path}: a damaged dbo-sim trace ({type(error).__name__}: {error})"
        ) from None
    records: list[OpRecord] = []
    steps: list[Step] = []
    for run in runs:
        base = len(records)
        own = []
        for r in run.records:
            args = dict(r.args)
            args.setdefault("class", class_of_sim_op(r.name, r.kind))
            own.append(
                OpRecord(
                    base + len(own),
                    r.name,
                    r.kind,
                    r.rank,
                    r.ubatch,
                    r.stream,
                    r.issue_us,
                    r.start_us,
                    r.end_us,
                    r.flops,
                    r.bytes,
                    r.replayed,
                    args,
                )
            )
        records += own
        if not any(r.kind in (COMPUTE, COMM) for r in own):
            continue
        start = min(min(r.issue_us, r.start_us) for r in own)
        end = max(r.end_us for r in own)
        label = run.label or "step 0"
        steps.append(Step(len(steps), label, start, end, frozenset(r.seq for r in own)))
    if not steps:
        raise TraceError(f"{raw.path}: a dbo-sim trace without device ops: nothing to analyze")
    if not all(math.isfinite(r.issue_us + r.start_us + r.end_us) for r in records):
        raise TraceError(f"{raw.path}: a damaged dbo-sim trace (a time that is not finite)")
    threads = _sim_threads(records)
    streams = {s: s for s in dict.fromkeys(r.stream for r in records if r.kind in (COMPUTE, COMM))}
    host = [
        HostSpan(-1 if r.ubatch is None else r.ubatch, r.name, "sync", r.start_us, r.end_us)
        for r in records
        if r.kind in (SYNC, HANDOFF)
    ]
    return DeviceTimeline("dbo-sim", None, records, host, threads, streams, steps, raw.total_events)


def _sim_threads(records: Sequence[OpRecord]) -> list[HostThread]:
    counts: Counter[int | None] = Counter(r.ubatch for r in records if r.kind in (COMPUTE, COMM))
    first: dict[int | None, float] = {}
    for r in records:
        first[r.ubatch] = min(first.get(r.ubatch, float("inf")), r.issue_us)
    return [
        HostThread(-1 if u is None else u, "main" if u is None else f"ubatch {u}", n, u, first[u])
        for u, n in sorted(counts.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))
    ]


def split_steps(timeline: DeviceTimeline, count: int) -> list[Step]:
    """The trace cut into `count` equal steps, for a trace that holds several identical steps
    without marking them: each launching thread's device ops, in launch order, are cut into
    `count` runs of equal length, and step k is every thread's k-th run (ops of no thread go
    with the step whose window holds their start)."""
    device = [r for r in timeline.records if r.kind in (COMPUTE, COMM)]
    if not 1 <= count <= len(device):  # also bounds the lists made below
        raise ValueError(
            f"cannot cut a trace of {len(device)} device op(s) into {count} steps; give 1 to "
            f"{len(device)}"
        )
    by_thread: dict[Any, list[OpRecord]] = {}
    for r in device:
        by_thread.setdefault(r.args.get("thread", r.ubatch), []).append(r)
    groups: list[list[OpRecord]] = [[] for _ in range(count)]
    for recs in by_thread.values():
        recs.sort(key=lambda r: (r.issue_us, r.seq))
        for k, r in enumerate(recs):
            groups[k * count // len(recs)].append(r)
    steps: list[Step] = []
    for k, group in enumerate(groups):
        if group:
            start = min(min(r.issue_us, r.start_us) for r in group)
            end = max(r.end_us for r in group)
            if steps:  # launched while the GPU still ran the step before: starts at its end
                start = min(max(start, steps[-1].end_us), end)
            steps.append(Step(k, f"step {k}", start, end, frozenset(r.seq for r in group)))
    return steps
