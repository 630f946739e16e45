"""What one ubatched step did, runtime-neutrally, and where two runs of it differ.

A `RingTranscript` is the step as the ring's contract sees it, read off the simulated device:
every op the ubatch threads issued with its stream, every event they recorded or waited on
(and on which stream), in issue order, cut into segments where the running ubatch changes
(one ubatch runs at a time, so each cut is a hand-off: a yield). Recv hooks run on the
thread of the ubatch they were registered on, so their ops sit where the hook ran. Events
are named by first use (e0, e1, ...), so two runtimes that make their events in another
order still compare equal when they use them alike.

`diff_transcripts` says, in a line each, where dbo-sim's runtime and vLLM's ran the same
forward differently: `dbo.verify(..., runtime="both")` reports those lines.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from dbo.sim.device import SimDevice
from dbo.sim.records import HANDOFF, SYNC, OpRecord

__all__ = ["EventCall", "RingTranscript", "Segment", "diff_transcripts", "log_event_calls"]


@dataclass(frozen=True)
class EventCall:
    """One event record or stream wait by a ubatch thread, at `position` in the timeline
    (the number of records placed before it)."""

    position: int
    ubatch: int | None
    action: str  # "record" | "wait"
    event: int  # id() of the event object, named e0, e1, ... in a transcript
    stream: str


@contextmanager
def log_event_calls(device: SimDevice) -> Iterator[list[EventCall]]:
    """Log the block's event records and waits on `device` (an observer on this one device
    object: its methods are shadowed for the block and the class's put back after)."""
    calls: list[EventCall] = []
    # Every logged event stays alive until the block ends: a call is named by id(), and a
    # freed event's id can be handed to the next one made (a recv hook's event dies once the
    # hook ran), which would give two events one name, or not, as the threads happened to run.
    held: list[Any] = []
    record, wait = device.record_event, device.stream_wait_event

    def logged_record(event: Any, stream: Any) -> None:
        held.append(event)
        calls.append(_call(device, "record", event, stream))
        record(event, stream)

    def logged_wait(stream: Any, event: Any) -> None:
        held.append(event)
        calls.append(_call(device, "wait", event, stream))
        wait(stream, event)

    device.record_event, device.stream_wait_event = logged_record, logged_wait
    try:
        yield calls
    finally:
        del device.record_event, device.stream_wait_event
        held.clear()


def _call(device: SimDevice, action: str, event: Any, stream: Any) -> EventCall:
    name = getattr(stream, "name", repr(stream))
    return EventCall(len(device.timeline), device.current_ubatch(), action, id(event), name)


@dataclass(frozen=True)
class Segment:
    """What one ubatch did between two hand-offs: ("op", name, stream),
    ("record", event, stream) and ("wait", event, stream) entries in issue order."""

    ubatch: int
    entries: tuple[tuple[str, str, str], ...]


@dataclass
class RingTranscript:
    segments: list[Segment] = field(default_factory=list)

    @classmethod
    def of(cls, records: list[OpRecord], calls: list[EventCall]) -> RingTranscript:
        """The transcript of one step from its timeline and its logged event calls."""
        names: dict[int, str] = {}
        merged: list[tuple[int, int, int, tuple[str, str, str]]] = []
        for call in calls:
            if call.ubatch is None:
                continue  # the launcher's own ordering, outside the ring
            label = names.setdefault(call.event, f"e{len(names)}")
            merged.append((call.position, 0, call.ubatch, (call.action, label, call.stream)))
        for index, record in enumerate(records):
            if record.ubatch is None or record.kind in (HANDOFF, SYNC):
                continue
            merged.append((index, 1, record.ubatch, ("op", record.name, record.stream)))
        merged.sort(key=lambda item: (item[0], item[1]))
        transcript = cls()
        for _, _, ubatch, entry in merged:
            segs = transcript.segments
            if segs and segs[-1].ubatch == ubatch:
                segs[-1] = Segment(ubatch, segs[-1].entries + (entry,))
            else:
                segs.append(Segment(ubatch, (entry,)))
        return transcript


def _entry_text(entry: tuple[str, str, str] | None) -> str:
    if entry is None:
        return "nothing"
    kind, what, stream = entry
    return f"{what} on {stream}" if kind == "op" else f"{kind} {what} on {stream}"


def _segment_diff(k: int, a: Segment, b: Segment, names: tuple[str, str]) -> str | None:
    if a.ubatch != b.ubatch:
        return (
            f"segment {k}: ubatch {a.ubatch} ran under {names[0]}, "
            f"ubatch {b.ubatch} under {names[1]}"
        )
    for j in range(max(len(a.entries), len(b.entries))):
        x = a.entries[j] if j < len(a.entries) else None
        y = b.entries[j] if j < len(b.entries) else None
        if x != y:
            return (
                f"segment {k} (ubatch {a.ubatch}), entry {j}: {names[0]} did "
                f"{_entry_text(x)}, {names[1]} did {_entry_text(y)}"
            )
    return None


def diff_transcripts(
    a: RingTranscript, b: RingTranscript, names: tuple[str, str] = ("dbo", "vllm")
) -> list[str]:
    """One line per difference: the first differing entry of each differing segment (op
    order between yields, stream per op, events recorded and waited), and a differing
    segment count (a hand-off one runtime made and the other did not)."""
    lines = []
    for k, (x, y) in enumerate(zip(a.segments, b.segments)):
        line = _segment_diff(k, x, y, names)
        if line is not None:
            lines.append(line)
    if len(a.segments) != len(b.segments):
        lines.append(
            f"{names[0]} ran {len(a.segments)} segments between hand-offs, "
            f"{names[1]} {len(b.segments)}"
        )
    return lines
