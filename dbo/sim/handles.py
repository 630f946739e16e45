"""The handles a simulated device gives out: its streams, its events, and measurement marks.

A `SimStream` is a handle on one timeline (`Track`) of its device; a `SimEvent` holds the time
and vector clock of its last record. A handle keeps no clock of its own: each call is fed one
way to its device's `HandleSink` (as torch.cuda's stream and event calls feed the CUDA
sanitizer's `EventHandler` through typed callbacks), and the device, which holds the clocks
and the lock, does the arithmetic and records what graph capture and the traces need.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from dbo.sim.tracks import Track, VectorClock
from dbo.streams import Device, Event, Stream

__all__ = ["HandleSink", "SimEvent", "SimMark", "SimStream"]


class HandleSink(Protocol):
    """Where a handle's calls go: the device side of stream and event calls (`SimDevice`)."""

    @property
    def generation(self) -> int:
        """The device's reset count: an event recorded before the last reset is unrecorded."""

    def record_event(self, event: Event, stream: Stream | None) -> None:
        """`event.record(stream)`; None: the calling thread's current stream."""

    def stream_wait_event(self, stream: Stream, event: Event) -> None: ...

    def sync_stream(self, stream: SimStream, what: str | None = None) -> None: ...

    def sync_event(self, event: SimEvent) -> None: ...

    def poll(self, done_at_us: float, vc: Sequence[int], what: str) -> bool:
        """A host query of work done at `done_at_us` (`query()` of a stream or an event)."""


class SimStream(Stream):
    """A stream of the simulated device (a handle on one `Track`)."""

    def __init__(self, device: Device, sink: HandleSink, track: Track) -> None:
        self.device = device
        self.sink = sink
        self.name = track.name
        self.track = track

    def wait_event(self, event: Event) -> None:
        self.sink.stream_wait_event(self, event)

    def synchronize(self) -> None:
        self.sink.sync_stream(self)

    def query(self) -> bool:
        return self.sink.poll(self.track.free_at, self.track.vc, f"stream {self.name}")

    @property
    def free_at_us(self) -> float:
        """Virtual time at which the work issued so far on this stream is done."""
        return self.track.free_at


class SimEvent(Event):
    """An event of the simulated device: the time and vector clock of its last record."""

    def __init__(self, device: Device, sink: HandleSink) -> None:
        self.device = device
        self.sink = sink
        self.time_us: float | None = None  # None until recorded
        self.vc: VectorClock = []
        self.stream_name: str | None = None
        self.generation = -1  # the device's reset generation at the last record

    @property
    def recorded(self) -> bool:
        return self.time_us is not None and self.generation == self.sink.generation

    def record(self, stream: Stream | None = None) -> None:
        self.sink.record_event(self, stream)

    def synchronize(self) -> None:
        self.sink.sync_event(self)

    def query(self) -> bool:
        if not self.recorded or self.time_us is None:
            return True
        return self.sink.poll(self.time_us, self.vc, f"event on {self.stream_name}")

    def __repr__(self) -> str:
        return f"<SimEvent t={self.time_us} on {self.stream_name!r}>"


@dataclass(frozen=True)
class SimMark:
    """A point of a measurement window: `device.mark()` now, `device.since(mark)` later."""

    index: int  # position in device.timeline
    host_us: float
    frontier_us: float  # latest virtual time of any host or stream work at the mark
