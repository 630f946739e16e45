"""Placement arithmetic of the simulated device, as pure functions: when an op starts and
ends, given when it is ready and what else holds the GPU.

SM sharing (an approximation): a high-throughput comm op holds comm_sms / num_sms of the SMs
for its duration; a compute op placed later whose time span overlaps it progresses at
1 - share (so a fully overlapped op takes cost / (1 - share)). Compute placed before the comm
op was issued (under DBO the other ubatch's work, issued before this ubatch's dispatch) loses
the same SM time, but its record is kept: what it lost (`taken_from`) is charged to its stream
as a gap before the stream's next op (`Span.taken`). The comm op itself is never slowed. With
`dbo_gemm_sms` set (SGLang's two-batch overlap caps its GEMM library at the SMs the comm
kernels leave), a ubatch's GEMMs instead always run on that many SMs and are never stretched.

Compute and full-grid kernels (a one-rank comm region's local permutation) take the GPU in
turn. A real GPU runs them side by side when both are ready, and each then progresses slower
than alone; with a profile's `overlap_rates` (measured per kind from DBO traces), an op that
waited for the other kind is charged what running beside it would have cost beyond the turns
(`contention_us`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "GpuLoad",
    "Kernel",
    "SmBusy",
    "Span",
    "Turns",
    "after",
    "contention_us",
    "hold_sms",
    "place_span",
    "slowdown_args",
    "stretch",
    "taken_from",
]

# A high-throughput comm kernel holding SMs: (start, end, share of the SMs).
SmBusy = tuple[float, float, float]


@dataclass(frozen=True)
class Turns:
    """Where the two kinds that take the GPU in turn stand: the latest end of any compute op
    and of any full-grid kernel placed so far."""

    compute_end: float = 0.0
    grid_end: float = 0.0


class Kernel(NamedTuple):  # a tuple: made for every op placed, so it must be cheap
    """What placement needs of one op: its cost alone on the GPU, whether it is compute or a
    full-grid kernel (each takes the GPU in turn with the other), and `reserved_sms` =
    (num_sms, sms) when it runs on its own `sms` of the GPU's SMs."""

    cost_us: float
    compute: bool
    full_grid: bool = False
    reserved_sms: tuple[int, int] | None = None


class GpuLoad(NamedTuple):  # as cheap as `Kernel`
    """What holds the GPU where an op is placed: the turns, the comm kernels holding SMs (a
    share of at most `max_share` counts), and the profile's `overlap_rates` (None or empty:
    turns cost nothing extra)."""

    turns: Turns
    busy: Sequence[SmBusy]
    max_share: float
    rates: Mapping[str, float] | None = None


@dataclass(frozen=True)
class Span:
    """Where one op runs: `ready` is when its stream and the host let it start, `start` when
    it gets the GPU, `end` when it finishes (contention included); `cost_us` is its cost as
    run (a reserved-SM GEMM's is scaled)."""

    ready: float
    start: float
    end: float
    cost_us: float
    contention: float
    # SM time comm kernels placed after this stream's earlier ops took from them, charged
    # before this op (see `taken_from`).
    taken: float = 0.0

    @property
    def stretched(self) -> float:
        """Its run time without the contention charge: its cost, stretched by comm SMs."""
        return self.end - self.contention - self.start


def stretch(busy: Sequence[SmBusy], start: float, work: float, max_share: float) -> float:
    """End time of `work` us of compute starting at `start` while high-throughput comm
    kernels hold part of the SMs: progress runs at rate 1 - (SM share held by comm), the
    share capped at `max_share`."""
    busy = [b for b in busy if b[1] > start]
    if not busy or work <= 0:
        return start + work
    t, remaining = start, work
    while True:
        share = min(sum(sh for s, e, sh in busy if s <= t < e), max_share)
        later = [p for s, e, _ in busy for p in (s, e) if p > t]
        nxt = min(later) if later else math.inf
        rate = 1.0 - share
        if t + remaining / rate <= nxt:
            return t + remaining / rate
        remaining -= (nxt - t) * rate
        t = nxt


