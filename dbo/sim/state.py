"""The records the simulated device's modules share, and the part of the device they call.

`PlannedOp` is one op to place on a timeline, as issue, comm regions and graph replay plan it;
`CommRegion` is a `comm_region` block being entered; `ThreadState` is one thread's state on
one device (current stream, ubatch attribution, the interception modes, the comm region being
entered, the graph-replay flags, its open host ranges).

`SimDeviceProtocol` is what graph capture (`dbo.sim.graph`) and the interception modes
(`dbo.sim.intercept`) need of a simulated device. They type against it rather than import
`SimDevice`, which imports them: the dependencies in `dbo.sim` point one way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from dbo.sim.calls import CapturedCall, OpModes
from dbo.sim.cost import OpCall, OpCost
from dbo.sim.handles import SimEvent, SimStream
from dbo.sim.ranges import HostRanges
from dbo.sim.records import COMPUTE, Access, OpRecord
from dbo.sim.stacks import Stack
from dbo.sim.tracks import Track

__all__ = ["CURRENT", "CommRegion", "PlannedOp", "SimDeviceProtocol", "ThreadState"]

# The ubatch of the thread that places the op (its innermost `thread_scope`).
CURRENT: Literal["current"] = "current"


@dataclass(slots=True)  # not frozen: made for every op, so init must be cheap
class PlannedOp:
    """One op to place on a timeline (`SimDevice.place_op`): what it costs, where it runs,
    what it holds and touches.

    `launch` charges the host its eager issue time, `host_us` or the profile's figure for the
    op's kind (none while replaying a graph); `sm_share` > 0: the op holds that share of the
    SMs; `full_grid`: it takes the GPU in turn with compute (`dbo.sim.timeline`); `fresh`
    storages were just allocated. `on_link` and `after_send` are a comm region's plan
    (`dbo.sim.regions`), which `SimDevice.place_comm` turns into `track` and `not_before`."""

    name: str
    cost_us: float
    kind: str = COMPUTE
    track: Track | None = None  # None: the thread's current stream
    flops: float = 0.0
    nbytes: float = 0.0
    reads: Sequence[Access] = ()
    writes: Sequence[Access] = ()
    fresh: Sequence[int] = ()
    args: Mapping[str, Any] = field(default_factory=dict)  # what the trace shows; copied
    launch: bool = True
    host_us: float | None = None
    not_before: float = 0.0  # virtual time it cannot start before
    sm_share: float = 0.0
    full_grid: bool = False
    ubatch: int | None | Literal["current"] = CURRENT
    stack: Stack | None = None  # None: captured at placement when the device captures stacks
    on_link: bool = False  # on the link track (a low-latency transfer), not the region's stream
    after_send: bool = False  # leaves once the op before it (its send) has ended

    @property
    def compute(self) -> bool:
        return self.kind == COMPUTE


@dataclass
class CommRegion:
    """A `comm_region` block being entered: its ops' accesses accumulate here, and it is
    placed as one communication op when the block ends (`SimDevice.place_comm`)."""

    kind: str
    nbytes: int
    mode: str
    ep_size: int
    link: str | None
    stream: SimStream
    reads: list[Access]
    writes: list[Access]
    fresh: list[int]  # storages the block allocated
    graph_ops: list[CapturedCall]  # the block's torch calls while a graph is captured
    op_bytes: float = 0.0  # bytes read and written by the block's own torch ops
    op_us: float = 0.0  # the block's own ops, priced as ordinary kernels
    op_fallback_us: float = 0.0  # the part of op_us priced by the roofline
    op_names: list[str] = field(default_factory=list)

    def fold(
        self,
        call: OpCall,
        cost: OpCost,
        reads: Sequence[Access],
        writes: Sequence[Access],
        fresh: Sequence[int],
        *,
        capturing: bool,
    ) -> None:
        """One op of the block: its accesses become the comm op's; its cost counts only for
        an EP group of one, which is these ops (`dbo.sim.regions`)."""
        self.add_op(call.nbytes, cost, call.name)
        self.reads.extend(reads)
        self.writes.extend(writes)
        self.fresh.extend(fresh)
        if capturing:
            modes = OpModes.current()  # fold runs on the thread that ran the op
            self.graph_ops.append(CapturedCall(call.func, call.args, call.kwargs, call.out, modes))

    def add_op(self, nbytes: float, cost: OpCost, name: str) -> None:
        self.op_bytes += nbytes
        self.op_us += cost.us
        self.op_fallback_us += cost.us if cost.is_fallback else 0.0
        self.op_names.append(name)


@dataclass
class ThreadState:
    """One thread's state on one simulated device (`SimDevice.thread_state()`)."""

    stream: SimStream  # the current stream
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

    def current_stream(self) -> SimStream: ...

    def current_ubatch(self) -> int | None: ...

    def issue(self, call: OpCall) -> None:
        """Place (or fold into the thread's comm region) one executed kernel."""

    def note_allocation(self, tensor: torch.Tensor) -> None: ...

    def host_read(self, what: str = "host read") -> None: ...

    def place_op(self, op: PlannedOp) -> OpRecord: ...

    def place_comm(self, region: CommRegion, event: SimEvent) -> None: ...

    def begin_capture(self, graph: Any) -> None: ...

    def end_capture(self, graph: Any) -> None: ...

    def buffer_owners(self) -> list[Any]: ...

    def launch_graph(self) -> None: ...
