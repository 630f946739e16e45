"""The records the simulated device's modules share, and the part of the device they call.

`Track` is one in-order timeline (a stream, or the link track of low-latency transfers) with
its vector clock; `CommRegion` is a `comm_region` block being entered; `ThreadState` is one
thread's state on one device (current stream, ubatch attribution, the interception modes,
the comm region being entered, the graph-replay flags, its open host ranges).

`SimDeviceProtocol` is what graph capture (`dbo.sim.graph`) and the interception modes
(`dbo.sim.intercept`) need of a simulated device. They type against it rather than import
`SimDevice`, which imports them: the dependencies in `dbo.sim` point one way.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from dbo.sim.calls import CapturedCall, OpModes
from dbo.sim.cost import OpCall, OpCost
from dbo.sim.ranges import HostRanges
from dbo.sim.records import Access, OpRecord
from dbo.streams import Event, Stream

__all__ = [
    "VectorClock",
    "join",
    "Track",
    "CommRegion",
    "ThreadState",
    "SimDeviceProtocol",
]

# One entry per timeline of a device: entry i is how much of timeline i is ordered before.
VectorClock = list[int]


def join(into: VectorClock, other: Sequence[int]) -> bool:
    """into = max(into, other) elementwise; True when `into` changed."""
    changed = False
    if len(into) < len(other):
        into.extend([0] * (len(other) - len(into)))
    for i, v in enumerate(other):
        if v > into[i]:
            into[i] = v
            changed = True
    return changed


class Track:
    """One in-order timeline: a stream, or the link track of low-latency transfers.

    `free_at` is when the work issued so far ends; `vc[index]` counts the ops placed here, so
    an op's epoch is that entry right after it; `host_gen` is the host-sync generation already
    joined into `vc` (work launched after a host sync is ordered after what the host waited
    for)."""

    __slots__ = ("index", "name", "free_at", "vc", "host_gen")

    def __init__(self, index: int, name: str) -> None:
        self.index = index
        self.name = name
        self.free_at = 0.0
        self.vc: VectorClock = [0] * (index + 1)
        self.host_gen = 0

    def reset(self) -> None:
        self.free_at = 0.0
        self.vc = [0] * (self.index + 1)
        self.host_gen = 0


@dataclass
class CommRegion:
    """A `comm_region` block being entered: its ops' accesses accumulate here, and it is
    placed as one communication op when the block ends (`SimDevice.place_comm`)."""

    kind: str
    nbytes: int
    mode: str
    ep_size: int
    link: str | None
    stream: Stream  # a SimStream of the device
    reads: list[Access]
    writes: list[Access]
    fresh: list[int]  # storages the block allocated
    graph_ops: list[CapturedCall]  # the block's torch calls while a graph is captured
    op_bytes: int = 0  # bytes read and written by the block's own torch ops
    op_us: float = 0.0  # the block's own ops, priced as ordinary kernels
    op_fallback_us: float = 0.0  # the part of op_us priced by the roofline
    op_names: list[str] = field(default_factory=list)

    def fold(
        self, call: OpCall, cost: OpCost, reads: Sequence[Access], writes: Sequence[Access],
        fresh: Sequence[int], *, capturing: bool,
    ) -> None:  # fmt: skip
        """One op of the block: its accesses become the comm op's; its cost counts only for
        an EP group of one, which is these ops (`dbo.sim.regions`)."""
        self.add_op(call.nbytes, cost, call.name)  # type: ignore[arg-type]
        self.reads.extend(reads)
        self.writes.extend(writes)
        self.fresh.extend(fresh)
        if capturing:
            modes = OpModes.current()  # fold runs on the thread that ran the op
            self.graph_ops.append(CapturedCall(call.func, call.args, call.kwargs, call.out, modes))

    def add_op(self, nbytes: int, cost: OpCost, name: str) -> None:
        self.op_bytes += nbytes
        self.op_us += cost.us
        self.op_fallback_us += cost.us if cost.is_fallback else 0.0
        self.op_names.append(name)


@dataclass
class ThreadState:
    """One thread's state on one simulated device (`SimDevice.thread_state()`)."""

    stream: Stream  # the current stream (a SimStream of the device)
    ranges: HostRanges  # the thread's open named host ranges
    ubatches: list[int | None] = field(default_factory=list)  # thread_scope stack
    modes: ExitStack | None = None  # the interception modes while in scope
    comm: CommRegion | None = None  # the comm region being entered
    replaying: bool = False  # a captured graph is being replayed by this thread
    suspended: int = 0  # >0: ops run without being placed (graph replay, bookkeeping)

    @property
    def ubatch(self) -> int | None:
        """The ubatch the thread's ops are attributed to (the innermost thread_scope's)."""
        return self.ubatches[-1] if self.ubatches else None


class SimDeviceProtocol(Protocol):
    """What graph capture and the interception modes call on a simulated device."""

    def thread_state(self) -> ThreadState: ...

    def current_stream(self) -> Stream: ...

    def current_ubatch(self) -> int | None: ...

    def issue(self, call: OpCall) -> None:
        """Place (or fold into the thread's comm region) one executed kernel."""

    def note_allocation(self, tensor: torch.Tensor) -> None: ...

    def host_read(self, what: str = "host read") -> None: ...

    def place_op(self, name: str, cost_us: float, **options: Any) -> OpRecord: ...

    def place_comm(self, region: CommRegion, event: Event) -> None: ...

    def begin_capture(self, graph: Any) -> None: ...

    def end_capture(self, graph: Any) -> None: ...

    def buffer_owners(self) -> list[Any]: ...

    def launch_graph(self) -> None: ...
