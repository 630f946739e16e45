"""A stream program: one rank's recorded step as a dependency graph that any rank can replay.

One rank's step is simulated once on a `SimDevice` (eager or a replayed graph, serial or
ubatched); its timeline and event waits become a `StreamProgram`: every placed op with its
track, its recorded duration, the ops it must follow, and how the host issued it. Replaying
it (`dbo.sim.cluster`) for another rank re-times only what differs between ranks (the expert
kernels' rows, the bytes each all-to-all moves and when its peers send them) and keeps the
rest as recorded, so R ranks cost R vectors of arithmetic, not R runs of torch interception.

What an op follows, as the device placed it: the previous op on its track (stream order), the
op an event it waits for was recorded after, the host clock (its issue time plus its launch),
and whatever else ended exactly when it started (the device's turn-taking between compute
and full-grid kernels; an LL transfer leaving after its send). Replayed with the recorded
durations, the program reproduces the recorded timeline; that is what makes balanced routing
at R ranks agree with the one-rank simulation.

Which ops are a rank's expert work: the compute ops of a ubatch between its j-th dispatch and
its j-th combine (MoE layer j) that are a GEMM or work on a GEMM's rows (same leading dims as
the first GEMM's input), i.e. not the token-sized buffers the combine fills.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from dbo.sim.cost import GEMM_OPS
from dbo.sim.hardware import HardwareProfile
from dbo.sim.records import COMM, COMPUTE, SYNC, EventWait, OpRecord

__all__ = [
    "OP",
    "HT_COMM",
    "LL_SEND",
    "LL_LINK",
    "LOCAL_COMM",
    "HOST",
    "HOST_SYNC",
    "Collective",
    "StreamProgram",
    "program_from_records",
    "record_program",
    "recorded_ep_size",
    "tile_layers",
]

# Op classes of a program (numpy codes).
OP, HT_COMM, LL_SEND, LL_LINK, LOCAL_COMM, HOST, HOST_SYNC = range(7)
_EPS = 1e-6


@dataclass(frozen=True)
class Collective:
    """One dispatch or combine of the program: its op, MoE layer, ubatch and the bytes the
    recording rank sent (its remote share of rows, as the one-rank formula prices them)."""

    op: int
    kind: str  # "dispatch" | "combine" | another collective's name
    mode: str  # "ht" | "ll"
    layer: int
    ubatch: int | None
    nbytes: float


@dataclass
class StreamProgram:
    """One rank's step as arrays over its ops (index = position in issue order)."""

    names: list[str]
    klass: np.ndarray  # OP, HT_COMM, ... per op
    track: np.ndarray  # track index per op (-1: host)
    track_names: list[str]
    ubatch: list[int | None]
    start0: np.ndarray  # the recording's times
    end0: np.ndarray
    issue0: np.ndarray
    work: np.ndarray  # duration before SM sharing stretched it
    host_adv: np.ndarray  # host time from this op's issue (or a sync's end) to the next issue
    floor_off: np.ndarray  # an op starts no earlier than its issue + this
    deps: list[tuple[int, ...]]  # ops it must follow (for a host sync: what the host waits for)
    stretchable: np.ndarray  # compute that loses SMs to concurrent HT comm kernels
    expert_layer: np.ndarray  # MoE layer of an expert op, -1 otherwise
    weight_share: np.ndarray  # GEMM: share of its bytes that are weights (fixed per rank)
    intensity: np.ndarray  # GEMM: math time over memory time at the recorded rows
    collective: np.ndarray  # index into `collectives`, -1 otherwise
    collectives: list[Collective]
    ep_size: int  # the group its all-to-alls spanned, as recorded (`recorded_ep_size`)
    profile: HardwareProfile  # its GPUs per node are the group's, for the replay too
    ht_rdma_share: float = 1.0
    ht_nvl_share: float | None = None  # None: HT bytes priced per copy (`dbo.sim.regions`)
    records: list[OpRecord] = field(default_factory=list, repr=False)

    @property
    def num_ops(self) -> int:
        return len(self.names)

    @property
    def num_layers(self) -> int:
        """MoE layers (dispatches of the first ubatch that dispatches)."""
        return 1 + max((c.layer for c in self.collectives), default=-1)

    @property
    def step_us(self) -> float:
        return float(self.end0.max() - self.issue0.min()) if self.num_ops else 0.0


def _klass(r: OpRecord) -> int:
    if r.kind == SYNC:
        return HOST_SYNC
    if r.kind == COMM:
        args = r.args or {}
        if args.get("link") == "local":
            return LOCAL_COMM
        if args.get("mode") == "ll":
            return LL_SEND if r.name.endswith(".send") else LL_LINK
        return HT_COMM
    return OP if r.kind == COMPUTE else HOST


