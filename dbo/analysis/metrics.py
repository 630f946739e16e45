"""Per-step figures of a normalised trace: busy, overlap, idle gaps, host activity, threads.

One job: reduce one step of a `DeviceTimeline` to numbers. The stream figures are the
simulator's own (`dbo.sim.summary.summarize` over the step's records and window), so a real
step and a simulated one are measured by one definition; this module adds what only a real
trace shows. Definitions (microseconds; "idle" always within the step's window):

- `host_bound_fraction` (the simulator's definition): the share of the step in which no stream
  ran device work. Nothing but the host can leave a whole GPU idle inside a step: it had not
  yet launched the next op, or held back the event the next op waits on.
- `compute_idle_us`: time the compute stream ran nothing, split into `idle_under_comm_us`
  (a comm stream was busy: compute waited on communication, the exposed comm) and the rest,
  the device-idle time above.
- `host_in_idle`: per host thread, what it was doing during the device-idle time: inside a
  launch call (`launch`), a synchronization (`sync`), another runtime call (`runtime`), a
  recorded CPU op or annotation (`cpu_op`), or nothing the profiler recorded (`untraced`:
  Python between ops, or a ubatch thread waiting for the baton). A `ProfilerStep#N` range
  is the profiler's mark, not work: a thread that recorded only that is untraced.
- `both_busy_us`: time the compute stream and another stream both ran device work (the
  intersection of their busy intervals), whatever the kernels' classes.
- `comm_on_compute_us`: communication kernels (by name) that ran on the compute stream.
- Threads: per ubatch thread its launches; hand-offs are switches of the launching thread in
  launch order, and `handoff_us` the median gap across a switch minus the median gap between
  two launches of one thread (the baton pass, as `profile --host-from-trace` derives it).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dbo.analysis.kernels import COMM_CLASS
from dbo.analysis.timeline import DeviceTimeline, HostSpan, Step
from dbo.sim.records import COMM, COMPUTE, OpRecord
from dbo.sim.summary import (
    Interval,
    StepSummary,
    clip_intervals,
    intersect_intervals,
    summarize,
    total_length,
    union_intervals,
)

__all__ = ["ClassTotal", "StepFigures", "ThreadFigures", "step_figures", "subtract_intervals"]

_LAUNCH_CALLS = ("cudaLaunch", "cuLaunch", "cudaMemcpyAsync", "cudaMemsetAsync", "cudaGraphLaunch")
HOST_CATEGORIES = ("launch", "sync", "runtime", "cpu_op", "untraced")


@dataclass
class ClassTotal:
    """Kernels of one class on one stream: how many and their summed duration."""

    count: int = 0
    us: float = 0.0


@dataclass
class ThreadFigures:
    """One launching host thread in one step."""

    label: str  # "ubatch 0", "main"
    tid: int
    launches: int


@dataclass
class StepFigures:
    """The figures of one step (definitions in the module docstring)."""

    label: str
    start_us: float
    end_us: float
    summary: StepSummary
    compute_idle_us: float
    idle_under_comm_us: float
    both_busy_us: float
    comm_on_compute_us: float
    host_in_idle: dict[str, dict[str, float]]
    classes: dict[str, dict[str, ClassTotal]]  # stream -> class -> totals
    threads: list[ThreadFigures] = field(default_factory=list)
    handoffs: int = 0
    handoff_us: float | None = None

    @property
    def step_us(self) -> float:
        return self.summary.step_us

    def to_dict(self) -> dict[str, Any]:
        s = self.summary
        return {
            "label": self.label,
            "start_us": round(self.start_us, 3),
            "step_us": round(s.step_us, 3),
            "busy_us_per_stream": {k: round(v, 3) for k, v in s.busy_us_per_stream.items()},
            "compute_us": round(s.compute_us, 3),
            "comm_us": round(s.comm_us, 3),
            "hidden_comm_us": round(s.hidden_comm_us, 3),
            "overlap_fraction": round(s.overlap_fraction, 4),
            "exposed_comm_us": round(s.exposed_comm_us, 3),
            "host_bound_fraction": round(s.host_bound_fraction, 4),
            "compute_idle_us": round(self.compute_idle_us, 3),
            "idle_under_comm_us": round(self.idle_under_comm_us, 3),
            "both_busy_us": round(self.both_busy_us, 3),
            "comm_on_compute_us": round(self.comm_on_compute_us, 3),
            "host_in_idle": {
                t: {k: round(v, 3) for k, v in cats.items()}
                for t, cats in self.host_in_idle.items()
            },
            "classes": {
                stream: {c: {"count": v.count, "us": round(v.us, 3)} for c, v in cls.items()}
                for stream, cls in self.classes.items()
            },
            "threads": [vars(t) for t in self.threads],
            "handoffs": self.handoffs,
            "handoff_us": None if self.handoff_us is None else round(self.handoff_us, 2),
        }


def subtract_intervals(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """The parts of union `a` outside union `b` (both sorted and disjoint)."""
    out: list[Interval] = []
    j = 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def step_figures(
    timeline: DeviceTimeline, step: Step, window: tuple[float, float] | None = None
) -> StepFigures:
    """The figures of `step`, over `window` (absolute trace microseconds) when given."""
    lo, hi = window if window is not None else (step.start_us, step.end_us)
    records = [r for r in timeline.step_records(step) if r.end_us >= lo and r.start_us <= hi]
    summary = summarize(records, window=(lo, hi))
    device = [r for r in records if r.kind in (COMPUTE, COMM)]
    compute_stream = [(r.start_us, r.end_us) for r in device if r.stream == "compute"]
    others = [(r.start_us, r.end_us) for r in device if r.stream != "compute"]
    compute_busy = union_intervals(clip_intervals(compute_stream, lo, hi))
    other_busy = union_intervals(clip_intervals(others, lo, hi))
    compute_idle = subtract_intervals([(lo, hi)], compute_busy) if hi > lo else []
    under_comm = total_length(intersect_intervals(compute_idle, other_busy))
    device_idle = subtract_intervals(compute_idle, other_busy)
    comm_on_compute = total_length(
        union_intervals(
            clip_intervals(
                [
                    (r.start_us, r.end_us)
                    for r in device
                    if r.stream == "compute" and r.args.get("class") == COMM_CLASS
                ],
                lo,
                hi,
            )
        )
    )
    threads, handoffs, handoff_us = _thread_figures(timeline, device)
    return StepFigures(
        label=step.label,
        start_us=lo,
        end_us=hi,
        summary=summary,
        compute_idle_us=total_length(compute_idle),
        idle_under_comm_us=under_comm,
        both_busy_us=total_length(intersect_intervals(compute_busy, other_busy)),
        comm_on_compute_us=comm_on_compute,
        host_in_idle=_host_in_idle(timeline, device_idle, lo, hi),
        classes=_class_totals(device),
        threads=threads,
        handoffs=handoffs,
        handoff_us=handoff_us,
    )


def _class_totals(device: Sequence[OpRecord]) -> dict[str, dict[str, ClassTotal]]:
    out: dict[str, dict[str, ClassTotal]] = {}
    for r in device:
        total = out.setdefault(r.stream, {}).setdefault(str(r.args.get("class")), ClassTotal())
        total.count += 1
        total.us += r.dur_us
    return out


def thread_label(timeline: DeviceTimeline, tid: int) -> str:
    for t in timeline.threads:
        if t.tid == tid:
            return f"ubatch {t.ubatch}" if t.ubatch is not None else f"thread {tid}"
    return f"thread {tid}"


def _host_category(span: HostSpan) -> str | None:
    if span.cat == "step":
        return None  # the profiler's ProfilerStep#N mark: no work the thread did
    if span.cat == "sync":
        return "sync"
    if span.cat in ("cuda_runtime", "cuda_driver"):
        return "launch" if span.name.startswith(_LAUNCH_CALLS) else "runtime"
    return "cpu_op"  # CPU ops and annotations


def _host_in_idle(
    timeline: DeviceTimeline, idle: Sequence[Interval], lo: float, hi: float
) -> dict[str, dict[str, float]]:
    """Per thread, the device-idle time spent in each host category (first category wins:
    a launch inside a CPU op counts as launch)."""
    if not idle:
        return {}
    spans: dict[int, dict[str, list[Interval]]] = {}
    for h in timeline.host_between(lo, hi):
        by_cat = spans.setdefault(h.thread, {})  # a thread with only a step mark: untraced
        category = _host_category(h)
        if category is not None:
            by_cat.setdefault(category, []).append((h.start_us, h.end_us))
    idle_us = total_length(idle)
    out: dict[str, dict[str, float]] = {}
    for tid, by_cat in spans.items():
        left = list(idle)
        figures: dict[str, float] = {}
        for cat in HOST_CATEGORIES[:-1]:
            if cat in by_cat:
                union = union_intervals(by_cat[cat])
                figures[cat] = total_length(intersect_intervals(left, union))
                left = subtract_intervals(left, union)
        figures["untraced"] = total_length(left)
        if sum(figures.values()) - figures["untraced"] > 0 or idle_us > 0:
            out[thread_label(timeline, tid)] = figures
    return out


def _thread_figures(
    timeline: DeviceTimeline, device: Sequence[OpRecord]
) -> tuple[list[ThreadFigures], int, float | None]:
    ubatch_tids = {t.tid for t in timeline.threads if t.ubatch is not None}
    launches = sorted(
        (r for r in device if "thread" in r.args),
        key=lambda r: r.issue_us,
    )
    counts: dict[int, int] = {}
    for r in launches:
        counts[r.args["thread"]] = counts.get(r.args["thread"], 0) + 1
    threads = [
        ThreadFigures(thread_label(timeline, tid), tid, n)
        for tid, n in sorted(counts.items(), key=lambda kv: thread_label(timeline, kv[0]))
    ]
    if timeline.source == "dbo-sim":  # the ubatch is the thread
        threads = _sim_threads(device)
    ubatch = [r for r in launches if r.args["thread"] in ubatch_tids]
    switch, inner = [], []
    for a, b in itertools.pairwise(ubatch):
        (inner if a.args["thread"] == b.args["thread"] else switch).append(b.issue_us - a.issue_us)
    handoff = statistics.median(switch) - statistics.median(inner) if switch and inner else None
    return threads, len(switch), handoff


def _sim_threads(device: Sequence[OpRecord]) -> list[ThreadFigures]:
    counts: dict[int | None, int] = {}
    for r in device:
        counts[r.ubatch] = counts.get(r.ubatch, 0) + 1
    return [
        ThreadFigures("main" if u is None else f"ubatch {u}", -1 if u is None else u, n)
        for u, n in sorted(counts.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))
    ]
