"""The simulated GPU: a virtual-time `dbo.streams.Device` (host clock, stream timelines, events).

One host clock per device (only one ubatch thread runs Python at a time, so one is right), one
in-order timeline per stream, plus a link track for low-latency communication in flight. An op
issued on stream S at host time h costs the host its eager issue time (the profile's
`eager_host_us` for the op's kind: launch plus the Python around it; none inside a replayed
graph), then runs from max(h + issue, S.free_at) for its cost (`dbo.sim.cost.op_cost`);
events carry the time of the work recorded before them. Beside times, every timeline keeps a
vector clock (one entry per timeline) so the race checker can tell which accesses are ordered:
an op's epoch is its timeline's entry right after it; event record/wait and host syncs join
clocks as CUDA orders work (a query that returns True is a host sync too; one that returns
False costs the host a driver call, so a polling loop moves the host clock). Ops reach
`place_op` from the dispatch mode (`dbo.sim.intercept`), from `comm_region`, and from graph
replay (`dbo.sim.graph`).

SM sharing (an approximation): a high-throughput comm op holds comm_sms / num_sms of the SMs
for its duration; a compute op placed later whose time span overlaps it progresses at
1 - share (so a fully overlapped op takes cost / (1 - share)). Ops placed before the comm op
was issued are not re-timed, and the comm op itself is never slowed by compute. With
`dbo_gemm_sms` set (SGLang's two-batch overlap caps its GEMM library at the SMs the comm
kernels leave), a ubatch's GEMMs instead always run on that many SMs and are never stretched.

Compute and full-grid kernels (below) take the GPU in turn. A real GPU runs them side by side
when both are ready, and each then progresses slower than alone; with a profile's
`overlap_rates` (measured per kind from DBO traces), an op that waited for the other kind is
charged what running beside it would have cost beyond the turns (`_contention_us`).

Communication regions are costed by `dbo.sim.cost.comm_time_us`; an EP group of one rank
moves no byte over a link, so such a region is costed as its own ops (the gather, the
weighting, the scatter-add), priced like any other op, and placed as full-grid kernels on its
stream that take the GPU in turn with compute, whatever the mode (a local permutation is no
SM-budgeted comm kernel and no transfer); `ht_rdma_share` scales the RDMA part of
multi-node "ht" regions (DeepEP's per-node de-duplication).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from dbo.checks import as_int
from dbo.sim.cost import (
    COMM_MODES,
    GEMM_OPS,
    ROOFLINE,
    OpCost,
    comm_link,
    comm_time_us,
    ep_traffic,
    host_family,
)
from dbo.sim.graph import SimGraph
from dbo.sim.hardware import HardwareProfile, profile_from_name
from dbo.sim.intercept import enter_modes
from dbo.sim.races import RaceChecker, RaceReport, user_stack
from dbo.sim.ranges import device_scope
from dbo.sim.records import (
    COMM,
    COMPUTE,
    GRAPH_LAUNCH,
    HANDOFF,
    SYNC,
    Access,
    EventWait,
    HostRange,
    OpRecord,
)
from dbo.streams import CommHandle, Device, Event, Stream

__all__ = ["SimDevice", "SimMark", "SimStream", "SimEvent"]

VectorClock = list[int]

_GEMMS = GEMM_OPS  # what a GEMM library such as DeepGEMM runs (one list, in dbo.sim.cost)


def _join(into: VectorClock, other: Sequence[int]) -> bool:
    """into = max(into, other) elementwise; True when `into` changed."""
    changed = False
    if len(into) < len(other):
        into.extend([0] * (len(other) - len(into)))
    for i, v in enumerate(other):
        if v > into[i]:
            into[i] = v
            changed = True
    return changed


class _Track:
    """One in-order timeline: a stream, or the link track of low-latency transfers."""

    __slots__ = ("index", "name", "free_at", "vc", "host_gen")

    def __init__(self, index: int, name: str) -> None:
        self.index = index
        self.name = name
        self.free_at = 0.0
        self.vc: VectorClock = [0] * (index + 1)
        self.host_gen = 0  # the host-sync generation already joined into vc

    def reset(self) -> None:
        self.free_at = 0.0
        self.vc = [0] * (self.index + 1)
        self.host_gen = 0


class SimStream(Stream):
    """A stream of the simulated device (a handle on one `_Track`)."""

    def __init__(self, device: SimDevice, track: _Track) -> None:
        self.device = device
        self.name = track.name
        self._track = track

    def wait_event(self, event: Event) -> None:
        self.device._wait_event(self, event)

    def synchronize(self) -> None:
        self.device._sync_stream(self)

    def query(self) -> bool:
        return self.device._poll(self._track.free_at, self._track.vc, f"stream {self.name}")

    @property
    def free_at_us(self) -> float:
        """Virtual time at which the work issued so far on this stream is done."""
        return self._track.free_at


class SimEvent(Event):
    """An event of the simulated device: the time and vector clock of its last record."""

    def __init__(self, device: SimDevice) -> None:
        self.device = device
        self.time_us: float | None = None  # None until recorded
        self.vc: VectorClock = []
        self.stream_name: str | None = None
        self._generation = -1  # device.reset() generation of the last record

    @property
    def recorded(self) -> bool:
        return self.time_us is not None and self._generation == self.device._generation

    def record(self, stream: Stream | None = None) -> None:
        self.device._record_event(self, stream or self.device.current_stream())

    def synchronize(self) -> None:
        self.device._sync_event(self)

    def query(self) -> bool:
        if not self.recorded or self.time_us is None:
            return True
        return self.device._poll(self.time_us, self.vc, f"event on {self.stream_name}")

    def __repr__(self) -> str:
        return f"<SimEvent t={self.time_us} on {self.stream_name!r}>"


@dataclass(frozen=True)
class SimMark:
    """A point of a measurement window: `device.mark()` now, `device.since(mark)` later."""

    index: int  # position in device.timeline
    host_us: float
    frontier_us: float  # latest virtual time of any host or stream work at the mark


@dataclass
class _CommRegion:
    """A `comm_region` block being entered: its ops' accesses accumulate here."""

    kind: str
    nbytes: int
    mode: str
    ep_size: int
    link: str | None
    stream: SimStream
    reads: list[Access]
    writes: list[Access]
    fresh: list[int]  # storages the block allocated
    graph_ops: list[Any]  # (func, args, kwargs, out) of the block while a graph is captured
    op_bytes: int = 0  # bytes read and written by the block's own torch ops
    op_us: float = 0.0  # the block's own ops, priced as ordinary kernels
    op_fallback_us: float = 0.0  # the part of op_us priced by the roofline
    op_names: list[str] = field(default_factory=list)

    def add_op(self, nbytes: int, cost: OpCost, name: str) -> None:
        self.op_bytes += nbytes
        self.op_us += cost.us
        self.op_fallback_us += cost.us if cost.is_fallback else 0.0
        self.op_names.append(name)


