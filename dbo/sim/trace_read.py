"""Reading back a Chrome trace this package wrote (`dbo.sim.trace`): its runs' ops, named host
ranges and races, for re-drawing a written trace (windowed) or analyzing it as a step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dbo.sim.records import (
    COMM,
    COMPUTE,
    GRAPH_LAUNCH,
    HANDOFF,
    SYNC,
    HostRange,
    OpRecord,
    OpSite,
    RaceReport,
)
from dbo.sim.trace import STANDARD_ARGS
from dbo.sim.window import TraceRun

__all__ = ["runs_from_trace"]

# Op kinds a trace's complete events carry in "cat" (named ranges are "range.<source>").
_OP_KINDS = frozenset({COMPUTE, COMM, SYNC, HANDOFF, GRAPH_LAUNCH})


def runs_from_trace(trace: Mapping[str, Any]) -> list[TraceRun]:
    """The runs a trace written by this module holds, read back (ops, ranges, races), one
    per label in process order: what re-drawing a written trace, windowed, needs."""
    labels: dict[int, str | None] = {}
    for e in trace.get("traceEvents", ()):
        if e.get("ph") == "M" and e.get("name") == "process_name":
            name = str(e["args"]["name"])
            labels[e["pid"]] = name.rsplit(" · rank ", 1)[0] if " · rank " in name else None
    order = list(dict.fromkeys(labels[pid] for pid in sorted(labels)))
    records: dict[str | None, list[OpRecord]] = {label: [] for label in order}
    ranges: dict[str | None, list[HostRange]] = {label: [] for label in order}
    races: dict[str | None, list[RaceReport]] = {label: [] for label in order}
    for e in trace.get("traceEvents", ()):
        label = labels.get(e.get("pid"))
        if label not in records:
            continue
        args = e.get("args", {})
        if e["ph"] == "X" and e.get("cat") in _OP_KINDS:
            records[label].append(_record_from_event(e))
        elif e["ph"] == "X" and str(e.get("cat", "")).startswith("range."):
            ranges[label].append(
                HostRange(
                    args["rank"],
                    args["ubatch"],
                    e["name"],
                    e["ts"],
                    e["ts"] + e["dur"],
                    args["source"],
                )
            )
        elif e["ph"] == "i" and e.get("cat") == "race":
            races[label].append(
                RaceReport(int(args["storage"], 16), _site(args["first"]), _site(args["second"]))
            )
    return [
        TraceRun(
            label, sorted(records[label], key=lambda r: r.seq), races[label], (), ranges[label]
        )
        for label in order
    ]


def _record_from_event(e: Mapping[str, Any]) -> OpRecord:
    args = dict(e["args"])
    standard = {k: args.pop(k) for k in STANDARD_ARGS}
    extra = {k.removeprefix("record."): v for k, v in args.items() if k != "races"}
    return OpRecord(
        seq=standard["seq"],
        name=e["name"],
        kind=e["cat"],
        rank=standard["rank"],
        ubatch=standard["ubatch"],
        stream=standard["stream"],
        issue_us=standard["issue_us"],
        start_us=e["ts"],
        end_us=e["ts"] + e["dur"],
        flops=standard["flops"],
        bytes=standard["bytes"],
        replayed=standard["replayed"],
        args=extra,
    )


def _site(args: Mapping[str, Any]) -> OpSite:
    start, end = args["byte_range"]
    return OpSite(
        args["op"],
        args["ubatch"],
        args["stream"],
        start,
        end,
        args["is_write"],
        tuple(args["stack"]),
    )