def _explaining(i: int, start: float, by_end: dict[float, list[int]]) -> int | None:
    """The latest op issued before `i` that ended exactly when `i` started, if any."""
    for key in (round(start, 6), round(start - _EPS, 6), round(start + _EPS, 6)):
        hits = [j for j in by_end.get(key, ()) if j < i]
        if hits:
            return max(hits)
    return None


def _dependencies(
    records: Sequence[OpRecord], klass: np.ndarray, waits: Sequence[EventWait]
) -> tuple[list[tuple[int, ...]], np.ndarray]:
    """Each op's predecessors (track order, event waits, whatever ended when it started) and
    its host floor offset."""
    n = len(records)
    deps: list[set[int]] = [set() for _ in range(n)]
    last_on: dict[str, int] = {}
    before: dict[int, int] = {}  # op -> the op before it on its stream
    by_end: dict[float, list[int]] = {}
    on_track: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        if klass[i] in (OP, HT_COMM, LL_SEND, LL_LINK, LOCAL_COMM):
            if r.stream in last_on:
                deps[i].add(last_on[r.stream])
                before[i] = last_on[r.stream]
            last_on[r.stream] = i
            on_track.setdefault(r.stream, []).append(i)
            by_end.setdefault(round(r.end_us, 6), []).append(i)
    seqs = np.array([r.seq for r in records])
    for w in waits:
        waiter = _first_at_or_after(on_track.get(w.wait_stream, ()), seqs, w.wait_seq)
        source = _last_ending(on_track.get(w.record_stream, ()), records, w.wait_seq, w.record_us)
        if waiter is not None and source is not None:
            deps[waiter].add(source)
    floor = np.zeros(n)
    for i, r in enumerate(records):
        if klass[i] == HOST_SYNC:
            j = _explaining(i, r.end_us, by_end)
            deps[i] = {j} if j is not None else set()
            continue
        if klass[i] == HOST:
            continue
        adv = records[i + 1].issue_us - r.issue_us if i + 1 < n else 0.0
        floor[i] = max(0.0, min(r.start_us - r.issue_us, adv))
        bound = max([r.issue_us + floor[i]] + [records[d].end_us for d in deps[i]])
        taken = float((r.args or {}).get("sm_taken_us", 0.0))
        if taken and i in before:  # SMs a comm kernel took from its stream: the replay's own
            bound = max(bound, records[before[i]].end_us + taken)
        if r.start_us > bound + _EPS:
            j = _explaining(i, r.start_us, by_end)
            if j is not None:
                deps[i].add(j)
            else:  # nothing on record explains the wait: keep it, pinned to the host
                floor[i] = r.start_us - r.issue_us
    return [tuple(sorted(d)) for d in deps], floor


def _first_at_or_after(ops: Sequence[int], seqs: np.ndarray, seq: int) -> int | None:
    for i in ops:
        if seqs[i] >= seq:
            return i
    return None


def _last_ending(
    ops: Sequence[int], records: Sequence[OpRecord], before_seq: int, at_us: float
) -> int | None:
    best = None
    for i in ops:
        if records[i].seq < before_seq and abs(records[i].end_us - at_us) < 1e-6:
            best = i
    return best


def _shape_numel(shape: Any) -> float:
    return float(math.prod(shape)) if isinstance(shape, (list, tuple)) else 0.0


def _lead(record: OpRecord) -> tuple | None:
    shapes = (record.args or {}).get("shapes") or []
    first = shapes[0] if shapes else None
    return tuple(first[:-1]) if isinstance(first, (list, tuple)) and first else None


def _gemm_terms(r: OpRecord, profile: HardwareProfile) -> tuple[float, float]:
    """(weight share of the bytes, math time / memory time) of a GEMM record."""
    shapes = (r.args or {}).get("shapes") or []
    if len(shapes) < 2:
        return 0.0, 0.0
    a, w = shapes[0], shapes[1]
    out = _shape_numel(tuple(a[:-1]) + (w[-1],)) if a and w else 0.0
    total = sum(_shape_numel(s) for s in shapes) + out
    share = _shape_numel(w) / total if total else 0.0
    dtype = getattr(torch, str((r.args or {}).get("dtype", "bfloat16")), torch.bfloat16)
    math_us = r.flops / profile.peak_flops_per_us(dtype) if r.flops else 0.0
    mem_us = r.bytes / profile.hbm_bytes_per_us_for(dtype) if r.bytes else 0.0
    return share, (math_us / mem_us if mem_us else 0.0)


