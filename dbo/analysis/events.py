"""The profiler events the analysis reads, each checked and cut to the fields read.

One job: the reader's `select` (`slim_event`). A kernel, memcpy or memset, a CUDA runtime or
driver call, a CPU op or an annotation is kept as a slim copy of the fields the reports read,
with its times as floats and its thread as an int; metadata events are kept whole when they
have the shape the reports read, and a `dbo-sim` trace's events whole (its own reader checks
them). Flow arrows and every other event are dropped.

An event the reports cannot read raises `MalformedEvent` with its reason, and the reader skips
it and counts it (the report's notes say how many and why) instead of failing on it later:
no `name`, no `ts` or one that is not a finite number within 1e15 us (30 years), a `dur` that
is not a finite number in [0, 1e12] us, a host event without a whole-number `tid`, `args`
that is not an object, a correlation id that is not a whole number.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from dbo.analysis.reader import MalformedEvent

__all__ = [
    "DEVICE_CATS",
    "HOST_CATS",
    "SIM_CATS",
    "MAX_DUR_US",
    "MAX_TIME_US",
    "skipped_note",
    "slim_event",
]

DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
HOST_CATS = frozenset({"cuda_runtime", "cuda_driver", "cpu_op", "user_annotation"})
SIM_CATS = frozenset({"compute", "comm", "sync", "handoff", "graph-launch"})
MAX_TIME_US = 1e15
MAX_DUR_US = 1e12

# The args each kind of profiler event keeps: what the reports read, nothing more (a kernel's
# args carry a dozen fields, a CPU op's its input shapes).
_DEVICE_ARGS = ("correlation", "stream", "grid", "block", "bytes")
_CALL_ARGS = ("correlation",)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _time(event: dict[str, Any], key: str, cat: str, bound: float, low: float) -> float:
    value = event.get(key, 0.0 if key == "dur" else None)
    if value is None:
        raise MalformedEvent(f"{cat}: no {key}")
    if not _is_number(value):
        raise MalformedEvent(f"{cat}: {key} not a number")
    if not (math.isfinite(value) and low <= value <= bound):
        raise MalformedEvent(f"{cat}: {key} not finite or outside [{low:g}, {bound:g}]")
    return float(value)


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _args(event: dict[str, Any], cat: str, keep: tuple[str, ...]) -> dict[str, Any]:
    args = event.get("args", {})
    if not isinstance(args, dict):
        raise MalformedEvent(f"{cat}: args not an object")
    if "correlation" in args and not _whole(args["correlation"]):
        raise MalformedEvent(f"{cat}: correlation id not a whole number")
    slim = {k: args[k] for k in keep if k in args}
    if not isinstance(slim.get("stream", 0), int | str):
        del slim["stream"]  # read as the stream's name: a list or object names nothing
    if "bytes" in slim and not (_is_number(slim["bytes"]) and 0 <= slim["bytes"] < MAX_TIME_US):
        del slim["bytes"]
    return slim


def _profiler_event(event: dict[str, Any], cat: str) -> dict[str, Any]:
    name = event.get("name")
    if not isinstance(name, str) or not name:
        raise MalformedEvent(f"{cat}: no name")
    slim = {
        "ph": event.get("ph", "X") if isinstance(event.get("ph", "X"), str) else "?",
        "cat": cat,
        "name": name,
        "ts": _time(event, "ts", cat, MAX_TIME_US, -MAX_TIME_US),
        "dur": _time(event, "dur", cat, MAX_DUR_US, 0.0),
    }
    tid = event.get("tid")
    if cat in HOST_CATS and not _whole(tid):
        raise MalformedEvent(f"{cat}: tid not a whole number")
    if _whole(tid) or isinstance(tid, str):
        slim["tid"] = tid
    keep = _DEVICE_ARGS if cat in DEVICE_CATS else _CALL_ARGS if cat != "cpu_op" else ()
    slim["args"] = _args(event, cat, keep)
    return slim


def slim_event(event: dict[str, Any]) -> dict[str, Any] | None:
    """The reader's `select`: the events any report reads, profiler events checked and cut
    to the fields read; a dbo-sim trace's events whole; None for the rest. Raises
    `MalformedEvent` for an event the reports read that cannot be read."""
    cat = event.get("cat", "")
    if not isinstance(cat, str):  # kept events are matched against sets of names
        cat = ""
        event = {**event, "cat": cat}
    if cat in SIM_CATS or cat.startswith("range."):
        return event
    if cat in DEVICE_CATS or cat in HOST_CATS:
        return _profiler_event(event, cat)
    if event.get("ph") == "M":
        if not isinstance(event.get("args", {}), dict) or not _whole(event.get("tid", 0)):
            raise MalformedEvent("metadata: args not an object or tid not a whole number")
        return event
    return event if event.get("ph") == "i" else None


def skipped_note(skipped: Counter[str]) -> str | None:
    """The report's note on the events skipped as malformed (None: none were)."""
    if not skipped:
        return None
    reasons = "; ".join(f"{n}x {why}" for why, n in skipped.most_common())
    return f"skipped {sum(skipped.values())} malformed event(s), not analysed: {reasons}"
