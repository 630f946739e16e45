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
from dataclasses import replace

from dbo.sim.hardware import HardwareProfile
from dbo.sim.state import PlannedOp
from dbo.sim.timeline import (
    GpuLoad,
    Kernel,
    SmBusy,
    Span,
    Turns,
    after,
    hold_sms,
    place_span,
    taken_from,
)
from dbo.sim.tracks import Track, VectorClock, join

__all__ = ["DeviceClock"]


class DeviceClock:
    """Host time, timelines and GPU occupancy of one device (see the module docstring)."""

    def __init__(self, profile: HardwareProfile) -> None:
        self.profile = profile
        self.tracks: list[Track] = []
        self.generation = 0  # bumped by every reset: events recorded before count as unrecorded
        self.start()

    def start(self) -> None:
        """The host at 0 with no ordering, the GPU free (the tracks are reset apart)."""
        self.host_us = 0.0
        self.host_vc: VectorClock = []
        self.host_gen = 0  # bumped whenever a host sync adds ordering
        self.sm_busy: list[SmBusy] = []  # high-throughput comm kernels holding SMs
        # Compute that comm SMs can still slow: (start, end, track index), and the SM time
        # comm kernels placed later took from each track, not yet charged (`taken_from`).
        self.unheld: list[tuple[float, float, int]] = []
        self.taken: dict[int, float] = {}
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

    def place(self, track: Track, op: PlannedOp, *, reserved_sms: int | None) -> Span:
        """Place `op`, launched now, on `track` and let it hold what it holds: its track until
        it ends, its turn, and `op.sm_share` of the SMs. `reserved_sms`: a ubatch's GEMM on
        that many SMs of its own (None: on all of them, shared with comm kernels)."""
        reserved = None if reserved_sms is None else (self.profile.num_sms, reserved_sms)
        kernel = Kernel(op.cost_us, op.compute, op.full_grid, reserved)
        load = GpuLoad(
            self.turns, self.sm_busy, self.profile.max_comm_sm_share, self.profile.overlap_rates
        )
        span = place_span(max(self.host_us, track.free_at, op.not_before), kernel, load)
        taken = self.taken.pop(track.index, 0.0)
        if taken:
            span = replace(span, taken=taken)
        self.turns = after(self.turns, span, kernel)
        track.free_at = span.end
        # No later op can start before the host clock: what ended before it slows nothing.
        self.unheld = [u for u in self.unheld if u[1] > self.host_us]
        if op.sm_share > 0 and span.end > span.start:
            self.sm_busy = hold_sms(self.sm_busy, span, op.sm_share, self.host_us)
            self._take_sms(span, min(op.sm_share, self.profile.max_comm_sm_share), track)
        elif op.compute and not op.full_grid and reserved_sms is None:
            self.unheld.append((span.start, span.end, track.index))
        return span

    def _take_sms(self, held: Span, share: float, own: Track) -> None:
        """Compute placed before a comm kernel that runs beside it loses SMs all the same:
        its stream's next op starts that much later (the records placed stay as they are)."""
        for index, lost in taken_from(self.unheld, held, share, own.index).items():
            self.tracks[index].free_at += lost
            self.taken[index] = self.taken.get(index, 0.0) + lost

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
