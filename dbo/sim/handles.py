"""The handles a simulated device gives out: its streams, its events, and measurement marks.

A `SimStream` is a handle on one timeline (`Track`) of its device; a `SimEvent` holds the time
and vector clock of its last record. Their calls are the device's (`SimDeviceHandles`): the
device holds the clocks and the lock, and records what graph capture and the traces need.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from dbo.sim.state import Track, VectorClock
from dbo.streams import Event, Stream

__all__ = ["SimDeviceHandles", "SimEvent", "SimMark", "SimStream"]


class SimDeviceHandles(Protocol):
    """The device side of stream and event calls (`SimDevice` implements it)."""

    @property
    def generation(self) -> int: ...

    def current_stream(self) -> Any: ...

    def stream_wait_event(self, stream: SimStream, event: Event) -> None: ...

    def sync_stream(self, stream: SimStream, what: str | None = None) -> None: ...

    def poll(self, done_at_us: float, vc: Sequence[int], what: str) -> bool: ...

    def record_event(self, event: Event, stream: Stream) -> None: ...

    def sync_event(self, event: SimEvent) -> None: ...


class SimStream(Stream):
    """A stream of the simulated device (a handle on one `Track`)."""

    def __init__(self, device: SimDeviceHandles, track: Track) -> None:
        self.device = device  # type: ignore[assignment]
        self.name = track.name
        self.track = track

    def wait_event(self, event: Event) -> None:
        self.device.stream_wait_event(self, event)  # type: ignore[attr-defined]

    def synchronize(self) -> None:
        self.device.sync_stream(self)  # type: ignore[attr-defined]

    def query(self) -> bool:
        return self.device.poll(self.track.free_at, self.track.vc, f"stream {self.name}")  # type: ignore[attr-defined]

    @property
    def free_at_us(self) -> float:
        """Virtual time at which the work issued so far on this stream is done."""
        return self.track.free_at


class SimEvent(Event):
    """An event of the simulated device: the time and vector clock of its last record."""

    def __init__(self, device: SimDeviceHandles) -> None:
        self.device = device  # type: ignore[assignment]
        self.time_us: float | None = None  # None until recorded
        self.vc: VectorClock = []
        self.stream_name: str | None = None
        self.generation = -1  # the device's reset generation at the last record

    @property
    def recorded(self) -> bool:
        return self.time_us is not None and self.generation == self.device.generation  # type: ignore[attr-defined]

    def record(self, stream: Stream | None = None) -> None:
        self.device.record_event(self, stream or self.device.current_stream())  # type: ignore[attr-defined]

    def synchronize(self) -> None:
        self.device.sync_event(self)  # type: ignore[attr-defined]

    def query(self) -> bool:
        if not self.recorded or self.time_us is None:
            return True
        return self.device.poll(self.time_us, self.vc, f"event on {self.stream_name}")  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"<SimEvent t={self.time_us} on {self.stream_name!r}>"


@dataclass(frozen=True)
class SimMark:
    """A point of a measurement window: `device.mark()` now, `device.since(mark)` later."""

    index: int  # position in device.timeline
    host_us: float
    frontier_us: float  # latest virtual time of any host or stream work at the mark