def _layers_and_experts(
    records: Sequence[OpRecord], klass: np.ndarray, profile: HardwareProfile
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[Collective], np.ndarray]:
    """MoE layer of each expert op, GEMM terms, and the collectives with their layers."""
    n = len(records)
    layer = np.full(n, -1)
    wshare, rho = np.zeros(n), np.zeros(n)
    coll_of = np.full(n, -1)
    collectives: list[Collective] = []
    seen: dict[tuple[int | None, str], int] = {}
    open_at: dict[int | None, tuple[int, int]] = {}  # ubatch -> (layer, first op of its window)
    for i, r in enumerate(records):
        if klass[i] not in (HT_COMM, LL_LINK, LL_SEND):
            continue
        kind = r.name.removeprefix("comm::").removesuffix(".send")
        key = (r.ubatch, kind)
        if klass[i] != LL_SEND:
            j = seen.get(key, 0)
            seen[key] = j + 1
            coll_of[i] = len(collectives)
            mode = (r.args or {}).get("mode", "ht")
            collectives.append(Collective(i, kind, mode, j, r.ubatch, float(r.bytes)))
        if kind == "dispatch" and klass[i] != LL_SEND:
            open_at[r.ubatch] = (seen[key] - 1, i)
        elif kind == "combine" and r.ubatch in open_at:
            j, first = open_at.pop(r.ubatch)
            _mark_window(records, klass, first, i, j, layer)
    for i in np.flatnonzero(layer >= 0):
        if records[i].name in GEMM_OPS:
            wshare[i], rho[i] = _gemm_terms(records[i], profile)
    return layer, wshare, rho, collectives, coll_of


def _mark_window(
    records: Sequence[OpRecord], klass: np.ndarray, first: int, last: int, j: int, layer: np.ndarray
) -> None:
    """Expert ops of one ubatch's MoE layer j: compute between its dispatch and combine."""
    ub = records[last].ubatch
    window = [i for i in range(first + 1, last) if klass[i] == OP and records[i].ubatch == ub]
    gemms = [i for i in window if records[i].name in GEMM_OPS]
    if not gemms:
        return
    lead = _lead(records[gemms[0]])
    for i in window:
        if i in gemms or (lead is not None and _lead(records[i]) == lead):
            layer[i] = j


def recorded_ep_size(records: Sequence[OpRecord]) -> int:
    """The EP size the step's all-to-alls were issued over (each comm record carries its
    region's `ep_size`; 1 when none left the GPU). The program takes it from the recording,
    not from its caller, so it cannot disagree with the bytes and rows the step was priced
    at; a step whose exchanges span two group sizes is not one EP group's step: ValueError."""
    sizes = {
        int((r.args or {}).get("ep_size", 1))
        for r in records
        if r.kind == COMM and (r.args or {}).get("link") != "local"
    }
    if len(sizes) > 1:
        raise ValueError(
            f"the step's all-to-alls span EP sizes {sorted(sizes)}; a stream program is one "
            "EP group's step: record a step whose dispatches and combines share one group"
        )
    return sizes.pop() if sizes else 1


def program_from_records(
    records: Sequence[OpRecord],
    event_waits: Sequence[EventWait],
    profile: HardwareProfile,
    *,
    gemm_sms_reserved: bool = False,
    ht_rdma_share: float = 1.0,
    ht_nvl_share: float | None = None,
) -> StreamProgram:
    """The stream program of one rank's recorded step (`device.timeline`, `device.event_waits`
    after a `device.reset()` and the step); its EP size is the recording's own."""
    records = sorted(records, key=lambda r: r.seq)
    klass = np.array([_klass(r) for r in records], dtype=int)
    track_names: list[str] = []
    track = np.full(len(records), -1)
    for i, r in enumerate(records):
        if klass[i] not in (HOST, HOST_SYNC):
            if r.stream not in track_names:
                track_names.append(r.stream)
            track[i] = track_names.index(r.stream)
    deps, floor = _dependencies(records, klass, event_waits)
    start0 = np.array([r.start_us for r in records])
    end0 = np.array([r.end_us for r in records])
    issue0 = np.array([r.issue_us for r in records])
    slowdown = np.array([float((r.args or {}).get("sm_slowdown_us", 0.0)) for r in records])
    ends_host = np.where(klass == HOST_SYNC, end0, issue0)
    host_adv = np.append(issue0[1:], issue0[-1:] if len(records) else []) - ends_host
    reserved = np.array(
        [gemm_sms_reserved and r.ubatch is not None and r.name in GEMM_OPS for r in records],
        dtype=bool,
    )
    layer, wshare, rho, collectives, coll_of = _layers_and_experts(records, klass, profile)
    return StreamProgram(
        names=[r.name for r in records],
        klass=klass,
        track=track,
        track_names=track_names,
        ubatch=[r.ubatch for r in records],
        start0=start0,
        end0=end0,
        issue0=issue0,
        work=end0 - start0 - slowdown,
        host_adv=np.maximum(host_adv, 0.0),
        floor_off=floor,
        deps=deps,
        stretchable=(klass == OP) & ~reserved,
        expert_layer=layer,
        weight_share=wshare,
        intensity=rho,
        collective=coll_of,
        collectives=collectives,
        ep_size=recorded_ep_size(records),
        profile=profile,
        ht_rdma_share=ht_rdma_share,
        ht_nvl_share=ht_nvl_share,
        records=list(records),
    )


