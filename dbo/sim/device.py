"""The simulated GPU: a virtual-time `dbo.streams.Device` (host clock, stream timelines, events).

One host clock per device (only one ubatch thread runs Python at a time, so one is right), one
in-order timeline per stream, plus a link track for low-latency communication in flight. An op
issued on stream S at host time h costs the host its eager issue time (the profile's
`eager_host_us` for the op's kind: launch plus the Python around it; none inside a replayed
graph), then runs from max(h + issue, S.free_at) for its cost (`dbo.sim.cost.op_cost`), as
`dbo.sim.timeline` places it (SM sharing with comm kernels, compute and full-grid kernels in
turn); events carry the time of the work recorded before them. Beside times, every timeline
keeps a vector clock (one entry per timeline) so the race checker can tell which accesses are
ordered: an op's epoch is its timeline's entry right after it; event record/wait and host
syncs join clocks as CUDA orders work (a query that returns True is a host sync too; one that
returns False costs the host a driver call, so a polling loop moves the host clock).

`issue` is the one path of an executed kernel (the dispatch mode in `dbo.sim.intercept` hands
it over): its accesses parsed, priced, placed or folded into the thread's comm region, checked
by the race checker, recorded into the graph being captured. `place_op` is the placement
itself, shared with `comm_region` and graph replay (`dbo.sim.graph`).

Communication regions are costed by `dbo.sim.cost.comm_time_us`; an EP group of one rank
moves no byte over a link, so such a region is costed as its own ops (the gather, the
weighting, the scatter-add), priced like any other op, and placed as full-grid kernels on its
stream that take the GPU in turn with compute, whatever the mode (a local permutation is no
SM-budgeted comm kernel and no transfer); `ht_rdma_share` scales the RDMA part of
multi-node "ht" regions (DeepEP's per-node de-duplication).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch

from dbo._checks import as_int
from dbo.sim.clock import DeviceClock
from dbo.sim.cost import (
    COMM_MODES,
    GEMM_OPS,
    ROOFLINE,
    OpCall,
    OpCost,
    comm_link,
    comm_time_us,
    ep_traffic,
    host_family,
    price_op,
)
from dbo.sim.graph import SimGraph
from dbo.sim.hardware import HardwareProfile, profile_from_name
from dbo.sim.intercept import enter_modes
from dbo.sim.races import MAX_REPORTS, RaceChecker, RaceError, RaceReport, user_stack
from dbo.sim.ranges import HostRanges, device_scope
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
from dbo.sim.state import CommRegion, ThreadState, Track, VectorClock, join
from dbo.sim.timeline import slowdown_args
from dbo.streams import CommHandle, Device, Event, Stream

__all__ = ["SimDevice", "SimMark", "SimStream", "SimEvent"]

_GEMMS = GEMM_OPS  # what a GEMM library such as DeepGEMM runs (one list, in dbo.sim.cost)
RACE_ACTIONS = ("record", "raise", "warn")


class SimStream(Stream):
    """A stream of the simulated device (a handle on one `Track`)."""

    def __init__(self, device: SimDevice, track: Track) -> None:
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
        return self.time_us is not None and self._generation == self.device._clock.generation

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


def _profile_with(profile: str | HardwareProfile, **overrides: float | None) -> HardwareProfile:
    """The named (or given) profile with the overrides that are set."""
    base = profile_from_name(profile)
    given = {k: v for k, v in overrides.items() if v is not None}
    return replace(base, **given) if given else base


def _tensor_device(tensor_device: str | torch.device) -> torch.device:
    device = torch.device(tensor_device)
    if device.type not in ("cpu", "meta"):
        raise ValueError(
            f"tensor_device must be 'cpu' (real values) or 'meta' (shapes only), got "
            f"{tensor_device!r}"
        )
    return device


def _check_knobs(
    profile: HardwareProfile, race_action: str, dbo_gemm_sms: int | None, ht_rdma_share: float
) -> None:
    if race_action not in RACE_ACTIONS:
        raise ValueError(f"race_action must be 'record', 'raise' or 'warn', got {race_action!r}")
    if dbo_gemm_sms is not None and not 0 < dbo_gemm_sms <= profile.num_sms:
        raise ValueError(f"dbo_gemm_sms must be in (0, {profile.num_sms}], got {dbo_gemm_sms!r}")
    if not 0.0 < ht_rdma_share <= 1.0:
        raise ValueError(f"ht_rdma_share must be in (0, 1], got {ht_rdma_share!r}")


def _trace_args(call: OpCall, priced: OpCost) -> dict[str, Any]:
    # A nested tensor has no single shape; the trace gets its layout instead.
    shapes = ["nested" if t.is_nested else tuple(t.shape) for t in call.ins]
    return {"shapes": shapes, "dtype": str(call.dtype).replace("torch.", ""), "cost": priced.source}


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
        self.profile: HardwareProfile = _profile_with(
            profile, launch_us=launch_us, handoff_us=handoff_us, comm_sms=comm_sms,
            kernel_fixed_us=kernel_fixed_us,
        )  # fmt: skip
        self.rank = int(rank)
        self.torch_device = _tensor_device(tensor_device)
        _check_knobs(self.profile, race_action, dbo_gemm_sms, ht_rdma_share)
        self.record_timeline = record_timeline
        self.capture_stacks = capture_stacks
        self.race_action = race_action
        # SGLang's two-batch overlap caps DeepGEMM at (SMs - DeepEP's SMs) for the whole
        # ubatched prefill step (sglang operations_strategy.py: deep_gemm_num_sms), so its
        # GEMMs never share SMs with the comm kernels, and always run on fewer of them.
        self.dbo_gemm_sms = dbo_gemm_sms
        # Of the bytes a multi-node "ht" region sends off-node, the share that crosses RDMA:
        # DeepEP's normal kernels send a token once per destination node and forward it over
        # NVLink there (`dbo.sim.cost.node_dedup_share` derives it from the routing). 1.0: one
        # RDMA copy per expert copy, as the low-latency kernels send.
        self.ht_rdma_share = float(ht_rdma_share)
        self._init_timelines()
        # Race bookkeeping needs real storages; a meta run has none.
        self._checker: RaceChecker | None = None
        if check_races and self.torch_device.type != "meta":
            self._checker = RaceChecker(self._on_race, transfer_tracks=(self._link.index,))
        self._graph: SimGraph | None = None  # the graph being captured, if any
        self._buffer_owners: list[Any] = []

    def _init_timelines(self) -> None:
        # RLock: event and stream calls nest inside placement paths of the same thread.
        self._lock = threading.RLock()
        self._tls = threading.local()  # holds each thread's ThreadState
        self._clock = DeviceClock(self.profile, self.dbo_gemm_sms)
        self._streams: dict[str, SimStream] = {}
        self._start_reports()
        self._default = self.Stream("default")
        self._link = self._clock.new_track("link")

    def _start_reports(self) -> None:
        """Nothing placed, nothing reported (a new measurement)."""
        self._seq = 0
        self.timeline: list[OpRecord] = []
        self.races: list[RaceReport] = []
        # For the reports only (flow arrows, named host ranges); cleared by reset().
        self.event_waits: list[EventWait] = []
        self.host_ranges: list[HostRange] = []

    # ---------------------------------------------------------------------------- factories

    def Stream(self, name: str = "") -> SimStream:
        with self._lock:
            base = name or f"stream-{len(self._clock.tracks)}"
            unique, n = base, 1
            while unique in self._streams or unique in ("link", "host"):
                n += 1
                unique = f"{base}#{n}"
            stream = SimStream(self, self._clock.new_track(unique))
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

    def thread_state(self) -> ThreadState:
        """The calling thread's state on this device: current stream, ubatch stack,
        interception modes, the comm region being entered, replaying/suspended flags, open
        host ranges (for intercept and graph)."""
        state = getattr(self._tls, "state", None)
        if state is None:
            ranges = HostRanges(
                lambda: self._clock.host_us, self.current_ubatch, self._on_host_range
            )
            state = self._tls.state = ThreadState(self._default, ranges)
        return state

    def current_stream(self) -> SimStream:
        return self.thread_state().stream  # type: ignore[return-value]

    def set_stream(self, stream: Stream) -> None:
        self.thread_state().stream = self.check_stream(stream)

    def current_ubatch(self) -> int | None:
        return self.thread_state().ubatch

    @contextmanager
    def thread_scope(self, ubatch_id: int | None = None) -> Iterator[None]:
        """Attribute this thread's ops to `ubatch_id` and intercept them (dispatch mode for
        placement, function mode for host reads). Nested scopes only change the attribution."""
        state = self.thread_state()
        state.ubatches.append(ubatch_id)
        entered_here = state.modes is None
        try:
            if entered_here:
                state.modes = ExitStack()
                state.modes.enter_context(device_scope(state.ranges))
                enter_modes(self, state.modes)
            yield
        finally:
            if entered_here and state.modes is not None:
                modes, state.modes = state.modes, None
                modes.close()
            state.ubatches.pop()

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """Run the block's torch ops unplaced (bookkeeping that is no device work)."""
        state = self.thread_state()
        state.suspended += 1
        try:
            yield
        finally:
            state.suspended -= 1

    # ------------------------------------------------------------------------------- clocks

    @property
    def host_time_us(self) -> float:
        return self._clock.host_us

    @property
    def frontier_us(self) -> float:
        """The latest virtual time anything (host or any stream) has reached."""
        with self._lock:
            return self._clock.frontier_us

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

    def reset(self) -> None:
        """Start a new measurement: clocks at 0, empty timeline and race list, no history.
        Events recorded before the reset count as never recorded."""
        with self._lock:
            self._start_reports()
            self._clock.reset()
            if self._checker is not None:
                self._checker.clear()

    # ---------------------------------------------------------------------- the op's path

    def issue(self, call: OpCall) -> None:
        """The one path of an executed kernel: its accesses parsed (by the race checker),
        priced, then placed on the thread's current stream (checked against the race history
        there) or folded into the thread's comm region, and recorded into the graph being
        captured."""
        state = self.thread_state()
        reads, writes, fresh = self.accesses(call.func, call.args, call.kwargs, call.out)
        priced = price_op(call, self.profile)
        graph = None if state.replaying else self._graph
        region = state.comm
        if region is not None:
            region.add_op(call.nbytes, priced, call.name)  # an EP group of one is these ops
            region.reads.extend(reads)
            region.writes.extend(writes)
            region.fresh.extend(fresh)
            if graph is not None:
                region.graph_ops.append((call.func, call.args, call.kwargs, call.out))
            return
        record = self.place_op(
            call.name, priced.us, flops=call.flops, nbytes=call.nbytes, reads=reads,
            writes=writes, fresh=fresh, args=_trace_args(call, priced),
        )  # fmt: skip
        if graph is not None:
            graph.on_op(
                call.func, call.args, call.kwargs, call.out, record, priced.us, reads, writes
            )

    def _on_race(self, report: RaceReport) -> None:
        """The race checker's sink: keep the report, then raise or warn as asked."""
        if len(self.races) >= MAX_REPORTS:
            return
        self.races.append(report)
        if self.race_action == "raise":
            raise RaceError(report)
        if self.race_action == "warn":
            # The checker's frame, as if it warned itself (sink, report, check).
            warnings.warn(report.describe(), RuntimeWarning, stacklevel=4)

    def _on_host_range(
        self, name: str, start_us: float, end_us: float, ubatch: int | None, source: str
    ) -> None:
        """The sink of every thread's closed host ranges."""
        if self.record_timeline:
            self.host_ranges.append(HostRange(self.rank, ubatch, name, start_us, end_us, source))

    # ---------------------------------------------------------------------------- placement

    def _append(self, record: OpRecord) -> OpRecord:
        self._seq += 1
        if self.record_timeline:
            self.timeline.append(record)
        return record

    def place_op(
        self,
        name: str,
        cost_us: float,
        *,
        kind: str = COMPUTE,
        stream: SimStream | None = None,
        track: Track | None = None,
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
        state = self.thread_state()
        if track is None:
            track = (stream or state.stream)._track  # type: ignore[attr-defined]
        if ubatch == "current":
            ubatch = state.ubatch
        replayed = state.replaying
        with self._lock:
            clock = self._clock
            issue = clock.host_us
            if launch and not replayed:
                if host_us is None:
                    host_us = self.profile.eager_host_us(host_family(name))
                clock.host_us += host_us
            epoch = clock.tick(track)
            # A ubatch's GEMM under dbo_gemm_sms runs on its reserved SMs: slower, but
            # untouched by comm kernels.
            reserved = (
                kind == COMPUTE and self.dbo_gemm_sms is not None and ubatch is not None
                and name in _GEMMS
            )  # fmt: skip
            span = clock.place(
                track, cost_us, compute=kind == COMPUTE, full_grid=full_grid,
                reserved=reserved, not_before=not_before, sm_share=sm_share,
            )  # fmt: skip
            args = {} if args is None else args
            args.update(slowdown_args(span, compute=kind == COMPUTE))
            if args.get("cost") == ROOFLINE:
                args["fallback_us"] = span.end - span.start
            record = self._append(
                OpRecord(
                    seq=self._seq,
                    name=name,
                    kind=kind,
                    rank=self.rank,
                    ubatch=ubatch,
                    stream=track.name,
                    issue_us=issue,
                    start_us=span.start,
                    end_us=span.end,
                    flops=flops,
                    bytes=nbytes,
                    replayed=replayed,
                    args=args,
                )  # fmt: skip
            )
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

    def _record_on_track(self, event: SimEvent, track: Track) -> None:
        with self._lock:
            event.time_us, event.vc = self._clock.record(track)
            event.stream_name = track.name
            event._generation = self._clock.generation

    def _wait_event(self, stream: SimStream, event: Event) -> None:
        event = self._check_event(event)
        track = self.check_stream(stream)._track  # type: ignore[attr-defined]
        with self._lock:
            if event.recorded:  # as in CUDA, waiting on a never-recorded event is a no-op
                self._clock.wait(track, event.time_us, event.vc)  # type: ignore[arg-type]
                self._note_wait(event, track)
        if self._graph is not None and not self.thread_state().replaying:
            self._graph.on_wait(stream, event)

    def _note_wait(self, event: SimEvent, track: Track) -> None:
        if self.record_timeline:
            self.event_waits.append(
                EventWait(
                    self.rank,
                    self.current_ubatch(),
                    event.stream_name or "?",
                    event.time_us or 0.0,
                    track.name,
                    self._seq,
                )  # fmt: skip
            )

    def _host_record(self, name: str, kind: str, start: float, end: float, **args: Any) -> None:
        """A host-side record (a sync, a baton pass, a graph launch), drawn on the host track."""
        state = self.thread_state()
        self._append(
            OpRecord(
                seq=self._seq,
                name=name,
                kind=kind,
                rank=self.rank,
                ubatch=state.ubatch,
                stream="host",
                issue_us=start,
                start_us=start,
                end_us=end,
                replayed=state.replaying,
                args=args,
            )  # fmt: skip
        )

    def _host_wait(self, until_us: float, vc: Sequence[int], what: str) -> None:
        """The host blocks until `until_us`; what it waited for is ordered before later
        launches. A SYNC record is placed only when the host actually waits."""
        with self._lock:
            start = self._clock.host_wait(until_us, vc)
            if start is not None:
                self._host_record("host-sync", SYNC, start, until_us, on=what)

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
            if done_at_us <= self._clock.host_us:
                self._host_wait(done_at_us, vc, what)
                return True
            self._clock.host_us += max(self.profile.launch_us, 1e-3)
            return False

    def host_read(self, what: str = "host read") -> None:
        """A host read of device data (.item(), .tolist(), .cpu()): as a CUDA sync, the host
        waits for the calling thread's current stream."""
        stream = self.current_stream()
        self._sync_stream(stream, f"{what} on stream {stream.name}")

    def synchronize(self) -> None:
        with self._lock:
            until, vc = self._clock.all_work()
            self._host_wait(until, vc, "device")
            if self._checker is not None:
                # Everything issued so far is now ordered before everything issued later.
                self._checker.clear()

    def on_handoff(self) -> None:
        self._host_launch("handoff", self.profile.handoff_us, HANDOFF)

    def _host_launch(self, name: str, cost_us: float, kind: str) -> None:
        """Host-only time (a baton pass, a graph launch), drawn on the host track."""
        with self._lock:
            start = self._clock.host_us
            self._clock.host_us += cost_us
            self._host_record(name, kind, start, self._clock.host_us)

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
        state = self.thread_state()
        if state.comm is not None:
            raise RuntimeError(
                f"comm_region({kind!r}) entered inside comm_region({state.comm.kind!r}); "
                f"one communication op cannot contain another"
            )
        region = CommRegion(kind, nbytes, mode, ep_size, link, state.stream, [], [], [], [])
        handle = CommHandle(kind=kind, nbytes=nbytes, mode=mode, event=self.Event())
        state.comm = region
        try:
            yield handle
        finally:
            state.comm = None
        self.place_comm(region, handle.event)  # type: ignore[arg-type]

    def place_comm(self, region: CommRegion, event: SimEvent) -> None:
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
                join(link.vc, region.stream._track.vc)
                self.place_op(
                    name, cost, kind=COMM, track=link, nbytes=nbytes,
                    writes=region.writes, args=args, launch=False, not_before=send.end_us,
                )  # fmt: skip
                self._record_on_track(event, link)
        if self._graph is not None and not self.thread_state().replaying:
            self._graph.on_comm(region, event)

    def _place_local(self, region: CommRegion, event: SimEvent) -> None:
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
        state = self.thread_state()
        stream = state.comm.stream if state.comm is not None else state.stream
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

    def buffer_owners(self) -> list[Any]:
        """The registered buffer owners (see add_buffer_owner)."""
        with self._lock:
            return list(self._buffer_owners)

    def launch_graph(self) -> None:
        """Host time of launching a whole replayed graph, drawn on the host track."""
        self._host_launch("graph-launch", self.profile.graph_launch_us, GRAPH_LAUNCH)

    # ---------------------------------------------------------------------- graphs, buffers

    def graph(self) -> SimGraph:
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
