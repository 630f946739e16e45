"""Plain records the simulated device produces: one per placed op, and the races it found.

They are the contract between the simulator core (which fills them) and the reports (Chrome
trace, PNG timeline, summary) that read them; neither side needs the other's internals.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Op kinds. "compute" and "comm" run on a stream and take time; "sync" is a host wait (a
# host read, stream/event synchronize) drawn on the host track; "handoff" is a baton pass.
COMPUTE = "compute"
COMM = "comm"
SYNC = "sync"
HANDOFF = "handoff"
# Host time spent launching a whole replayed graph (one launch instead of one per op).
GRAPH_LAUNCH = "graph-launch"


@dataclass(frozen=True, slots=True)
class Access:
    """Bytes [start, end) of one storage, read or written by one op."""

    storage: int  # identity of the storage while it lives (its StorageImpl address)
    start: int
    end: int
    is_write: bool


@dataclass(slots=True)
class OpRecord:
    """One op placed on the virtual timeline. Times are microseconds of virtual time."""

    seq: int  # issue order within the device
    name: str  # "aten::mm", "dbo::ep_dispatch", "host-sync", ...
    kind: str  # COMPUTE | COMM | SYNC | HANDOFF
    rank: int
    ubatch: int | None  # None outside ubatch threads
    stream: str  # stream name ("host" for SYNC/HANDOFF)
    issue_us: float  # host clock when the op was issued
    start_us: float
    end_us: float
    flops: float = 0.0
    bytes: float = 0.0  # bytes read + written (compute) or moved (comm)
    replayed: bool = False  # issued from a replayed graph (no host launch cost)
    args: dict = field(default_factory=dict)  # extra facts for the trace (shapes, sm share...)

    @property
    def dur_us(self) -> float:
        return self.end_us - self.start_us


@dataclass(frozen=True, slots=True)
class OpSite:
    """Where an access in a race came from."""

    op: str
    ubatch: int | None
    stream: str
    start: int
    end: int
    is_write: bool
    stack: tuple[str, ...]  # short user stack, innermost last ("file:line:function")


@dataclass(frozen=True, slots=True)
class RaceReport:
    """Two unordered accesses to overlapping bytes on different streams, one a write."""

    storage: int
    first: OpSite
    second: OpSite

    def describe(self) -> str:
        def site(s: OpSite) -> str:
            rw = "writes" if s.is_write else "reads"
            where = s.stack[-1] if s.stack else "?"
            return (
                f"{s.op} (ubatch {s.ubatch}, stream {s.stream!r}) {rw} bytes "
                f"[{s.start}, {s.end}) at {where}"
            )

        return (
            f"race on storage {self.storage:#x}: {site(self.first)} is not ordered before "
            f"{site(self.second)}"
        )


@dataclass(frozen=True, slots=True)
class EventWait:
    """A stream waited on an event: drawn in the trace as a flow arrow from the op the event
    follows (on `record_stream`) to the first op issued on `wait_stream` after the wait."""

    rank: int
    ubatch: int | None  # the waiting thread's ubatch
    record_stream: str  # where the event was recorded ("link" for a low-latency transfer)
    record_us: float  # the event's time: the end of the work recorded before it
    wait_stream: str
    wait_seq: int  # the seq the next placed op gets: ops with seq >= it follow the wait


@dataclass(frozen=True, slots=True)
class HostRange:
    """A named host-side range (`torch.profiler.record_function`, an NVTX push/pop), drawn on
    the host track of the thread's rank."""

    rank: int
    ubatch: int | None
    name: str
    start_us: float
    end_us: float
    source: str  # "record_function" or "nvtx"
