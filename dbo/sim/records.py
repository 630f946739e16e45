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


@dataclass(slots=True)  # not frozen: made for every tensor of every op, so init must be cheap
class Access:
    """The bytes of memory one op reads or writes through one tensor (or several arguments
    that are the same tensor). Addresses are absolute; `dims` () means every byte of
    [start, end), else the bytes start + sum(i_k * stride_k) + [0, run) over (count, stride)
    dims, largest stride first (a strided view's exact footprint)."""

    storage: int  # identity of the storage while it lives (its StorageImpl address)
    start: int
    end: int
    is_write: bool
    dims: tuple[tuple[int, int], ...] = ()
    run: int = 0
    argument: str = ""  # schema argument name(s), "output" for a returned tensor


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
    start: int  # byte range, relative to the start of the racing storage
    end: int
    is_write: bool
    stack: tuple[str, ...]  # short user stack, innermost last ("file:line:function")
    argument: str = ""  # the op's argument(s) the access went through, or "output"
    # The plain switch (no wait) that put the issuing thread on `stream`, when it still stood
    # on one: "dbo_switch_to_comm() at file:line:function" (`dbo.switch_notes`).
    switched_at: str = ""

    def line(self) -> str:
        rw = "writes" if self.is_write else "reads"
        through = f" {self.argument}" if self.argument else ""
        return (
            f"{self.op} (ubatch {self.ubatch}, stream {self.stream!r}) {rw}{through} bytes "
            f"[{self.start}, {self.end})"
        )


@dataclass(frozen=True, slots=True)
class RaceReport:
    """Two unordered accesses to a common byte on different streams, one a write. `str()`
    is the readable report; `describe()` the one-line summary."""

    storage: int
    first: OpSite
    second: OpSite
    allocation: tuple[str, ...] = ()  # where the memory the second access touches was allocated
    # Set when the first access was to an earlier tensor whose freed block the caching
    # allocator handed on: where that tensor was allocated.
    freed_allocation: tuple[str, ...] | None = None

    def describe(self) -> str:
        def site(s: OpSite) -> str:
            return f"{s.line()} at {s.stack[-1] if s.stack else '?'}"

        reuse = " (memory reused after free)" if self.freed_allocation is not None else ""
        origin = f" (origin: {self.second.switched_at})" if self.second.switched_at else ""
        return (
            f"race on storage {self.storage:#x}{reuse}: {site(self.first)} is not ordered "
            f"before {site(self.second)}{origin}"
        )

    def __str__(self) -> str:
        def stack(frames: tuple[str, ...] | None) -> list[str]:
            return [f"    {f}" for f in frames] if frames else ["    (no user frame)"]

        lines = [f"Race on storage {self.storage:#x}:"]
        if self.second.switched_at:
            lines.append(
                f"  Origin: {self.second.switched_at} moved onto stream "
                f"{self.second.stream!r} without a wait (its *_sync twin waits)."
            )
        lines.append(f"  {self.second.line()}")
        lines += stack(self.second.stack)
        lines.append(f"  is not ordered after {self.first.line()}")
        lines += stack(self.first.stack)
        if self.freed_allocation is not None:
            lines += [
                "  The first access was to an earlier tensor, freed while that access was",
                "  pending; the caching allocator handed its memory on. It was allocated at:",
            ]
            lines += stack(self.freed_allocation)
            lines += [
                "  Order the free after the pending work: dbo.record_stream(tensor, stream)",
                "  (the same call on CUDA and the simulated device) or an event wait.",
            ]
        if self.allocation:
            lines.append("  The memory was allocated at:")
            lines += stack(self.allocation)
        else:
            lines.append("  The memory was allocated outside the simulated device's view.")
        return "\n".join(lines)


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