def contention_us(
    rates: Mapping[str, float] | None, full_grid: bool, waited: float, work: float
) -> float:
    """What an op that waited `waited` us for the other kind (compute vs full-grid) to
    finish would have lost by running beside it instead, at the profile's overlap rates.

    Beside each other the waiting op (rate r_own) and the rest of the other kind's work
    (`waited` us, rate r_other) would share the GPU until either finished, i.e. for
    T = min(waited / r_other, work / r_own), doing (r_own + r_other) * T of work in T; all
    the rest runs alone as in turns. The pair therefore ends (1 - r_own - r_other) * T
    later than in turns. The op that waited carries it (the other is placed already and is
    not re-timed); rates that sum to 1 or more cost nothing (turns are kept)."""
    if not rates or waited <= 0 or work <= 0:
        return 0.0
    own = rates["full_grid" if full_grid else "compute"]
    other = rates["compute" if full_grid else "full_grid"]
    loss = 1.0 - own - other
    if loss <= 0:
        return 0.0
    return loss * min(waited / other, work / own)


def place_span(ready: float, kernel: Kernel, load: GpuLoad) -> Span:
    """Where `kernel`, ready at `ready`, runs under `load`. A full-grid kernel waits for
    compute and compute for full-grid kernels (turns); compute is stretched by the comm
    kernels holding SMs, unless it runs on reserved SMs (never stretched, but slower); an op
    that waited for its turn carries the contention charge."""
    start, cost_us = ready, kernel.cost_us
    if kernel.full_grid:
        start = max(start, load.turns.compute_end)
    elif kernel.compute:
        start = max(start, load.turns.grid_end)
    if kernel.reserved_sms is not None:
        num_sms, sms = kernel.reserved_sms
        cost_us = cost_us * num_sms / sms
        end = start + cost_us
    elif kernel.compute:
        end = stretch(load.busy, start, cost_us, load.max_share)
    else:
        end = start + cost_us
    contention = contention_us(load.rates, kernel.full_grid, start - ready, cost_us)
    return Span(ready, start, end + contention, cost_us, contention)


def after(turns: Turns, span: Span, kernel: Kernel) -> Turns:
    """The turns once `kernel` is placed at `span`."""
    if kernel.full_grid:
        return Turns(turns.compute_end, max(turns.grid_end, span.end))
    if kernel.compute:
        return Turns(max(turns.compute_end, span.end), turns.grid_end)
    return turns


def hold_sms(busy: Sequence[SmBusy], span: Span, share: float, horizon: float) -> list[SmBusy]:
    """`busy` with `span` holding `share` of the SMs, less what ended before `horizon` (no
    later op can start before the host clock, so those can slow nothing)."""
    kept = [b for b in busy if b[1] > horizon]
    kept.append((span.start, span.end, share))
    return kept


def taken_from(
    placed: Sequence[tuple[float, float, int]], held: Span, share: float, own: int
) -> dict[int, float]:
    """SM time a comm kernel running over `held` and holding `share` of the SMs takes from
    compute already placed: per track index, what the ops of `placed` ((start, end, track))
    on other tracks than `own` lose while it runs, as if stretched after the fact."""
    taken: dict[int, float] = {}
    if share <= 0 or held.end <= held.start:
        return taken
    for start, end, track in placed:
        overlap = min(end, held.end) - max(start, held.start)
        if track != own and overlap > 0:
            taken[track] = taken.get(track, 0.0) + overlap * share / (1.0 - share)
    return taken


def slowdown_args(span: Span, *, compute: bool) -> dict[str, float]:
    """What the trace shows of an op's slowdowns: by comm SMs, and by running beside the
    other kind."""
    args: dict[str, float] = {}
    if compute and span.stretched > span.cost_us + 1e-9:
        args["sm_slowdown_us"] = span.stretched - span.cost_us
    if span.contention > 0:
        args["overlap_slowdown_us"] = span.contention
    if span.taken > 0:
        args["sm_taken_us"] = span.taken
    return args
