"""Virtual ranks in one process: one EP group's step, every rank replayed from one recording.

`simulate_cluster(program, routing, placement)` replays a `StreamProgram` (one rank's step,
`dbo.sim.cluster_program`) for all R ranks at once, each quantity a numpy vector over ranks:

- Expert kernels are re-timed by the rows the rank's experts receive (its share of the layer's
  routed rows, from the routing and the placement): a GEMM by a two-term roofline anchored on
  its recorded time (its weights are read whatever the rows; its activations and FLOPs scale),
  the elementwise work on the same rows linearly.
- Each dispatch and combine is an all-to-all coupling the ranks, priced from the layer's
  traffic matrix (each rank's own tokens over the experts, through the placement) as
  DeepEP's kernels move it (`dbo.sim.traffic`: low-latency kernels one message per (token,
  expert) copy; normal kernels one copy per token and destination rank over NVLink, one per
  token and destination node over RDMA). Rank r's ends when its own kernel has sent and
  received its bytes (the two links in parallel; its port from when its rows start coming)
  *and* every peer's rows for it have arrived (`dbo.sim.alltoall.pair_ends`): the
  collective ends on each rank when its slowest pair does, so the slowest sender gates the
  receiver, and a rank late to a collective (more expert work before it) delays everyone it
  sends to. A peer's last row for r leaves at the
  peer's start plus its whole send time where DeepEP sends token by token (normal kernels,
  the LL dispatch over NVLink), and, where DeepEP gives each (expert, destination) pair its
  own sender (the LL combine, the LL dispatch over RDMA), when that pair's flow has left a
  link shared fairly among the flows still sending (`dbo.sim.traffic.fair_share_ends`).
  Each ubatch's collectives and expert rows follow that ubatch's own draw where the routing
  has one (`Routing.of_ubatch`). A recording whose HT bytes were
  priced per expert copy (a `SimDevice` without `ht_nvl_share`, as the cross-check's rank
  processes, which move rows per expert) is replayed per copy too.
  High-throughput (HT) kernels hold `comm_sms` of the SMs while they run and compute on the
  same rank progresses at the rest (as the single-rank device stretches it; compute replayed
  before the kernel pays what it lost before its stream's next op); low-latency (LL)
  kernels hold none and pay `ll_latency_us`.
- Everything else keeps its recorded duration; start times follow the program's
  dependencies, so waiting propagates through streams, events and the host.

Balanced routing gives every rank the recorded costs (the recording priced its HT bytes with
the same count, `balanced_dedup`), and the replay is then the recording.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from dbo.sim.alltoall import AllToAllEnds, collective_latency_us, pair_ends
from dbo.sim.cluster_program import (
    HOST,
    HOST_SYNC,
    HT_COMM,
    LL_LINK,
    OP,
    StreamProgram,
)
from dbo.sim.cost import GEMM_OPS
from dbo.sim.routing import Placement, Routing
from dbo.sim.traffic import LayerBytes, fair_share_ends, kept_layer_bytes

__all__ = ["CollectiveResult", "ClusterResult", "simulate_cluster"]


@dataclass
class CollectiveResult:
    """One dispatch/combine across the group: per receiving rank, who gated it and why."""

    kind: str
    mode: str
    layer: int
    ubatch: int | None
    op: int
    gate: np.ndarray  # rank whose rows arrived last at each receiver (itself: its own link)
    peer_wait_us: np.ndarray  # how long each rank's kernel waited for a peer beyond its own
    send_mb: np.ndarray  # MB each rank sent to peers
    recv_mb: np.ndarray
    rdma_mb: np.ndarray  # MB each rank received over RDMA

    def why(self, rank: int, start: np.ndarray) -> str:
        """Why `rank`'s collective ended when it did: a peer's lateness or load, or its link."""
        g = int(self.gate[rank])
        if g == rank:
            link = "RDMA" if self.rdma_mb[rank] > 0 else "NVLink"
            return f"its own link: receives {self.recv_mb[rank]:.2f} MB ({link})"
        late = float(start[g] - start[rank])
        if late > 0:
            return f"rank {g} reached it {late:.1f} us later (more work before it)"
        return f"rank {g} sends {self.send_mb[g]:.2f} MB, the largest send"


@dataclass
class ClusterResult:
    """A replayed step of R ranks: per-op start/end (ops x ranks) and per-rank figures."""

    program: StreamProgram
    start: np.ndarray
    end: np.ndarray
    collectives: list[CollectiveResult]
    routing: Routing
    placement: Placement
    expert_factor: np.ndarray  # layers x ranks: rows received relative to balanced

    @property
    def num_ranks(self) -> int:
        return int(self.start.shape[1])

    @property
    def gpus_per_node(self) -> int:
        """The recording's (its profile's): the one source of the group's node size."""
        return self.program.profile.gpus_per_node

    @property
    def origin_us(self) -> float:
        return float(self.program.issue0.min()) if self.program.num_ops else 0.0

    @property
    def step_us(self) -> np.ndarray:
        """Each rank's step time: from the step's first issue to its own last op."""
        return self.end.max(axis=0) - self.origin_us

    def busy_us(self, klass: tuple[int, ...] = (OP,), rank: int | None = None) -> np.ndarray:
        """Per rank (or for `rank` alone), the time at least one op of those classes runs
        (interval union)."""
        mask = np.isin(self.program.klass, klass)
        ranks = slice(None) if rank is None else slice(rank, rank + 1)
        return _union(self.start[mask, ranks], self.end[mask, ranks])

    @property
    def compute_busy_us(self) -> np.ndarray:
        return self.busy_us((OP,))

    @property
    def exposed_comm_us(self) -> np.ndarray:
        """Per rank, time a comm op runs while no compute does."""
        return self.exposed_comm_of()

    def exposed_comm_of(self, rank: int | None = None) -> np.ndarray:
        """`exposed_comm_us` of every rank, or of `rank` alone (`plan` keeps only the
        slowest rank's, and the unions sort every column)."""
        comm = tuple(k for k in range(7) if k not in (OP, HOST, HOST_SYNC))
        return self.busy_us((OP, *comm), rank) - self.busy_us((OP,), rank)

    @property
    def peer_wait_us(self) -> np.ndarray:
        """Per rank, time its collectives spent waiting for peers' rows beyond their own."""
        total = np.zeros(self.num_ranks)
        for c in self.collectives:
            total += c.peer_wait_us
        return total

    def ranks_to_show(self) -> list[int]:
        """Every rank up to 16; else the slowest, median and fastest."""
        if self.num_ranks <= 16:
            return list(range(self.num_ranks))
        order = np.argsort(self.step_us, kind="stable")
        picks = [int(order[-1]), int(order[len(order) // 2]), int(order[0])]
        return list(dict.fromkeys(picks))


def _union(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Length of the union of intervals per column (ops x ranks)."""
    if start.size == 0:
        return np.zeros(start.shape[1] if start.ndim == 2 else 0)
    order = np.argsort(start, axis=0, kind="stable")
    s = np.take_along_axis(start, order, axis=0)
    e = np.take_along_axis(end, order, axis=0)
    reach = np.maximum.accumulate(e, axis=0)
    gaps = np.zeros(s.shape[1:])
    if len(s) > 1:  # added in op order, one column or many alike (sum() pairs one column)
        gaps = np.cumsum(np.clip(s[1:] - reach[:-1], 0.0, None), axis=0)[-1]
    return reach[-1] - s[0] - gaps


class _Links:
    """One group's links: bandwidths, latencies, and each layer's bytes per byte of copies
    (computed once per layer and kernel mode)."""

    def __init__(self, program: StreamProgram, routing: Routing, placement: Placement) -> None:
        p = self.profile = program.profile
        self.routing, self.placement = routing, placement
        # A recording whose HT bytes were priced per copy (no `ht_nvl_share`) replays so.
        self.per_copy = None if program.ht_nvl_share is not None else program.ht_rdma_share
        self.ranks, self.g = program.ep_size, p.gpus_per_node
        multi_node = self.ranks > self.g
        self.latency = {m: collective_latency_us(p, m, multi_node) for m in ("ht", "ll")}
        self.nvl_bw = p.nvlink_bytes_per_us
        self.rdma_bw = {m: p.rdma_bytes_per_us(m) for m in ("ht", "ll")}
        self._bytes: dict[tuple, LayerBytes] = {}
        self._lags: dict[tuple, np.ndarray] = {}

    def _key(self, layer: int, mode: str, ubatch: int | None) -> tuple:
        """What a layer's bytes depend on: the routing's and the placement's layer (a layer
        past their last repeats it), the kernel mode and the ubatch."""
        placed = self.placement.share.shape[0] - 1 if self.placement.share.ndim == 3 else 0
        own = ubatch if self.routing.ubatches else None  # else every ubatch routes alike
        return (min(layer, self.routing.num_layers - 1), min(layer, placed), mode, own)

    def layer(self, layer: int, mode: str, ubatch: int | None = None) -> LayerBytes:
        """The bytes of `ubatch`'s collective in MoE `layer` (its own tokens' routing)."""
        key = self._key(layer, mode, ubatch)
        if key not in self._bytes:
            r = self.routing.of_ubatch(ubatch)
            legacy = mode == "ht" and self.per_copy is not None
            b = kept_layer_bytes(
                r.layer(layer),
                self.placement.layer(layer),
                r.top_k,
                "ll" if legacy else mode,
                self.g,
                r.groups,
            )
            if legacy:  # off-node copies deduplicated by the share; the rest on NVLink
                keep = float(self.per_copy)
                b = replace(
                    b,
                    nvl_send=b.nvl_send + b.rdma_send * (1 - keep),
                    nvl_recv=b.nvl_recv + b.rdma_recv * (1 - keep),
                    rdma_send=b.rdma_send * keep,
                    rdma_recv=b.rdma_recv * keep,
                    pair_nvl=None,  # HT kernels send token by token: a pair ends with the send
                    pair_rdma=None,
                )
            self._bytes[key] = b
        return self._bytes[key]

    def wire_us(self, mode: str, nvl: np.ndarray, rdma: np.ndarray) -> np.ndarray:
        return np.maximum(nvl / self.nvl_bw, rdma / self.rdma_bw[mode])

    def ll_lag(self, layer: int, ubatch: int | None, kind: str) -> np.ndarray:
        """`_ll_pair_lag` of a low-latency collective (per byte of copies), computed once."""
        key = (*self._key(layer, "ll", ubatch), kind)
        if key not in self._lags:
            b = self.layer(layer, "ll", ubatch)
            self._lags[key] = _ll_pair_lag(b.reversed() if kind == "combine" else b, kind, self)
        return self._lags[key]


def _expert_factor(program: StreamProgram, routing: Routing, placement: Placement) -> np.ndarray:
    """Rows each rank's experts receive relative to balanced, layers x ranks."""
    layers = max(program.num_layers, 1)
    ranks = placement.num_ranks
    shares = np.stack(
        [placement.rank_shares(routing.sources(j, ranks).mean(axis=0), j) for j in range(layers)]
    )
    return shares * ranks


def _ubatch_factors(
    program: StreamProgram, routing: Routing, placement: Placement
) -> dict[int | None, np.ndarray]:
    """`_expert_factor` of each ubatch the program runs, under that ubatch's own routing."""
    return {
        u: _expert_factor(program, routing.of_ubatch(u), placement) for u in set(program.ubatch)
    }


def _scaled_work(program: StreamProgram, i: int, factor: np.ndarray) -> np.ndarray:
    """An expert op's time at `factor` times the recorded rows, per rank."""
    fixed = min(program.profile.kernel_fixed_us, float(program.work[i]))
    var = float(program.work[i]) - fixed
    if program.names[i] in GEMM_OPS:
        ws, rho = float(program.weight_share[i]), float(program.intensity[i])
        rel = np.maximum(ws + (1.0 - ws) * factor, rho * factor) / max(1.0, rho)
        return fixed + var * rel
    return fixed + var * factor


_Busy = tuple[np.ndarray, np.ndarray, float]  # an HT comm kernel's start, end, latest end


def _stretch(start: np.ndarray, work: np.ndarray, busy: list[_Busy], share: float) -> np.ndarray:
    """End of `work` of compute from `start` while HT comm kernels (intervals in `busy`, in
    start order, with their latest end) hold `share` of the SMs: progress at 1 - share
    inside each interval."""
    t, rem = start.copy(), work.copy()
    rate = 1.0 - share
    first = float(start.min())
    for cs, ce, last in busy:
        if last <= first:  # over before the op starts, on every rank: changes nothing
            continue
        before = np.maximum(cs - t, 0.0)  # not np.clip: its wrapper costs more than the math
        step = np.minimum(before, rem)
        t, rem = t + step, rem - step
        inside = np.where(t >= cs, np.maximum(ce - t, 0.0), 0.0) * rate
        step = np.minimum(inside, rem)
        t, rem = t + step / rate, rem - step
    return t + rem


def _ll_pair_lag(b: LayerBytes, kind: str, links: _Links) -> np.ndarray:
    """[p, r]: how long after p's low-latency kernel starts its last row for r leaves, per
    byte of the recording's copies. DeepEP's LL kernels give every (local expert,
    destination) pair its own sender: the combine a warp group per pair on both links, the
    dispatch a queue pair per (destination, expert) over RDMA, its puts posted at once. So a
    link is shared among the flows still sending and a small flow leaves before the sender's
    last row (`fair_share_ends`). The dispatch copies over NVLink token by token: an NVLink
    pair's last row leaves with the sender's last NVLink row."""
    rdma = fair_share_ends(b.pair_rdma) / links.rdma_bw["ll"]
    if kind == "combine":  # NVLink flows stay inside a node: share each rank's node columns
        rows = np.arange(links.ranks)[:, None]
        cols = rows // links.g * links.g + np.arange(links.g)[None, :]
        inside = cols < links.ranks
        cols = np.minimum(cols, links.ranks - 1)
        local = fair_share_ends(np.where(inside, b.pair_nvl[rows, cols], 0.0))
        nvl = np.zeros_like(b.pair_nvl)
        nvl[np.broadcast_to(rows, cols.shape)[inside], cols[inside]] = local[inside] / links.nvl_bw
    else:
        nvl = np.broadcast_to((b.pair_nvl.sum(axis=1) / links.nvl_bw)[:, None], b.pair_nvl.shape)
    return np.where(b.pair_rdma > 0, rdma, nvl)


def _collective(
    program: StreamProgram, c_index: int, links: _Links, ready: np.ndarray, port_free: np.ndarray
) -> tuple[AllToAllEnds, CollectiveResult]:
    """End times of one all-to-all on every rank (each rank's port free from `port_free`),
    and who gated each."""
    c = program.collectives[c_index]
    r = links.ranks
    b = links.layer(c.layer, c.mode, c.ubatch)
    if c.kind == "combine":  # the rows go back the way they came
        b = b.reversed()
    full = c.nbytes * r / (r - 1)  # the recording's copies, its own rank's included
    send_t = links.wire_us(c.mode, b.nvl_send * full, b.rdma_send * full)
    recv_t = links.wire_us(c.mode, b.nvl_recv * full, b.rdma_recv * full)
    lag = None if b.pair_nvl is None else links.ll_lag(c.layer, c.ubatch, c.kind) * full
    latency = links.latency[c.mode]
    one_sided = c.mode == "ll"
    ends = pair_ends(
        ready, latency, send_t, recv_t, b.sends_to, lag, one_sided=one_sided, port_free=port_free
    )
    mb = full * 1e-6
    result = CollectiveResult(
        c.kind,
        c.mode,
        c.layer,
        c.ubatch,
        c.op,
        ends.gate,
        ends.peer_wait_us,
        (b.nvl_send + b.rdma_send) * mb,
        (b.nvl_recv + b.rdma_recv) * mb,
        b.rdma_recv * mb,
    )
    return ends, result


def _check_group(program: StreamProgram, routing: Routing, placement: Placement) -> None:
    """ValueError, before any work, when the routing, placement and program disagree."""
    ranks = program.ep_size
    if placement.num_ranks != ranks:
        raise ValueError(
            f"placement {placement.label!r} spreads the experts over {placement.num_ranks} "
            f"ranks, but the step was recorded exchanging over EP {ranks}; build the placement "
            f"for {ranks} ranks"
        )
    if routing.num_experts != placement.num_experts:
        raise ValueError(
            f"routing has {routing.num_experts} experts, placement {placement.num_experts}"
        )
    if routing.num_sources not in (1, ranks):
        raise ValueError(
            f"routing {routing.label!r} has {routing.num_sources} source ranks, the group "
            f"{ranks}; give one row per rank or one for all"
        )
    runs = {u for u in program.ubatch if u is not None}
    if runs and routing.ubatches and len(routing.ubatches) != len(runs):
        raise ValueError(
            f"routing {routing.label!r} was drawn for {len(routing.ubatches)} ubatches but the "
            f"step runs {len(runs)}; sample it with one token count per ubatch of the step"
        )


def simulate_cluster(
    program: StreamProgram, routing: Routing, placement: Placement
) -> ClusterResult:
    """Replay `program` for every rank of its EP group under `routing`, its experts placed by
    `placement`; returns every op's start and end on every rank. The group's shape is the
    recording's (R = `program.ep_size`, GPUs per node its profile's); a placement over
    another rank count is refused before any op is replayed."""
    _check_group(program, routing, placement)
    ranks = program.ep_size
    links = _Links(program, routing, placement)
    factors = _ubatch_factors(program, routing, placement)
    n = program.num_ops
    start, end = np.empty((n, ranks)), np.empty((n, ranks))
    host = np.full(ranks, float(program.issue0[0]) if n else 0.0)
    busy: list[_Busy] = []
    port_free = np.full(ranks, -np.inf)  # a rank's port takes one collective's rows at a time
    collectives: list[CollectiveResult] = []
    sm_share = program.profile.comm_sms / program.profile.num_sms
    sms = _SmsTaken(program, start, end, sm_share)
    for i in range(n):
        host = _replay_op(program, i, host, start, end)
        k = program.klass[i]
        if k in (HOST, HOST_SYNC):
            continue
        ready = start[i] = sms.charged(i)
        if k in (HT_COMM, LL_LINK) and program.collective[i] >= 0 and ranks > 1:
            ends, result = _collective(program, int(program.collective[i]), links, ready, port_free)
            end[i], port_free = ends.end, ends.port_done
            collectives.append(result)
        else:
            work: float | np.ndarray = float(program.work[i])  # every rank alike
            layer = int(program.expert_layer[i])
            if layer >= 0:
                factor = factors[program.ubatch[i]]
                work = _scaled_work(program, i, factor[min(layer, len(factor) - 1)])
            if program.stretchable[i] and busy:
                end[i] = _stretch(ready, np.broadcast_to(work, ready.shape), busy, sm_share)
            else:
                end[i] = ready + work
        if k == HT_COMM:
            busy = [*busy[-2:], (start[i].copy(), end[i].copy(), float(end[i].max()))]
        sms.placed(i, host)
    whole = _expert_factor(program, routing, placement)
    return ClusterResult(program, start, end, collectives, routing, placement, whole)


class _SmsTaken:
    """Compute replayed before an HT comm kernel that runs beside it loses SMs all the same:
    its stream's next op starts that much later (as the single-rank device charges it,
    `dbo.sim.timeline.taken_from`; the recording's own charge is not replayed, see
    `cluster_program`)."""

    def __init__(self, program: StreamProgram, start: np.ndarray, end: np.ndarray, share: float):
        self.program, self.start, self.end = program, start, end
        self.rate = share / (1.0 - share)
        self.unheld: list[int] = []  # stretchable ops that a later comm kernel can still slow
        self.last_on: dict[int, int] = {}  # track -> its latest op
        self.tail: dict[int, np.ndarray] = {}  # track -> its next op's earliest start
        self.comm_tracks = sorted(set(program.track[program.klass == HT_COMM].tolist()))

    def charged(self, i: int) -> np.ndarray:
        """Op i's start, after what its stream lost to comm kernels placed since."""
        tail = self.tail.pop(int(self.program.track[i]), None)
        return self.start[i] if tail is None else np.maximum(self.start[i], tail)

    def placed(self, i: int, host: np.ndarray) -> None:
        p, track = self.program, int(self.program.track[i])
        self.last_on[track] = i
        if p.klass[i] == HT_COMM:
            self._charge(i, track, host)
        elif p.stretchable[i]:
            self.unheld.append(i)

    def _charge(self, i: int, track: int, host: np.ndarray) -> None:
        """Charge comm kernel i's SMs to the other streams' unfinished compute, as one
        (ops x ranks) array: an eager prefill step keeps thousands of ops in flight behind
        the host, and a loop per op made the replay quadratic in Python calls."""
        held = np.asarray(self.unheld, dtype=np.intp)
        tracks = self.program.track[held]
        others, on = held[tracks != track], tracks[tracks != track]
        overlap = np.minimum(self.end[others], self.end[i])
        lost = np.clip(overlap - np.maximum(self.start[others], self.start[i]), 0, None)
        lost *= self.rate
        for t in dict.fromkeys(on.tolist()):
            # cumsum adds in issue order, as a running sum per op would (same rounding).
            us = np.cumsum(lost[on == t], axis=0)[-1]
            self.tail[t] = self.tail.get(t, self.end[self.last_on[t]]) + us
        # Keep only what a later comm kernel can still overlap: it starts after the host
        # issues it and after the last op on its own stream.
        self.unheld = held[(self.end[held] > self._later_start(host)).any(axis=1)].tolist()

    def _later_start(self, host: np.ndarray) -> np.ndarray:
        """Per rank, the earliest a comm kernel not yet placed can start."""
        last = [self.last_on.get(t) for t in self.comm_tracks]
        if any(j is None for j in last):
            return host
        return np.maximum(host, np.min(self.end[last], axis=0))


def _replay_op(
    program: StreamProgram, i: int, host: np.ndarray, start: np.ndarray, end: np.ndarray
) -> np.ndarray:
    """Place op i's start (and a host op's end); returns the host clock after issuing it."""
    k = program.klass[i]
    if k == HOST_SYNC:
        start[i] = host
        waited = host
        for d in program.deps[i]:
            waited = np.maximum(waited, end[d])
        end[i] = waited
        return waited + program.host_adv[i]
    if k == HOST:
        start[i] = host
        end[i] = host + (program.end0[i] - program.start0[i])
        return host + program.host_adv[i]
    ready = host + program.floor_off[i]
    for d in program.deps[i]:
        ready = np.maximum(ready, end[d])
    start[i] = ready
    return host + program.host_adv[i]