class SimDevice(Device):
    """A virtual-time GPU on which ops run eagerly (for their values) and are placed on a
    timeline (for their time)."""

    kind = "sim"

    def __init__(
        self,
        profile: str | HardwareProfile = "h200",
        *,
        rank: int = 0,
        tensor_device: str | torch.device = "cpu",
        check_races: bool = True,
        capture_stacks: bool = True,
        record_timeline: bool = True,
        launch_us: float | None = None,
        handoff_us: float | None = None,
        comm_sms: int | None = None,
        kernel_fixed_us: float | None = None,
        race_action: str = "record",
        dbo_gemm_sms: int | None = None,
        ht_rdma_share: float = 1.0,
    ) -> None:
        base = profile_from_name(profile)
        overrides = {
            k: v
            for k, v in (
                ("launch_us", launch_us),
                ("handoff_us", handoff_us),
                ("comm_sms", comm_sms),
                ("kernel_fixed_us", kernel_fixed_us),
            )
            if v is not None
        }
        self.profile: HardwareProfile = replace(base, **overrides) if overrides else base
        self.rank = int(rank)
        self.torch_device = torch.device(tensor_device)
        if self.torch_device.type not in ("cpu", "meta"):
            raise ValueError(
                f"tensor_device must be 'cpu' (real values) or 'meta' (shapes only), got "
                f"{tensor_device!r}"
            )
        if race_action not in ("record", "raise", "warn"):
            raise ValueError(
                f"race_action must be 'record', 'raise' or 'warn', got {race_action!r}"
            )
        self.record_timeline = record_timeline
        self.capture_stacks = capture_stacks
        self.race_action = race_action
        # SGLang's two-batch overlap caps DeepGEMM at (SMs - DeepEP's SMs) for the whole
        # ubatched prefill step (sglang operations_strategy.py: deep_gemm_num_sms), so its
        # GEMMs never share SMs with the comm kernels, and always run on fewer of them.
        if dbo_gemm_sms is not None and not 0 < dbo_gemm_sms <= self.profile.num_sms:
            raise ValueError(
                f"dbo_gemm_sms must be in (0, {self.profile.num_sms}], got {dbo_gemm_sms!r}"
            )
        self.dbo_gemm_sms = dbo_gemm_sms
        # Of the bytes a multi-node "ht" region sends off-node, the share that crosses RDMA:
        # DeepEP's normal kernels send a token once per destination node and forward it over
        # NVLink there (`dbo.sim.cost.node_dedup_share` derives it from the routing). 1.0: one
        # RDMA copy per expert copy, as the low-latency kernels send.
        if not 0.0 < ht_rdma_share <= 1.0:
            raise ValueError(f"ht_rdma_share must be in (0, 1], got {ht_rdma_share!r}")
        self.ht_rdma_share = float(ht_rdma_share)

        # RLock: event and stream calls nest inside placement paths of the same thread.
        self._lock = threading.RLock()
        self._tls = threading.local()
        self._tracks: list[_Track] = []
        self._streams: dict[str, SimStream] = {}
        self._host_us = 0.0
        self._host_vc: VectorClock = []
        self._host_gen = 0  # bumped whenever a host sync adds ordering
        self._seq = 0
        self._generation = 0
        # High-throughput comm kernels occupying SMs: (start, end, share of SMs).
        self._sm_busy: list[tuple[float, float, float]] = []
        # Latest end of any compute op and of any full-grid local permutation placed: the two
        # take the GPU in turn (see place_op).
        self._compute_end = 0.0
        self._grid_end = 0.0
        self.timeline: list[OpRecord] = []
        self.races: list[RaceReport] = []
        # For the reports only (flow arrows, named host ranges); cleared by reset().
        self.event_waits: list[EventWait] = []
        self.host_ranges: list[HostRange] = []
        self._default = self.Stream("default")
        self._link = self._new_track("link")
        # Race bookkeeping needs real storages; a meta run has none.
        self._checker: RaceChecker | None = None
        if check_races and self.torch_device.type != "meta":
            self._checker = RaceChecker(self, transfer_tracks=(self._link.index,))
        self._graph: Any = None  # the SimGraph being captured, if any
        self._buffer_owners: list[Any] = []

    # ---------------------------------------------------------------------------- factories

    def _new_track(self, name: str) -> _Track:
        track = _Track(len(self._tracks), name)
        self._tracks.append(track)
        return track

    def Stream(self, name: str = "") -> SimStream:
        with self._lock:
            base = name or f"stream-{len(self._tracks)}"
            unique, n = base, 1
            while unique in self._streams or unique in ("link", "host"):
                n += 1
                unique = f"{base}#{n}"
            stream = SimStream(self, self._new_track(unique))
            self._streams[unique] = stream
            return stream

    def Event(self) -> SimEvent:
        return SimEvent(self)

    def default_stream(self) -> SimStream:
        return self._default

    @property
    def streams(self) -> list[SimStream]:
        return list(self._streams.values())

    # --------------------------------------------------------------------- per-thread state

    def thread_state(self) -> threading.local:
        """The calling thread's state: current stream, ubatch stack, interception modes, the
        comm region being entered, replaying/suspended flags (for intercept and graph)."""
        tls = self._tls
        if not hasattr(tls, "stream"):
            tls.stream = self._default
            tls.ubatches = []  # thread_scope stack
            tls.modes = None  # ExitStack of the interception modes while in scope
            tls.comm = None  # the _CommRegion being entered
            tls.replaying = False
            tls.suspended = 0  # >0: ops run without being placed (graph replay, internals)
        return tls

    def current_stream(self) -> SimStream:
        return self.thread_state().stream

    def set_stream(self, stream: Stream) -> None:
        self.thread_state().stream = self.check_stream(stream)

    def current_ubatch(self) -> int | None:
        ubatches = self.thread_state().ubatches
        return ubatches[-1] if ubatches else None

    @contextmanager
    def thread_scope(self, ubatch_id: int | None = None) -> Iterator[None]:
        """Attribute this thread's ops to `ubatch_id` and intercept them (dispatch mode for
        placement, function mode for host reads). Nested scopes only change the attribution."""
        tls = self.thread_state()
        tls.ubatches.append(ubatch_id)
        entered_here = tls.modes is None
        try:
            if entered_here:
                tls.modes = ExitStack()
                tls.modes.enter_context(device_scope(self))
                enter_modes(self, tls.modes)
            yield
        finally:
            if entered_here and tls.modes is not None:
                modes, tls.modes = tls.modes, None
                modes.close()
            tls.ubatches.pop()

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """Run the block's torch ops unplaced (bookkeeping that is no device work)."""
        tls = self.thread_state()
        tls.suspended += 1
        try:
            yield
        finally:
            tls.suspended -= 1

    # ------------------------------------------------------------------------------- clocks

    @property
    def host_time_us(self) -> float:
        return self._host_us

    @property
    def frontier_us(self) -> float:
        """The latest virtual time anything (host or any stream) has reached."""
        with self._lock:
            return max([self._host_us] + [t.free_at for t in self._tracks])

    def mark(self) -> SimMark:
        with self._lock:
            return SimMark(len(self.timeline), self._host_us, self.frontier_us)

    def since(self, mark: SimMark) -> list[OpRecord]:
        """The records placed after `mark`."""
        with self._lock:
            return self.timeline[mark.index :]

    def elapsed_us(self, mark: SimMark) -> float:
        """Virtual time from the host at `mark` to the latest work placed since (a step time
        when the caller synchronizes before marking and after the step)."""
        return self.frontier_us - mark.host_us

    def reset(self) -> None:
        """Start a new measurement: clocks at 0, empty timeline and race list, no history.
        Events recorded before the reset count as never recorded."""
        with self._lock:
            self._host_us = 0.0
            self._host_vc = []
            self._host_gen = 0
            self._seq = 0
            self._generation += 1
            self._sm_busy.clear()
            self._compute_end = self._grid_end = 0.0
            for track in self._tracks:
                track.reset()
            self.timeline = []
            self.races = []
            self.event_waits = []
            self.host_ranges = []
            if self._checker is not None:
                self._checker.clear()

    # ---------------------------------------------------------------------------- placement

    def _append(self, record: OpRecord) -> OpRecord:
        self._seq += 1
        if self.record_timeline:
            self.timeline.append(record)
        return record

    def _join_host(self, track: _Track) -> None:
        # Work launched after a host sync is ordered after what the host waited for.
        if track.host_gen != self._host_gen:
            _join(track.vc, self._host_vc)
            track.host_gen = self._host_gen

    def _stretch(self, start: float, work: float) -> float:
        """End time of `work` us of compute starting at `start` while high-throughput comm
        kernels hold part of the SMs: progress runs at rate 1 - (SM share held by comm)."""
        busy = [b for b in self._sm_busy if b[1] > start]
        if not busy or work <= 0:
            return start + work
        t, remaining = start, work
        cap = self.profile.max_comm_sm_share
        while True:
            share = min(sum(sh for s, e, sh in busy if s <= t < e), cap)
            later = [p for s, e, _ in busy for p in (s, e) if p > t]
            nxt = min(later) if later else math.inf
            rate = 1.0 - share
            if t + remaining / rate <= nxt:
                return t + remaining / rate
            remaining -= (nxt - t) * rate
            t = nxt

    def _contention_us(self, full_grid: bool, waited: float, work: float) -> float:
        """What an op that waited `waited` us for the other kind (compute vs full-grid) to
        finish would have lost by running beside it instead, at the profile's overlap rates.

        Beside each other the waiting op (rate r_own) and the rest of the other kind's work
        (`waited` us, rate r_other) would share the GPU until either finished, i.e. for
        T = min(waited / r_other, work / r_own), doing (r_own + r_other) * T of work in T; all
        the rest runs alone as in turns. The pair therefore ends (1 - r_own - r_other) * T
        later than in turns. The op that waited carries it (the other is placed already and is
        not re-timed); rates that sum to 1 or more cost nothing (turns are kept)."""
        rates = self.profile.overlap_rates
        if not rates or waited <= 0 or work <= 0:
            return 0.0
        own = rates["full_grid" if full_grid else "compute"]
        other = rates["compute" if full_grid else "full_grid"]
        loss = 1.0 - own - other
        if loss <= 0:
            return 0.0
        return loss * min(waited / other, work / own)

    def place_op(
        self,
        name: str,
        cost_us: float,
        *,
        kind: str = COMPUTE,
        stream: SimStream | None = None,
        track: _Track | None = None,
        flops: float = 0.0,
        nbytes: float = 0.0,
        reads: Sequence[Access] = (),
        writes: Sequence[Access] = (),
        fresh: Sequence[int] = (),
        args: dict | None = None,
        launch: bool = True,
        not_before: float = 0.0,
        sm_share: float = 0.0,
        ubatch: Any = "current",
        stack: Any = None,
        host_us: float | None = None,
        full_grid: bool = False,
    ) -> OpRecord:
        """Place one op on a timeline and check its accesses; returns its record.

        `launch` charges the host its eager issue time, `host_us` or the profile's figure for
        the op's kind (skipped while replaying a graph); compute
        ops are stretched by concurrent comm SM occupancy; an op with `sm_share` > 0 holds
        that share of the SMs for its duration; a `full_grid` op (a local permutation, on any
        stream) and compute ops take the whole GPU in turn, in issue order (two full-grid
        kernels on two streams share the SMs: together no faster than one after the other);
        `fresh` storages were just allocated.
        """
        tls = self.thread_state()
        if track is None:
            track = (stream or tls.stream)._track
        if ubatch == "current":
            ubatch = tls.ubatches[-1] if tls.ubatches else None
        replayed = tls.replaying
        with self._lock:
            issue = self._host_us
            if launch and not replayed:
                if host_us is None:
                    host_us = self.profile.eager_host_us(host_family(name))
                self._host_us += host_us
            self._join_host(track)
            track.vc[track.index] += 1
            epoch = track.vc[track.index]
            ready = max(self._host_us, track.free_at, not_before)
            start = ready
            if full_grid:
                start = max(start, self._compute_end)
            elif kind == COMPUTE:
                start = max(start, self._grid_end)
            if (
                kind == COMPUTE
                and self.dbo_gemm_sms is not None
                and ubatch is not None
                and name in _GEMMS
            ):
                # A ubatch's GEMM on its reserved SMs: slower, but untouched by comm kernels.
                cost_us = cost_us * self.profile.num_sms / self.dbo_gemm_sms
                end = start + cost_us
            else:
                end = self._stretch(start, cost_us) if kind == COMPUTE else start + cost_us
            contention = self._contention_us(full_grid, start - ready, cost_us)
            end += contention
            if full_grid:
                self._grid_end = max(self._grid_end, end)
            elif kind == COMPUTE:
                self._compute_end = max(self._compute_end, end)
            track.free_at = end
            if sm_share > 0 and end > start:
                horizon = self._host_us  # no later op can start before the host clock
                self._sm_busy = [b for b in self._sm_busy if b[1] > horizon]
                self._sm_busy.append((start, end, sm_share))
            if args is None:
                args = {}
            stretched = end - contention - start
            if kind == COMPUTE and stretched > cost_us + 1e-9:
                args["sm_slowdown_us"] = stretched - cost_us
            if contention > 0:
                args["overlap_slowdown_us"] = contention
            if args.get("cost") == ROOFLINE:
                args["fallback_us"] = end - start
            record = OpRecord(
                seq=self._seq,
                name=name,
                kind=kind,
                rank=self.rank,
                ubatch=ubatch,
                stream=track.name,
                issue_us=issue,
                start_us=start,
                end_us=end,
                flops=flops,
                bytes=nbytes,
                replayed=replayed,
                args=args,
            )
            self._append(record)
            if self._checker is not None and (reads or writes or fresh):
                if stack is None and self.capture_stacks:
                    stack = user_stack()
                self._checker.on_op(record, track, epoch, reads, writes, stack, fresh)
            return record

    # ------------------------------------------------------------------------ events, syncs

    def _check_event(self, event: Event) -> SimEvent:
        if not isinstance(event, SimEvent) or event.device is not self:
            raise TypeError(f"event must be an Event of {self!r}, got {event!r}")
        return event

    def _record_event(self, event: Event, stream: Stream) -> None:
        event = self._check_event(event)
        stream = self.check_stream(stream)
        self._record_on_track(event, stream._track)  # type: ignore[attr-defined]
        if self._graph is not None and not self.thread_state().replaying:
            self._graph.on_record(event, stream)

    def _record_on_track(self, event: SimEvent, track: _Track) -> None:
        with self._lock:
            self._join_host(track)
            event.time_us = track.free_at
            event.vc = list(track.vc)
            event.stream_name = track.name
            event._generation = self._generation

    def _wait_event(self, stream: SimStream, event: Event) -> None:
        event = self._check_event(event)
        track = self.check_stream(stream)._track  # type: ignore[attr-defined]
        with self._lock:
            if event.recorded:  # as in CUDA, waiting on a never-recorded event is a no-op
                track.free_at = max(track.free_at, event.time_us)  # type: ignore[arg-type]
                _join(track.vc, event.vc)
                self._note_wait(event, track)
        if self._graph is not None and not self.thread_state().replaying:
            self._graph.on_wait(stream, event)

    def _note_wait(self, event: SimEvent, track: _Track) -> None:
        if self.record_timeline:
            self.event_waits.append(
                EventWait(
                    self.rank,
                    self.current_ubatch(),
                    event.stream_name or "?",
                    event.time_us or 0.0,
                    track.name,
                    self._seq,
                )
            )

    def _host_wait(self, until_us: float, vc: Sequence[int], what: str) -> None:
        """The host blocks until `until_us`; what it waited for is ordered before later
        launches. A SYNC record is placed only when the host actually waits."""
        with self._lock:
            if _join(self._host_vc, vc):
                self._host_gen += 1
            if until_us > self._host_us:
                start = self._host_us
                self._host_us = until_us
                tls = self.thread_state()
                self._append(
                    OpRecord(
                        seq=self._seq,
                        name="host-sync",
                        kind=SYNC,
                        rank=self.rank,
                        ubatch=tls.ubatches[-1] if tls.ubatches else None,
                        stream="host",
                        issue_us=start,
                        start_us=start,
                        end_us=until_us,
                        replayed=tls.replaying,
                        args={"on": what},
                    )
                )

    def _sync_stream(self, stream: SimStream, what: str | None = None) -> None:
        track = stream._track
        with self._lock:
            self._host_wait(track.free_at, track.vc, what or f"stream {track.name}")

    def _sync_event(self, event: SimEvent) -> None:
        with self._lock:
            if event.recorded:
                self._host_wait(event.time_us, event.vc, f"event on {event.stream_name}")  # type: ignore[arg-type]

    def _poll(self, done_at_us: float, vc: Sequence[int], what: str) -> bool:
        """A host query of work done at `done_at_us`. True once the host clock has reached
        it, and then, as after a synchronize, later launches are ordered after that work.
        False costs the host one driver call (a launch's worth of host time), so a bare
        polling loop advances the clock and ends."""
        with self._lock:
            if done_at_us <= self._host_us:
                self._host_wait(done_at_us, vc, what)
                return True
            self._host_us += max(self.profile.launch_us, 1e-3)
            return False

    def host_read(self, what: str = "host read") -> None:
        """A host read of device data (.item(), .tolist(), .cpu()): as a CUDA sync, the host
        waits for the calling thread's current stream."""
        stream = self.current_stream()
        self._sync_stream(stream, f"{what} on stream {stream.name}")

    def synchronize(self) -> None:
        with self._lock:
            until = max(t.free_at for t in self._tracks)
            vc: VectorClock = []
            for track in self._tracks:
                _join(vc, track.vc)
            self._host_wait(until, vc, "device")
            if self._checker is not None:
                # Everything issued so far is now ordered before everything issued later.
                self._checker.clear()

    def on_handoff(self) -> None:
        self._host_launch("handoff", self.profile.handoff_us, HANDOFF)

    def _host_launch(self, name: str, cost_us: float, kind: str) -> None:
        """Host-only time (a baton pass, a graph launch), drawn on the host track."""
        with self._lock:
            start = self._host_us
            self._host_us += cost_us
            tls = self.thread_state()
            self._append(
                OpRecord(
                    seq=self._seq,
                    name=name,
                    kind=kind,
                    rank=self.rank,
                    ubatch=tls.ubatches[-1] if tls.ubatches else None,
                    stream="host",
                    issue_us=start,
                    start_us=start,
                    end_us=self._host_us,
                    replayed=tls.replaying,
                )
            )

    # --------------------------------------------------------------------------------- comm

    @contextmanager
    def comm_region(
        self,
        kind: str,
        *,
        nbytes: int,
        mode: str = "ht",
        ep_size: int = 1,
        link: str | None = None,
    ) -> Iterator[CommHandle]:
        """The block is one comm op costed by `comm_time_us`; its torch ops are not placed
        themselves, but their accesses belong to the comm op (see Device.comm_region)."""
        if mode not in COMM_MODES:
            raise ValueError(f"mode must be one of {COMM_MODES}, got {mode!r}")
        nbytes = as_int("nbytes", nbytes)
        ep_size = as_int("ep_size", ep_size, minimum=1)
        comm_link(self.profile, ep_size, link)  # validates `link`
        tls = self.thread_state()
        if tls.comm is not None:
            raise RuntimeError(
                f"comm_region({kind!r}) entered inside comm_region({tls.comm.kind!r}); "
                f"one communication op cannot contain another"
            )
        region = _CommRegion(kind, nbytes, mode, ep_size, link, tls.stream, [], [], [], [])
        handle = CommHandle(kind=kind, nbytes=nbytes, mode=mode, event=self.Event())
        tls.comm = region
        try:
            yield handle
        finally:
            tls.comm = None
        self.place_comm(region, handle.event)  # type: ignore[arg-type]

    def place_comm(self, region: _CommRegion, event: SimEvent) -> None:
        """Place a finished comm region: "ht" as one op on its stream holding SMs; "ll" as a
        send on its stream plus a transfer on the link track, `event` marking arrival."""
        profile = self.profile
        if region.ep_size == 1 and region.link is None and region.op_names:
            self._place_local(region, event)
            return
        nbytes = region.nbytes
        rdma_bytes = None
        if region.mode == "ht" and region.link is None and region.ep_size > profile.gpus_per_node:
            rdma_bytes = (
                ep_traffic(nbytes, region.ep_size, profile.gpus_per_node)[1] * self.ht_rdma_share
            )
        cost = comm_time_us(
            profile, region.kind, nbytes, region.ep_size, region.mode, region.link,
            rdma_bytes=rdma_bytes,
        )  # fmt: skip
        which = comm_link(profile, region.ep_size, region.link)
        args: dict[str, Any] = {"mode": region.mode, "ep_size": region.ep_size, "link": which}
        name = f"comm::{region.kind}"
        # A replayed graph writes the storages it captured: nothing is freshly allocated.
        fresh = () if self.thread_state().replaying else region.fresh
        with self._lock:
            if region.mode == "ht":
                share = profile.comm_sms / profile.num_sms
                args["sm_share"] = share
                self.place_op(
                    name, cost, kind=COMM, stream=region.stream, nbytes=nbytes,
                    reads=region.reads, writes=region.writes, fresh=fresh, args=args,
                    sm_share=share,
                )  # fmt: skip
                self._record_on_track(event, region.stream._track)
            else:
                send = self.place_op(
                    f"{name}.send", profile.ll_send_us, kind=COMM, stream=region.stream,
                    reads=region.reads, fresh=fresh, args=dict(args),
                )  # fmt: skip
                link = self._link
                # The transfer leaves after the send: order it after the sending stream.
                _join(link.vc, region.stream._track.vc)
                self.place_op(
                    name, cost, kind=COMM, track=link, nbytes=nbytes,
                    writes=region.writes, args=args, launch=False, not_before=send.end_us,
                )  # fmt: skip
                self._record_on_track(event, link)
        if self._graph is not None and not self.thread_state().replaying:
            self._graph.on_comm(region, event)

    def _place_local(self, region: _CommRegion, event: SimEvent) -> None:
        """One rank: no byte leaves the GPU. The block's own ops (a gather, a weighting, a
        scatter-add) are the whole cost, issued eagerly like any op, and they are full-grid
        kernels: they take the GPU in turn with compute, in either mode, on their stream."""
        profile = self.profile
        args: dict[str, Any] = {"mode": region.mode, "ep_size": 1, "link": "local"}
        if region.op_fallback_us:
            args["fallback_us"] = region.op_fallback_us
        host = sum(profile.eager_host_us(host_family(n)) for n in region.op_names)
        fresh = () if self.thread_state().replaying else region.fresh
        with self._lock:
            self.place_op(
                f"comm::{region.kind}", region.op_us, kind=COMM, stream=region.stream,
                nbytes=region.op_bytes, reads=region.reads, writes=region.writes, fresh=fresh,
                args=args, host_us=host, full_grid=True,
            )  # fmt: skip
            self._record_on_track(event, region.stream._track)
        if self._graph is not None and not self.thread_state().replaying:
            self._graph.on_comm(region, event)

    # ------------------------------------------------- internals for intercept, graph, checker

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
        tls = self.thread_state()
        stream = tls.comm.stream if tls.comm is not None else tls.stream
        stack = user_stack() if self.capture_stacks else None
        with self._lock:
            self._checker.allocated(tensor, stream._track, stack)

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        """`Tensor.record_stream` for the simulated device: the caching allocator will not
        hand `tensor`'s memory to a new tensor before the work issued on `stream` up to the
        moment the memory is freed. (torch's own method only accepts CUDA streams.)"""
        track = self.check_stream(stream)._track  # type: ignore[attr-defined]
        if self._checker is not None and tensor.device.type != "meta":
            with self._lock:
                self._checker.record_stream(tensor, track)

    @property
    def capturing_graph(self) -> Any:
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

    def buffer_owners(self) -> list[Any]:
        """The registered buffer owners (see add_buffer_owner)."""
        with self._lock:
            return list(self._buffer_owners)

    def launch_graph(self) -> None:
        """Host time of launching a whole replayed graph, drawn on the host track."""
        self._host_launch("graph-launch", self.profile.graph_launch_us, GRAPH_LAUNCH)

    # ---------------------------------------------------------------------- graphs, buffers

    def graph(self) -> Any:
        """Capture the ops of a step for replay: `with device.graph() as g: ...; g.replay()`."""
        return SimGraph(self)

    def add_buffer_owner(self, owner: Any) -> None:
        """Register an object with `describe_buffer(data_ptr) -> info | None` (info has
        `label` and `live`), consulted by graph replay's pointer-stability check."""
        if not callable(getattr(owner, "describe_buffer", None)):
            raise TypeError(f"{owner!r} has no describe_buffer(data_ptr) method")
        with self._lock:
            if not any(o is owner for o in self._buffer_owners):
                self._buffer_owners.append(owner)

    def remove_buffer_owner(self, owner: Any) -> None:
        with self._lock:
            self._buffer_owners = [o for o in self._buffer_owners if o is not owner]

    def __repr__(self) -> str:
        return f"<SimDevice {self.profile.name} rank={self.rank} tensors on {self.torch_device}>"
