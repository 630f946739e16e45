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

A device is built from one checked record (`SimDevice(SimOptions(...))`, `dbo.sim.options`).
`issue` is the one path of an executed kernel (the dispatch mode in `dbo.sim.intercept` hands
it over): its accesses parsed, priced, placed or folded into the thread's comm region, checked
by the race checker, recorded into the graph being captured. `place_op` places one
`PlannedOp`, as issue, `comm_region` and graph replay (`dbo.sim.graph`) plan them; the stream
and event handles feed their calls to the device one way (`dbo.sim.handles.HandleSink`).

Communication regions are placed as `dbo.sim.regions` plans them (one SM-holding op, a send
and a transfer, or a one-rank group's own ops as a full-grid kernel). What the device offers
beside placement (the race checker's feed, graph capture, a measurement's views) is in
`dbo.sim.device_hooks`; SM control in `dbo.sim.sm_control`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from typing import Any

from dbo.sim.alltoall import couple_to_peers
from dbo.sim.clock import DeviceClock
from dbo.sim.cost import OpCall, OpCost, price_op
from dbo.sim.device_hooks import CaptureHooks, CheckerHooks, LogViews
from dbo.sim.families import GEMM_OPS, host_family
from dbo.sim.graph import BufferOwners
from dbo.sim.handles import SimEvent, SimMark, SimStream
from dbo.sim.hardware import HardwareProfile
from dbo.sim.intercept import enter_modes
from dbo.sim.log import DeviceLog
from dbo.sim.options import SimOptions
from dbo.sim.races import RaceChecker, user_stack
from dbo.sim.ranges import HostRanges, device_scope
from dbo.sim.records import GRAPH_LAUNCH, HANDOFF, SYNC, OpRecord
from dbo.sim.regions import open_region, region_ops
from dbo.sim.sm_control import SmControlHooks
from dbo.sim.state import CommRegion, PlannedOp, ThreadState
from dbo.sim.tracks import Track, join
from dbo.streams import CommHandle, Device, Event, Stream

__all__ = ["SimDevice", "SimMark", "SimStream", "SimEvent"]

# The ops that run on the SMs `dbo_gemm_sms` reserves: what a GEMM library such as DeepGEMM
# runs (one list, in dbo.sim.cost).
RESERVED_SM_OPS = GEMM_OPS


def _trace_args(call: OpCall, priced: OpCost) -> dict[str, Any]:
    # A nested tensor has no single shape; the trace gets its layout instead.
    shapes = ["nested" if t.is_nested else tuple(t.shape) for t in call.ins]
    return {"shapes": shapes, "dtype": str(call.dtype).replace("torch.", ""), "cost": priced.source}


class SimDevice(LogViews, CheckerHooks, CaptureHooks, SmControlHooks, Device):
    """A virtual-time GPU on which ops run eagerly (for their values) and are placed on a
    timeline (for their time)."""

    kind = "sim"

    def __init__(self, options: SimOptions | None = None) -> None:
        """A device as `options` (checked when they were built) describe it; the defaults: an
        H200 with real CPU tensors, race checks and traces on."""
        self.options = options = SimOptions() if options is None else options
        self.profile: HardwareProfile = options.hardware()
        self.rank = int(options.rank)
        self.torch_device = options.torch_device()
        self._init_timelines()
        self.log = DeviceLog(options, self._lock)
        # Race bookkeeping needs real storages; a meta run has none.
        self._checker: RaceChecker | None = None
        if options.check_races and self.torch_device.type != "meta":
            self._checker = RaceChecker(self.log.on_race, transfer_tracks=(self._link.index,))
        self._buffer_owners = BufferOwners()

    @property
    def dbo_gemm_sms(self) -> int | None:
        """SMs a ubatch's GEMMs run on: the options' `EngineKnobs`, unless SM control
        (`set_compute_sms`) has set them since."""
        if self.compute_sms is not None:
            return self.compute_sms
        return self.options.engine.dbo_gemm_sms

    @property
    def ht_rdma_share(self) -> float:
        """The share of a multi-node "ht" region's off-node bytes that crosses RDMA."""
        return self.options.engine.ht_rdma_share

    @property
    def ht_nvl_share(self) -> float | None:
        """NVLink bytes per byte of expert copies an "ht" region sends (None: every byte not
        on RDMA)."""
        return self.options.engine.ht_nvl_share

    def _init_timelines(self) -> None:
        # RLock: event and stream calls nest inside placement paths of the same thread.
        self._lock = threading.RLock()
        self._tls = threading.local()  # holds each thread's ThreadState
        self._clock = DeviceClock(self.profile)
        self._streams: dict[str, SimStream] = {}
        self._default = self.Stream("default")
        self._link = self._clock.new_track("link")

    # ---------------------------------------------------------------------------- factories

    def Stream(self, name: str = "") -> SimStream:
        with self._lock:
            base = name or f"stream-{len(self._clock.tracks)}"
            unique, n = base, 1
            while unique in self._streams or unique in ("link", "host"):
                n += 1
                unique = f"{base}#{n}"
            stream = SimStream(self, self, self._clock.new_track(unique))
            self._streams[unique] = stream
            return stream

    def Event(self) -> SimEvent:
        return SimEvent(self, self)

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
                lambda: self._clock.host_us, self.current_ubatch, self.log.on_host_range
            )
            state = self._tls.state = ThreadState(self._default, ranges)
        return state

    def current_stream(self) -> SimStream:
        return self.thread_state().stream

    def set_stream(self, stream: Stream) -> None:
        self.thread_state().stream = self.check_stream(stream)

    def check_stream(self, stream: Stream, what: str = "stream") -> SimStream:
        checked = super().check_stream(stream, what)
        assert isinstance(checked, SimStream)  # every stream of this device is one
        return checked

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

    def reset(self) -> None:
        """Start a new measurement: clocks at 0, empty timeline and race list, no history.
        Events recorded before the reset count as never recorded."""
        with self._lock:
            self.log.reset()
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
        op = PlannedOp(
            call.name,
            priced.us,
            flops=call.flops,
            nbytes=call.nbytes,
            reads=reads,
            writes=writes,
            fresh=fresh,
            args=_trace_args(call, priced),
        )
        record = self.place_op(op)
        if graph is not None:
            graph.on_op(call, op, record)

    # ---------------------------------------------------------------------------- placement

    def place_op(self, op: PlannedOp) -> OpRecord:
        """Place `op` on its timeline (the thread's current stream unless it names a track)
        and check its accesses; returns its record."""
        state = self.thread_state()
        track = state.stream.track if op.track is None else op.track
        # isinstance, not == CURRENT: the one str the field holds, and a check type checkers narrow.
        ubatch = state.ubatch if isinstance(op.ubatch, str) else op.ubatch
        with self._lock:
            issue = self._clock.host_us
            self._clock.host_us += self._launch_us(op, state.replaying)
            epoch = self._clock.tick(track)
            reserved_sms = self._reserved_sms(op, ubatch)
            span = self._clock.place(track, op, reserved_sms=reserved_sms)
            record = self.log.add_op(
                op, span, ubatch=ubatch, stream=track.name, issue_us=issue, replayed=state.replaying
            )
            if self._checker is not None and (op.reads or op.writes or op.fresh):
                stack = op.stack
                if stack is None and self.options.capture_stacks:
                    stack = user_stack()
                self._checker.on_op(record, track, epoch, op.reads, op.writes, stack, op.fresh)
            return record

    def _launch_us(self, op: PlannedOp, replayed: bool) -> float:
        """Host time issuing one op costs: its eager issue time, none inside a replayed graph."""
        if not op.launch or replayed:
            return 0.0
        return (
            self.profile.eager_host_us(host_family(op.name)) if op.host_us is None else op.host_us
        )

    def _coupled(self, mode: str, op: PlannedOp, peers: Any) -> PlannedOp:
        """A comm op coupled to its peers (see `place_comm`): its duration and trace args."""
        assert op.track is not None  # place_comm has put it on its track
        launch = self._launch_us(op, self.thread_state().replaying)
        ready = max(self._clock.host_us + launch, op.track.free_at, op.not_before)
        share = self.ht_rdma_share
        with self.suspended():  # the exchange is bookkeeping, not device work
            end, wait, gate = couple_to_peers(self.profile, mode, ready, peers, share)
        return replace(
            op, cost_us=end - ready, args=dict(op.args, peer_wait_us=wait, gated_by=gate)
        )

    def _reserved_sms(self, op: PlannedOp, ubatch: int | None) -> int | None:
        """The SMs a ubatch's GEMM runs on under `dbo_gemm_sms` (None: all, with comm): slower,
        but untouched by comm kernels."""
        reserving = self.dbo_gemm_sms is not None and ubatch is not None
        if op.compute and reserving and op.name in RESERVED_SM_OPS:
            return self.dbo_gemm_sms
        return None

    # ------------------------------------------------------------------------ events, syncs

    def _check_event(self, event: Event) -> SimEvent:
        if not isinstance(event, SimEvent) or event.device is not self:
            raise TypeError(f"event must be an Event of {self!r}, got {event!r}")
        return event

    def record_event(self, event: Event, stream: Stream | None = None) -> None:
        """The device side of `event.record(stream)` (None: the current stream)."""
        event = self._check_event(event)
        stream = self.current_stream() if stream is None else self.check_stream(stream)
        self._record_on_track(event, stream.track)
        if self._graph is not None and not self.thread_state().replaying:
            self._graph.on_record(event, stream)

    def _record_on_track(self, event: SimEvent, track: Track) -> None:
        with self._lock:
            event.time_us, event.vc = self._clock.record(track)
            event.stream_name = track.name
            event.generation = self._clock.generation

    def stream_wait_event(self, stream: Stream, event: Event) -> None:
        """The device side of `stream.wait_event(event)`."""
        event = self._check_event(event)
        waiting = self.check_stream(stream)
        with self._lock:
            # As in CUDA, waiting on a never-recorded event is a no-op.
            if event.recorded and event.time_us is not None:
                self._clock.wait(waiting.track, event.time_us, event.vc)
                on = event.stream_name or "?"
                self.log.add_wait(self.current_ubatch(), on, event.time_us, waiting.name)
        if self._graph is not None and not self.thread_state().replaying:
            self._graph.on_wait(waiting, event)

    def _host_wait(self, until_us: float, vc: Sequence[int], what: str) -> None:
        """The host blocks until `until_us`; what it waited for is ordered before later
        launches. A SYNC record is placed only when the host actually waits."""
        with self._lock:
            start = self._clock.host_wait(until_us, vc)
            if start is not None:
                self.log.add_host("host-sync", SYNC, start, until_us, self.thread_state(), on=what)

    def sync_stream(self, stream: SimStream, what: str | None = None) -> None:
        """The device side of `stream.synchronize()`: the host waits for its work."""
        track = stream.track
        with self._lock:
            self._host_wait(track.free_at, track.vc, what or f"stream {track.name}")

    def sync_event(self, event: SimEvent) -> None:
        """The device side of `event.synchronize()`."""
        with self._lock:
            if event.recorded and event.time_us is not None:
                self._host_wait(event.time_us, event.vc, f"event on {event.stream_name}")

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
            self.log.add_host(name, kind, start, self._clock.host_us, self.thread_state())

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
        nbytes = region.nbytes
        event = self.Event()
        state.comm = region
        try:
            yield CommHandle(kind=kind, nbytes=nbytes, mode=mode, event=event)
        finally:
            state.comm = None
        self.place_comm(region, event, peers)

    def place_comm(self, region: CommRegion, event: SimEvent, peers: Any = None) -> None:
        """Place a finished comm region as `dbo.sim.regions.region_ops` plans it; `event`
        marks its data usable (an "ll" region's: arrival, on the link track). `peers` (the
        EP ranks of an all-to-all across processes) couples the transfer's end to theirs:
        `dbo.sim.alltoall.couple_to_peers`."""
        replaying, shares = self.thread_state().replaying, (self.ht_rdma_share, self.ht_nvl_share)
        ops = region_ops(self.profile, region, shares[0], replaying, shares[1])
        coupled = peers is not None and region.ep_size > 1 and region.link is None
        stream_track = region.stream.track
        with self._lock:
            track, placed = stream_track, None
            for k, op in enumerate(ops):
                track = self._link if op.on_link else stream_track
                if op.on_link:
                    # The transfer leaves after the send: order it after the sending stream.
                    join(track.vc, stream_track.vc)
                not_before = placed.end_us if op.after_send and placed else 0.0
                op = replace(op, track=track, not_before=not_before)
                if coupled and k == len(ops) - 1:  # the transfer itself (after an LL send)
                    op = self._coupled(region.mode, op, peers)
                placed = self.place_op(op)
            self._record_on_track(event, track)
        if self._graph is not None and not replaying:
            self._graph.on_comm(region, event)

    # ------------------------------------------------------------------------- host launches

    def launch_graph(self) -> None:
        """Host time of launching a whole replayed graph, drawn on the host track."""
        self._host_launch("graph-launch", self.profile.graph_launch_us, GRAPH_LAUNCH)

    def __repr__(self) -> str:
        return f"<SimDevice {self.profile.name} rank={self.rank} tensors on {self.torch_device}>"