def record_program(step: Callable[[], Any], device: Any) -> StreamProgram:
    """Run a prepared step once on `device` (a SimDevice, already warmed up) and return its
    stream program. `step` is any callable issuing one rank's step: a model's forward, a
    ubatched `run_ubatches` call, or `graph.replay` of a captured step. The group's shape is
    the recording's: its EP size the one its all-to-alls were issued over, its GPUs per node
    the device profile's."""
    device.synchronize()
    device.reset()
    step()
    device.synchronize()
    return program_from_records(
        list(device.timeline),
        list(device.event_waits),
        device.profile,
        gemm_sms_reserved=device.dbo_gemm_sms is not None,
        ht_rdma_share=device.ht_rdma_share,
        ht_nvl_share=device.ht_nvl_share,
    )


def _period_starts(program: StreamProgram) -> list[int]:
    """Where each MoE layer's period begins: the first record of each dispatch (an LL send,
    an HT kernel) of the lowest ubatch that dispatches."""
    ubs = [u for u, n in zip(program.ubatch, program.names) if n.startswith("comm::dispatch")]
    if not ubs:
        return []
    low = min(ubs, key=lambda u: -1 if u is None else u)
    starts = []
    for i, (u, name) in enumerate(zip(program.ubatch, program.names)):
        first = name == "comm::dispatch.send" or (
            name == "comm::dispatch" and program.klass[i] == HT_COMM
        )
        if u == low and first:
            starts.append(i)
    return starts


def _steady_layer(starts: Sequence[int], have: int) -> int:
    """The first recorded MoE layer whose op count repeats the layer before it."""
    for k in range(1, len(starts) - 1):
        if starts[k + 1] - starts[k] == starts[k] - starts[k - 1]:
            return k
    raise ValueError(
        "tile_layers needs two consecutive MoE layers of the same length in the recording "
        f"(got {have} layers, periods starting at ops {starts[:6]}); record more layers"
    )


def tile_layers(program: StreamProgram, num_layers: int) -> StreamProgram:
    """The program of a deeper model: its steady MoE layer (the first whose op count repeats
    the layer before it; four recorded MoE layers suffice after dense ones) repeated until the
    program has `num_layers` MoE layers. Every op's dependencies keep their distance in ops,
    so the copies chain as the recorded layers did; layer indices (routing, collectives) count
    on. ValueError when no two consecutive recorded layers have the same length."""
    starts = _period_starts(program)
    have = program.num_layers
    if num_layers <= have:
        return program
    steady = _steady_layer(starts, have)
    d1, d2 = starts[steady], starts[steady + 1]
    period, copies = d2 - d1, num_layers - have + 1
    seg = np.concatenate(
        [np.arange(d1), np.tile(np.arange(d1, d2), copies), np.arange(d2, program.num_ops)]
    )
    copy = np.concatenate(
        [
            np.zeros(d1, int),
            np.repeat(np.arange(copies), period),
            np.full(program.num_ops - d2, copies - 1),
        ]
    )
    shift = copy * period
    dt = float(program.issue0[d2] - program.issue0[d1]) * copy
    deps = [tuple(d + int(s) for d in program.deps[i]) for i, s in zip(seg, shift)]
    layer = np.where(program.expert_layer[seg] >= 0, program.expert_layer[seg] + copy, -1)
    coll_of = np.full(len(seg), -1)
    collectives = []
    for new, (i, c) in enumerate(zip(seg, copy)):
        k = program.collective[i]
        if k >= 0:
            old = program.collectives[k]
            coll_of[new] = len(collectives)
            collectives.append(replace(old, op=new, layer=old.layer + int(c)))
    return replace(
        program,
        names=[program.names[i] for i in seg],
        klass=program.klass[seg],
        track=program.track[seg],
        ubatch=[program.ubatch[i] for i in seg],
        start0=program.start0[seg] + dt,
        end0=program.end0[seg] + dt,
        issue0=program.issue0[seg] + dt,
        work=program.work[seg],
        host_adv=program.host_adv[seg],
        floor_off=program.floor_off[seg],
        deps=deps,
        stretchable=program.stretchable[seg],
        expert_layer=layer,
        weight_share=program.weight_share[seg],
        intensity=program.intensity[seg],
        collective=coll_of,
        collectives=collectives,
        records=[program.records[i] for i in seg],
    )
