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
itself, shared with `comm_region` and graph replay (`dbo.sim.graph`); comm regions are placed
as `dbo.sim.regions` plans them (one SM-holding op, a send and a transfer, or a one-rank
group's own ops as a full-grid kernel). The records go to a `dbo.sim.record_log.RecordLog`.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from dbo.sim.alltoall import couple_to_peers
from dbo.sim.clock import DeviceClock
from dbo.sim.cost import GEMM_OPS, ROOFLINE, OpCall, OpCost, host_family, price_op
from dbo.sim.graph import BufferOwners, SimGraph
from dbo.sim.handles import SimEvent, SimMark, SimStream
from dbo.sim.hardware import HardwareProfile
from dbo.sim.intercept import enter_modes
from dbo.sim.options import check_knobs, profile_with, tensor_device_of
from dbo.sim.races import MAX_REPORTS, RaceChecker, RaceError, RaceReport, user_stack
from dbo.sim.ranges import HostRanges, device_scope
from dbo.sim.record_log import RecordLog
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
from dbo.sim.regions import open_region, region_ops
from dbo.sim.sm_control import SmControlHooks
from dbo.sim.state import CommRegion, ThreadState, Track, join
from dbo.sim.timeline import slowdown_args
from dbo.streams import CommHandle, Device, Event, Stream

__all__ = ["SimDevice", "SimMark", "SimStream", "SimEvent"]

# The ops that run on the SMs `dbo_gemm_sms` reserves: what a GEMM library such as DeepGEMM
# runs (one list, in dbo.sim.cost).
RESERVED_SM_OPS = GEMM_OPS


def _trace_args(call: OpCall, priced: OpCost) -> dict[str, Any]:
    # A nested tensor has no single shape; the trace gets its layout instead.
    shapes = ["nested" if t.is_nested else tuple(t.shape) for t in call.ins]
    return {"shapes": shapes, "dtype": str(call.dtype).replace("torch.", ""), "cost": priced.source}


class SimDevice(SmControlHooks, Device):
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
        ht_nvl_share: float | None = None,
    ) -> None:
        self.profile: HardwareProfile = profile_with(
            profile, launch_us=launch_us, handoff_us=handoff_us, comm_sms=comm_sms,
            kernel_fixed_us=kernel_fixed_us,
        )  # fmt: skip
        self.rank = int(rank)
        self.torch_device = tensor_device_of(tensor_device)
        check_knobs(self.profile, race_action, dbo_gemm_sms, ht_rdma_share, ht_nvl_share)
        self.record_timeline = record_timeline
        self.capture_stacks = capture_stacks
        self.race_action = race_action
        self.dbo_gemm_sms = dbo_gemm_sms  # see dbo.sim.options.check_knobs
        self.ht_rdma_share, self.ht_nvl_share = float(ht_rdma_share), ht_nvl_share
        self._init_timelines()
        # Race bookkeeping needs real storages; a meta run has none.
        self._checker: RaceChecker | None = None
        if check_races and self.torch_device.type != "meta":
            self._checker = RaceChecker(self._on_race, transfer_tracks=(self._link.index,))
        self._graph: SimGraph | None = None  # the graph being captured, if any
        self._buffer_owners = BufferOwners()

    def _init_timelines(self) -> None:
        # RLock: event and stream calls nest inside placement paths of the same thread.
        self._lock = threading.RLock()
        self._tls = threading.local()  # holds each thread's ThreadState
        self._clock = DeviceClock(self.profile)
        self._streams: dict[str, SimStream] = {}
        self._start_reports()
        self._default = self.Stream("default")
        self._link = self._clock.new_track("link")

    def _start_reports(self) -> None:
        """Nothing placed, nothing reported (a new measurement)."""
        self._seq = 0
        self._records = RecordLog(self.rank, self._lock, keep=self.record_timeline)
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
    def generation(self) -> int:
        """How many times the device was reset: an event recorded before the last reset
        counts as never recorded."""
        return self._clock.generation

    @property
    def host_time_us(self) -> float:
        return self._clock.host_us

    @property
    def frontier_us(self) -> float:
        """The latest virtual time anything (host or any stream) has reached."""
        with self._lock:
            return self._clock.frontier_us

    @property
    def timeline(self) -> list[OpRecord]:
        """Every record since the last reset, in issue order (`dbo.sim.record_log`)."""
        return self._records.read()

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
            region.fold(call, priced, reads, writes, fresh, capturing=graph is not None)
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
            warnings.warn(report.describe(), RuntimeWarning, stacklevel=3)

    def _on_host_range(
        self, name: str, start_us: float, end_us: float, ubatch: int | None, source: str
    ) -> None:
        """The sink of every thread's closed host ranges."""
        if self.record_timeline:
            self.host_ranges.append(HostRange(self.rank, ubatch, name, start_us, end_us, source))

    # ---------------------------------------------------------------------------- placement

    def _append(self, record: OpRecord) -> OpRecord:
        self._seq += 1
        self._records.append(record)
        return record

    def place_op(
        self, name: str, cost_us: float, *, kind: str = COMPUTE, stream: SimStream | None = None,
        track: Track | None = None, flops: float = 0.0, nbytes: float = 0.0,
        reads: Sequence[Access] = (), writes: Sequence[Access] = (), fresh: Sequence[int] = (),
        args: dict | None = None, launch: bool = True, not_before: float = 0.0,
        sm_share: float = 0.0, ubatch: Any = "current", stack: Any = None,
        host_us: float | None = None, full_grid: bool = False,
    ) -> OpRecord:  # fmt: skip
        """Place one op on a timeline and check its accesses; returns its record.

        `launch` charges the host its eager issue time, `host_us` or the profile's figure for
        the op's kind (none while replaying a graph); `sm_share` > 0: the op holds that share
        of the SMs; `full_grid`: it takes the GPU in turn with compute (`dbo.sim.timeline`);
        `fresh` storages were just allocated."""
        state = self.thread_state()
        if track is None:
            track = (stream or state.stream).track  # type: ignore[attr-defined]
        if ubatch == "current":
            ubatch = state.ubatch
        replayed = state.replaying
        compute = kind == COMPUTE
        with self._lock:
            issue = self._clock.host_us
            self._clock.host_us += self._launch_us(name, launch, host_us, replayed)
            epoch = self._clock.tick(track)
            span = self._clock.place(
                track, cost_us, compute=compute, full_grid=full_grid, not_before=not_before,
                reserved_sms=self._reserved_sms(name, compute, ubatch), sm_share=sm_share,
            )  # fmt: skip
            args = {} if args is None else args
            args.update(slowdown_args(span, compute=compute))
            if args.get("cost") == ROOFLINE:
                args["fallback_us"] = span.end - span.start
            record = self._append(OpRecord(
                seq=self._seq, name=name, kind=kind, rank=self.rank, ubatch=ubatch,
                stream=track.name, issue_us=issue, start_us=span.start, end_us=span.end,
                flops=flops, bytes=nbytes, replayed=replayed, args=args,
            ))  # fmt: skip
            if self._checker is not None and (reads or writes or fresh):
                if stack is None and self.capture_stacks:
                    stack = user_stack()
                self._checker.on_op(record, track, epoch, reads, writes, stack, fresh)
            return record

    def _launch_us(self, name: str, launch: bool, host_us: float | None, replayed: bool) -> float:
        """Host time issuing one op costs: its eager issue time, none inside a replayed graph."""
        if not launch or replayed:
            return 0.0
        return self.profile.eager_host_us(host_family(name)) if host_us is None else host_us

    def _coupled_cost(
        self, mode: str, op: Any, track: Track, not_before: float, peers: Any
    ) -> tuple[float, dict[str, Any]]:
        """A comm op coupled to its peers (see `place_comm`): its duration and trace args."""
        launch = self._launch_us(op.name, op.launch, op.host_us, self.thread_state().replaying)
        ready = max(self._clock.host_us + launch, track.free_at, not_before)
        with self.suspended():  # the exchange is bookkeeping, not device work
            end, wait, gate = couple_to_peers(self.profile, mode, ready, peers, self.ht_rdma_share)
        return end - ready, dict(op.args, peer_wait_us=wait, gated_by=gate)

    def _reserved_sms(self, name: str, compute: bool, ubatch: int | None) -> int | None:
        """The SMs a ubatch's GEMM runs on under `dbo_gemm_sms` (None: all, with comm)."""
        reserving = self.dbo_gemm_sms is not None and ubatch is not None
        return self.dbo_gemm_sms if compute and reserving and name in RESERVED_SM_OPS else None

    # ------------------------------------------------------------------------ events, syncs

    def _check_event(self, event: Event) -> SimEvent:
        if not isinstance(event, SimEvent) or event.device is not self:
            raise TypeError(f"event must be an Event of {self!r}, got {event!r}")
        return event

    def record_event(self, event: Event, stream: Stream) -> None:
        """The device side of `event.record(stream)`."""
        event = self._check_event(event)
        stream = self.check_stream(stream)
        self._record_on_track(event, stream.track)  # type: ignore[attr-defined]
        if self._graph is not None and not self.thread_state().replaying:
            self._graph.on_record(event, stream)

    def _record_on_track(self, event: SimEvent, track: Track) -> None:
        with self._lock:
            event.time_us, event.vc = self._clock.record(track)
            event.stream_name = track.name
            event.generation = self._clock.generation

    def stream_wait_event(self, stream: SimStream, event: Event) -> None:
        """The device side of `stream.wait_event(event)`."""
        event = self._check_event(event)
        track = self.check_stream(stream).track  # type: ignore[attr-defined]
        with self._lock:
            if event.recorded:  # as in CUDA, waiting on a never-recorded event is a no-op
                self._clock.wait(track, event.time_us, event.vc)  # type: ignore[arg-type]
                self._note_wait(event, track)
        if self._graph is not None and not self.thread_state().replaying:
            self._graph.on_wait(stream, event)

    def _note_wait(self, event: SimEvent, track: Track) -> None:
        if self.record_timeline:
            ubatch, on = self.current_ubatch(), event.stream_name or "?"
            wait = EventWait(self.rank, ubatch, on, event.time_us or 0.0, track.name, self._seq)
            self.event_waits.append(wait)

    def _host_record(self, name: str, kind: str, start: float, end: float, on: str = "") -> None:
        """A host-track record (sync, baton pass, graph launch), made when the timeline is read."""
        self._records.note_host(name, kind, self._seq, self.thread_state(), start, end, on)
        self._seq += 1

    def _host_wait(self, until_us: float, vc: Sequence[int], what: str) -> None:
        """The host blocks until `until_us`; what it waited for is ordered before later
        launches. A SYNC record is placed only when the host actually waits."""
        with self._lock:
            start = self._clock.host_wait(until_us, vc)
            if start is not None:
                self._host_record("host-sync", SYNC, start, until_us, on=what)

    def sync_stream(self, stream: SimStream, what: str | None = None) -> None:
        """The device side of `stream.synchronize()`: the host waits for its work."""
        track = stream.track
        with self._lock:
            self._host_wait(track.free_at, track.vc, what or f"stream {track.name}")

    def sync_event(self, event: SimEvent) -> None:
        """The device side of `event.synchronize()`."""
        with self._lock:
            if event.recorded:
                self._host_wait(event.time_us, event.vc, f"event on {event.stream_name}")  # type: ignore[arg-type]

    def poll(self, done_at_us: float, vc: Sequence[int], what: str) -> bool:
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
        self.sync_stream(stream, f"{what} on stream {stream.name}")

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
        peers: Any = None,
    ) -> Iterator[CommHandle]:
        """The block is one comm op costed by `comm_time_us` (coupled to `peers`: see
        `place_comm`); its torch ops are not placed, their accesses are the comm op's."""
        state = self.thread_state()
        region = open_region(self.profile, state, kind, nbytes, mode, ep_size, link)
        handle = CommHandle(kind=kind, nbytes=region.nbytes, mode=mode, event=self.Event())
        state.comm = region
        try:
            yield handle
        finally:
            state.comm = None
        self.place_comm(region, handle.event, peers)  # type: ignore[arg-type]

    def place_comm(self, region: CommRegion, event: SimEvent, peers: Any = None) -> None:
        """Place a finished comm region as `dbo.sim.regions.region_ops` plans it; `event`
        marks its data usable (an "ll" region's: arrival, on the link track). `peers` (the
        EP ranks of an all-to-all across processes) couples the transfer's end to theirs:
        `dbo.sim.alltoall.couple_to_peers`."""
        replaying, shares = self.thread_state().replaying, (self.ht_rdma_share, self.ht_nvl_share)
        ops = region_ops(self.profile, region, shares[0], replaying, shares[1])
        stream_track = region.stream.track  # type: ignore[attr-defined]
        coupled = peers is not None and region.ep_size > 1 and region.link is None
        with self._lock:
            track, placed = stream_track, None
            for k, op in enumerate(ops):
                track = self._link if op.on_link else stream_track
                if op.on_link:
                    # The transfer leaves after the send: order it after the sending stream.
                    join(track.vc, stream_track.vc)
                not_before = placed.end_us if op.after_send and placed else 0.0
                cost, args = op.cost_us, op.args
                if coupled and k == len(ops) - 1:  # the transfer itself (after an LL send)
                    cost, args = self._coupled_cost(region.mode, op, track, not_before, peers)
                placed = self.place_op(
                    op.name, cost, kind=COMM, track=track, nbytes=op.nbytes,
                    reads=op.reads, writes=op.writes, fresh=op.fresh, args=args,
                    launch=op.launch, sm_share=op.sm_share, host_us=op.host_us,
                    full_grid=op.full_grid, not_before=not_before,
                )  # fmt: skip
            self._record_on_track(event, track)
        if self._graph is not None and not replaying:
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
            self._checker.allocated(tensor, stream.track, stack)

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        """`Tensor.record_stream` for the simulated device: the caching allocator will not
        hand `tensor`'s memory to a new tensor before the work issued on `stream` up to the
        moment the memory is freed. (torch's own method only accepts CUDA streams.)"""
        track = self.check_stream(stream).track  # type: ignore[attr-defined]
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
        return self._buffer_owners.snapshot()

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
        self._buffer_owners.add(owner)

    def remove_buffer_owner(self, owner: Any) -> None:
        self._buffer_owners.remove(owner)

    def __repr__(self) -> str:
        return f"<SimDevice {self.profile.name} rank={self.rank} tensors on {self.torch_device}>"
