"""Graph capture and replay on the simulated device, as a CUDA graph would record a step.

`with device.graph() as g:` records, in issue order and from every thread, each placed op
(its op overload, argument and output tensors, stream, ubatch and cost), every event record
and wait, and every comm region. The graph keeps strong references to those tensors, as a
CUDA graph's private pool keeps its memory. `g.replay()` re-executes the recorded ops on the
recorded tensors (values recomputed from their current contents; a fresh output is copied into
the tensor captured as that op's output, so later ops read it) and places them again on the
same streams with the same event dependencies, with no per-op host launch cost: the host pays
one `graph_launch_us`. The recorded items (`SimGraph.items`: `GraphOp`, `GraphEventRecord`,
`GraphEventWait`, `GraphComm`) are public records, for tools that re-execute a captured step
in another order or replay it per rank.

Before replaying, every recorded data pointer is shown to the device's buffer owners
(`device.add_buffer_owner`): a pointer an owner no longer calls live (a workspace slot that
grew and was replaced) raises `GraphReplayError` naming the buffer and the op.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from dbo.sim.calls import CapturedCall, OpModes, rerun_op
from dbo.sim.cost import OpCall
from dbo.sim.handles import SimEvent, SimStream
from dbo.sim.records import Access, OpRecord
from dbo.sim.state import CommRegion, PlannedOp, SimDeviceProtocol
from dbo.streams import GraphCapture

__all__ = [
    "rerun_op",
    "BufferOwners",
    "SimGraph",
    "GraphReplayError",
    "GraphItem",
    "GraphOp",
    "GraphEventRecord",
    "GraphEventWait",
    "GraphComm",
]


class GraphReplayError(RuntimeError):
    """A captured graph refers to memory that is no longer the live buffer."""


@dataclass
class GraphOp:
    """One captured kernel: the op overload and the very tensors it ran on (`out` is the
    tensor captured as its output, which a replay writes), where it ran and what it cost.
    `reads`/`writes` are its accesses as the race checker parsed them; `trace_args` the
    record's args (shapes, dtype, cost source, slowdowns) at capture; `modes` the autograd
    modes it ran under, which a re-execution restores."""

    func: Any
    args: tuple
    kwargs: dict
    out: Any
    name: str
    stream: SimStream
    ubatch: int | None
    cost_us: float
    flops: float
    nbytes: float
    reads: list[Access]
    writes: list[Access]
    trace_args: dict
    modes: OpModes

    def planned(self) -> PlannedOp:
        """The op as a replay places it again: on its stream, for its ubatch, with the trace
        args of its capture."""
        return PlannedOp(
            self.name,
            self.cost_us,
            track=self.stream.track,
            flops=self.flops,
            nbytes=self.nbytes,
            reads=self.reads,
            writes=self.writes,
            args=dict(self.trace_args),
            ubatch=self.ubatch,
        )


@dataclass
class GraphEventRecord:
    """A captured `event.record(stream)`."""

    event: SimEvent
    stream: SimStream


@dataclass
class GraphEventWait:
    """A captured `stream.wait_event(event)`."""

    stream: SimStream
    event: SimEvent


@dataclass
class GraphComm:
    """A captured comm region: the region as it was placed, the event marking its data
    usable, its ubatch, and the torch calls of its block."""

    region: CommRegion
    event: SimEvent
    ubatch: int | None
    ops: list[CapturedCall] = field(default_factory=list)


# What `SimGraph.items` holds, in issue order.
GraphItem = GraphOp | GraphEventRecord | GraphEventWait | GraphComm


def _tensor_list(values: Iterable[Any]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found.extend(w for w in v if isinstance(w, torch.Tensor))
    return found


class BufferOwners:
    """The objects a device's graph replays show their recorded pointers to: each has
    `describe_buffer(data_ptr) -> info | None` (info has `label` and `live`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owners: list[Any] = []

    def add(self, owner: Any) -> None:
        if not callable(getattr(owner, "describe_buffer", None)):
            raise TypeError(f"{owner!r} has no describe_buffer(data_ptr) method")
        with self._lock:
            if not any(o is owner for o in self._owners):
                self._owners.append(owner)

    def remove(self, owner: Any) -> None:
        with self._lock:
            self._owners = [o for o in self._owners if o is not owner]

    def snapshot(self) -> list[Any]:
        with self._lock:
            return list(self._owners)


class SimGraph(GraphCapture):
    """One captured step; a context manager while capturing, then `replay()` at will."""

    def __init__(self, device: SimDeviceProtocol) -> None:
        self.device = device
        self.items: list[GraphItem] = []
        self.notes: list[str] = []  # things a real CUDA graph would refuse (host syncs)
        self.replays = 0
        self._pointers: list[tuple[int, str]] = []  # (data_ptr, which op) checked at replay
        self._capturing = False
        self._captured = False

    # ----------------------------------------------------------------------------- capture

    def __enter__(self) -> SimGraph:
        if self._captured:
            raise RuntimeError("this graph was captured already; make a new one")
        self.device.begin_capture(self)
        self._capturing = self._captured = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self.device.end_capture(self)
        self._capturing = False
        self._pointers = self._collect_pointers()

    def on_op(self, call: OpCall, op: PlannedOp, record: OpRecord) -> None:
        """`call` ran and was placed as `op` (`record`, with its slowdowns at capture)."""
        if record.kind == "compute" and call.func._schema.name.endswith("_local_scalar_dense"):
            self.notes.append(f"host read {record.name} during capture (not replayed as a sync)")
        captured = GraphOp(
            func=call.func,
            args=call.args,
            kwargs=call.kwargs,
            out=call.out,
            name=record.name,
            stream=self.device.current_stream(),
            ubatch=record.ubatch,
            cost_us=op.cost_us,
            flops=record.flops,
            nbytes=record.bytes,
            reads=list(op.reads),
            writes=list(op.writes),
            trace_args=dict(record.args),
            modes=OpModes.current(),  # this thread's: on_op runs where the op ran
        )
        self.items.append(captured)

    def on_record(self, event: SimEvent, stream: SimStream) -> None:
        self.items.append(GraphEventRecord(event, stream))

    def on_wait(self, stream: SimStream, event: SimEvent) -> None:
        self.items.append(GraphEventWait(stream, event))

    def on_comm(self, region: CommRegion, event: SimEvent) -> None:
        self.items.append(
            GraphComm(region, event, self.device.current_ubatch(), list(region.graph_ops))
        )

    @property
    def num_ops(self) -> int:
        return sum(isinstance(i, (GraphOp, GraphComm)) for i in self.items)

    def _collect_pointers(self) -> list[tuple[int, str]]:
        seen: set[int] = set()
        pointers: list[tuple[int, str]] = []

        def add(tensors: list[torch.Tensor], what: str) -> None:
            for t in tensors:
                if t.device.type == "meta":
                    continue
                ptr = t.data_ptr()
                if ptr and ptr not in seen:
                    seen.add(ptr)
                    pointers.append((ptr, what))

        for item in self.items:
            if isinstance(item, GraphOp):
                where = f"{item.name} (ubatch {item.ubatch}, stream {item.stream.name!r})"
                add(_tensor_list((*item.args, *item.kwargs.values(), item.out)), where)
            elif isinstance(item, GraphComm):
                where = (
                    f"comm::{item.region.kind} (ubatch {item.ubatch}, stream "
                    f"{item.region.stream.name!r})"
                )
                for call in item.ops:
                    add(_tensor_list((*call.args, *call.kwargs.values(), call.out)), where)
        return pointers

    # ------------------------------------------------------------------------------ replay

    def check_pointers(self) -> None:
        """Raise GraphReplayError if a buffer owner says a recorded pointer is not live."""
        owners = self.device.buffer_owners()
        if not owners:
            return
        for ptr, where in self._pointers:
            for owner in owners:
                info = owner.describe_buffer(ptr)
                if info is not None and not info.live:
                    raise GraphReplayError(
                        f"graph replay would use {info.label} at {ptr:#x}, which is no longer "
                        f"the live buffer (it was replaced after capture); recorded by {where}. "
                        f"Capture the graph again after the buffer changes, or lock the "
                        f"workspace before capturing."
                    )

    def replay(self) -> None:
        """Re-execute the captured step: values recomputed, ops re-placed without launch cost."""
        self.check_replayable()
        if self._capturing:
            raise RuntimeError("cannot replay a graph while it is being captured")
        self.check_pointers()
        device = self.device
        tls = device.thread_state()
        saved_stream, saved_replaying = tls.stream, tls.replaying
        device.launch_graph()
        tls.replaying = True
        tls.suspended += 1  # values are recomputed here; placement is ours, not the mode's
        try:
            for item in self.items:
                if isinstance(item, GraphOp):
                    rerun_op(item.func, item.args, item.kwargs, item.out, item.modes)
                    device.place_op(item.planned())
                elif isinstance(item, GraphEventRecord):
                    item.event.record(item.stream)
                elif isinstance(item, GraphEventWait):
                    item.stream.wait_event(item.event)
                else:
                    for call in item.ops:
                        call.rerun()
                    tls.ubatches.append(item.ubatch)
                    try:
                        device.place_comm(item.region, item.event)
                    finally:
                        tls.ubatches.pop()
        finally:
            tls.suspended -= 1
            tls.replaying = saved_replaying
            tls.stream = saved_stream
        self.replays += 1
