"""The simulated device's faces other than placement: the race checker's feed (an op's
accesses, kernel-less allocations, `Tensor.record_stream`), graph capture's (the graph being
captured, the buffer owners a replay shows its pointers to) and a measurement's (the log's
records, marks to read them from).

Mixins of `SimDevice`, as `dbo.sim.sm_control` is: each names the device state it reads, and
the device builds that state.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from dbo.sim.clock import DeviceClock
from dbo.sim.graph import BufferOwners, SimGraph
from dbo.sim.handles import SimMark
from dbo.sim.log import DeviceLog
from dbo.sim.options import SimOptions
from dbo.sim.races import RaceChecker, RaceReport, user_stack
from dbo.sim.records import EventWait, HostRange, OpRecord
from dbo.sim.state import ThreadState
from dbo.streams import Stream

__all__ = ["CaptureHooks", "CheckerHooks", "LogViews"]


class CheckerHooks:
    """The race checker's feed on a `SimDevice` (all no-ops without a checker)."""

    options: SimOptions
    _lock: threading.RLock
    _checker: RaceChecker | None
    thread_state: Callable[[], ThreadState]
    check_stream: Callable[..., Any]  # Device.check_stream, narrowed to SimStream

    @property
    def race_checker(self) -> RaceChecker | None:
        """The race checker (None with check_races=False or on meta tensors)."""
        return self._checker

    def accesses(self, func: Any, args: tuple, kwargs: dict, out: Any) -> tuple[list, list, list]:
        """(reads, writes, fresh storage keys) of one executed op, as the checker parses
        them; all empty without a checker."""
        if self._checker is None:
            return [], [], []
        with self._lock:
            return self._checker.parse(func, args, kwargs, out)

    def note_allocation(self, tensor: torch.Tensor) -> None:
        """A kernel-less allocation (`empty`) on the calling thread's current stream (the
        comm region's stream inside one): the allocator may hand it freed memory."""
        if self._checker is None or tensor.device.type == "meta":
            return
        state = self.thread_state()
        stream = state.comm.stream if state.comm is not None else state.stream
        stack = user_stack() if self.options.capture_stacks else None
        with self._lock:
            self._checker.allocated(tensor, stream.track, stack)

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        """`Tensor.record_stream` for the simulated device: the caching allocator will not
        hand `tensor`'s memory to a new tensor before the work issued on `stream` up to the
        moment the memory is freed. (torch's own method only accepts CUDA streams.)"""
        track = self.check_stream(stream).track
        if self._checker is not None and tensor.device.type != "meta":
            with self._lock:
                self._checker.record_stream(tensor, track)


class CaptureHooks:
    """Graph capture's side of a `SimDevice`: one graph captured at a time, and the buffer
    owners its replay consults."""

    _lock: threading.RLock
    _graph: SimGraph | None = None  # the graph being captured, if any
    _buffer_owners: BufferOwners

    def graph(self) -> SimGraph:
        """Capture the ops of a step for replay: `with device.graph() as g: ...; g.replay()`."""
        return SimGraph(self)

    @property
    def capturing_graph(self) -> SimGraph | None:
        """The SimGraph being captured, or None."""
        return self._graph

    def begin_capture(self, graph: Any) -> None:
        with self._lock:
            if self._graph is not None:
                raise RuntimeError("a graph is already being captured on this device")
            self._graph = graph

    def end_capture(self, graph: Any) -> None:
        with self._lock:
            if self._graph is graph:
                self._graph = None

    def add_buffer_owner(self, owner: Any) -> None:
        """Register an object with `describe_buffer(data_ptr) -> info | None` (info has
        `label` and `live`), consulted by graph replay's pointer-stability check."""
        self._buffer_owners.add(owner)

    def remove_buffer_owner(self, owner: Any) -> None:
        self._buffer_owners.remove(owner)

    def buffer_owners(self) -> list[Any]:
        """The registered buffer owners (see add_buffer_owner)."""
        return self._buffer_owners.snapshot()


class LogViews:
    """What a measurement reads on a `SimDevice`: its log's records, and marks to read them
    from."""

    log: DeviceLog
    _lock: threading.RLock
    _clock: DeviceClock
    frontier_us: float  # the device's property

    @property
    def timeline(self) -> list[OpRecord]:
        """The ops placed since the last reset, in placement order (`dbo.sim.log`)."""
        return self.log.timeline

    @property
    def races(self) -> list[RaceReport]:
        return self.log.races

    @property
    def event_waits(self) -> list[EventWait]:
        return self.log.event_waits

    @property
    def host_ranges(self) -> list[HostRange]:
        return self.log.host_ranges

    def mark(self) -> SimMark:
        with self._lock:
            return SimMark(len(self.timeline), self._clock.host_us, self._clock.frontier_us)

    def since(self, mark: SimMark) -> list[OpRecord]:
        """The records placed after `mark`."""
        with self._lock:
            return self.timeline[mark.index :]

    def elapsed_us(self, mark: SimMark) -> float:
        """Virtual time from the host at `mark` to the latest work placed since (a step time
        when the caller synchronizes before marking and after the step)."""
        return self.frontier_us - mark.host_us
