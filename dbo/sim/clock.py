"""The virtual time of one simulated device: the host clock, every timeline with its vector
clock, and what holds the GPU (comm kernels' SM shares, the compute / full-grid turns).

`DeviceClock` is the state; placing an op, recording and waiting on an event and a host wait
are arithmetic on it (`dbo.sim.timeline` computes the spans). It makes no records and takes no
lock: `SimDevice` holds its lock around every call and writes the `OpRecord`s.

Ordering: an op's epoch is its timeline's own vector-clock entry right after it. A host sync
joins what the host waited for into the host's clock and bumps a generation; a timeline joins
the host's clock lazily, at its next launch or record, once per generation.
"""

from __future__ import annotations

from collections.abc import Sequence

from dbo.sim.hardware import HardwareProfile
from dbo.sim.state import PlannedOp
from dbo.sim.timeline import GpuLoad, Kernel, SmBusy, Span, Turns, after, hold_sms, place_span
from dbo.sim.tracks import Track, VectorClock, join

__all__ = ["DeviceClock"]


class DeviceClock:
    """Host time, timelines and GPU occupancy of one device (see the module docstring)."""

    def __init__(self, profile: HardwareProfile, gemm_sms: int | None = None) -> None:
        self.profile = profile
        self.gemm_sms = gemm_sms  # SMs a ubatch's GEMMs run on (None: all, shared with comm)
        self.tracks: list[Track] = []
        self.generation = 0  # bumped by every reset: events recorded before count as unrecorded
        self.start()

    def start(self) -> None:
        """The host at 0 with no ordering, the GPU free (the tracks are reset apart)."""
        self.host_us = 0.0
        self.host_vc: VectorClock = []
        self.host_gen = 0  # bumped whenever a host sync adds ordering
        self.sm_busy: list[SmBusy] = []  # high-throughput comm kernels holding SMs
        self.turns = Turns()

    def reset(self) -> None:
        self.start()
        self.generation += 1
        for track in self.tracks:
            track.reset()

    def new_track(self, name: str) -> Track:
        track = Track(len(self.tracks), name)
        self.tracks.append(track)
        return track

    @property
    def frontier_us(self) -> float:
        """The latest virtual time anything (host or any stream) has reached."""
        return max([self.host_us] + [t.free_at for t in self.tracks])

    def join_host(self, track: Track) -> None:
        # Work launched after a host sync is ordered after what the host waited for.
        if track.host_gen != self.host_gen:
            join(track.vc, self.host_vc)
            track.host_gen = self.host_gen

    def tick(self, track: Track) -> int:
        """Count one op on `track`; its epoch."""
        self.join_host(track)
        track.vc[track.index] += 1
        return track.vc[track.index]

    def place(self, track: Track, op: PlannedOp, *, reserved: bool) -> Span:
        """Place `op`, launched now, on `track` and let it hold what it holds: its track until
        it ends, its turn, and `op.sm_share` of the SMs. `reserved`: a ubatch's GEMM on its
        own `gemm_sms` SMs."""
        reserved_sms = None
        if reserved and self.gemm_sms is not None:
            reserved_sms = (self.profile.num_sms, self.gemm_sms)
        kernel = Kernel(op.cost_us, op.compute, op.full_grid, reserved_sms)
        load = GpuLoad(
            self.turns, self.sm_busy, self.profile.max_comm_sm_share, self.profile.overlap_rates
        )
        span = place_span(max(self.host_us, track.free_at, op.not_before), kernel, load)
        self.turns = after(self.turns, span, kernel)
        track.free_at = span.end
        if op.sm_share > 0 and span.end > span.start:
            # No later op can start before the host clock: older holds slow nothing.
            self.sm_busy = hold_sms(self.sm_busy, span, op.sm_share, self.host_us)
        return span

    def record(self, track: Track) -> tuple[float, VectorClock]:
        """An event recorded on `track` now: (its time, its vector clock)."""
        self.join_host(track)
        return track.free_at, list(track.vc)

    def wait(self, track: Track, time_us: float, vc: Sequence[int]) -> None:
        """Later work on `track` waits for an event recorded at `time_us` with clock `vc`."""
        track.free_at = max(track.free_at, time_us)
        join(track.vc, vc)

    def host_wait(self, until_us: float, vc: Sequence[int]) -> float | None:
        """The host blocks until `until_us`; what it waited for is ordered before later
        launches. The host time it started waiting, or None when it did not wait."""
        if join(self.host_vc, vc):
            self.host_gen += 1
        if until_us <= self.host_us:
            return None
        start, self.host_us = self.host_us, until_us
        return start

    def all_work(self) -> tuple[float, VectorClock]:
        """(when every timeline's work is done, the join of their clocks)."""
        vc: VectorClock = []
        for track in self.tracks:
            join(vc, track.vc)
        return max(t.free_at for t in self.tracks), vc
