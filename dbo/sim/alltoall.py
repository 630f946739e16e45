"""When an all-to-all ends on each rank of an EP group, given when each rank reached it and the
bytes every rank sends every other: the coupling rule of a dispatch or combine in virtual time.

A rank's collective ends when its own kernel has sent and received its bytes (NVLink inside a
node, RDMA across nodes, the two links working in parallel) *and* every peer that sends it
rows has finished sending them: that peer's last row for it leaves at the peer's own start
plus the link latency plus its whole send time (or, given per pair, the time its rows for that
rank take to leave). So the slowest sender gates the receiver, and a rank that reaches the
collective late delays everyone it sends to. A rank's port takes its rows in from when they
start coming: from its first sender's start for DeepEP's low-latency kernels, whose puts
land in a peer's buffer whether or not the peer's kernel runs (so a rank that reaches its
next dispatch late finds part of it delivered), and from the later of that and its own start
for normal kernels, whose receiving SMs drain the rows. The RDMA bytes of high-throughput
(DeepEP normal) kernels are scaled by `rdma_share`, the share of remote copies left after
per-node de-duplication.

`dbo.sim.cluster` applies this rule (`pair_ends`) to the bytes DeepEP's kernels move under
a group's routing (`dbo.sim.traffic`); a `SimDevice`
whose comm region carries its peers (`dbo.comm`'s EP group across processes) applies it to
the byte matrix the ranks exchange, so both price the same bytes the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dbo.sim.hardware import HardwareProfile

__all__ = [
    "AllToAllEnds",
    "link_time_us",
    "collective_latency_us",
    "all_to_all_ends",
    "pair_ends",
    "couple_to_peers",
]


def link_time_us(
    profile: HardwareProfile, mode: str, total: np.ndarray, rdma: np.ndarray
) -> np.ndarray:
    """Wire time of `total` bytes of which `rdma` cross nodes, NVLink and RDMA in parallel,
    under `mode`'s kernels."""
    nvl = (total - rdma) / profile.nvlink_bytes_per_us
    return np.maximum(nvl, rdma / profile.rdma_bytes_per_us(mode))


def collective_latency_us(profile: HardwareProfile, mode: str, multi_node: bool) -> float:
    """The fixed time of one dispatch or combine: DeepEP's low-latency kernels' own, else the
    link's (RDMA once the group spans nodes)."""
    if mode == "ll":
        return profile.ll_latency_us
    return profile.rdma_latency_us if multi_node else profile.nvlink_latency_us


@dataclass(frozen=True)
class AllToAllEnds:
    """Per rank: when its collective ends, what its own bytes alone would give (its port's
    backlog included), and the rank it waited for last (itself when its own link set the
    time; its first sender when that sender's late start held its port)."""

    end: np.ndarray
    own: np.ndarray
    gate: np.ndarray
    port_done: np.ndarray  # when its port has taken all its rows (the next one's `port_free`)

    @property
    def peer_wait_us(self) -> np.ndarray:
        return np.clip(self.end - self.own, 0.0, None)


def all_to_all_ends(
    profile: HardwareProfile,
    mode: str,
    ready: np.ndarray,
    traffic: np.ndarray,
    *,
    rdma_share: float = 1.0,
) -> AllToAllEnds:
    """The coupling rule (module docstring) for `ready[r]` (when rank r's kernel starts) and
    `traffic[p, r]` (bytes rank p sends rank r; the diagonal stays local and is ignored)."""
    ready = np.asarray(ready, dtype=float)
    ranks = ready.shape[0]
    traffic = np.asarray(traffic, dtype=float) * (1.0 - np.eye(ranks))
    g = profile.gpus_per_node
    node = np.arange(ranks) // g
    cross = node[:, None] != node[None, :]
    rdma = traffic * cross * (rdma_share if mode == "ht" else 1.0)
    send, recv = traffic.sum(axis=1), traffic.sum(axis=0)
    send_rdma, recv_rdma = rdma.sum(axis=1), rdma.sum(axis=0)
    latency = collective_latency_us(profile, mode, ranks > g)
    send_t = link_time_us(profile, mode, send, send_rdma)
    recv_t = link_time_us(profile, mode, recv, recv_rdma)
    return pair_ends(ready, latency, send_t, recv_t, traffic > 0, one_sided=mode == "ll")


def pair_ends(
    ready: np.ndarray,
    latency: float,
    send_t: np.ndarray,
    recv_t: np.ndarray,
    sends_to: np.ndarray,
    pair_t: np.ndarray | None = None,
    *,
    one_sided: bool = False,
    port_free: np.ndarray | None = None,
) -> AllToAllEnds:
    """The coupling rule on wire times. Rank r's own kernel ends no earlier than its start +
    `latency` + its send time. Its port takes its rows in `recv_t` once they start coming:
    `latency` after its first sender starts (`one_sided`: DeepEP's low-latency puts land
    whether or not r's kernel runs; else after r has started too), and not before the port
    has taken its previous collective's rows (`port_free`). The rows of every peer p with
    `sends_to[p, r]` land at p's start + `latency` + `pair_t[p, r]` (default: p's whole
    send time). r ends when the last of these has; waiting on a late first sender, or on
    the slowest pair, is waiting for peers."""
    ranks = ready.shape[0]
    if ranks == 0:
        empty = np.zeros(0)
        return AllToAllEnds(empty, empty, np.zeros(0, dtype=int), empty)
    starts = np.where(sends_to, ready[:, None], np.inf)  # [p, r]: when r's senders start
    first = starts.min(axis=0)
    port_from = np.where(np.isfinite(first), first, ready)
    if not one_sided:  # a normal kernel's receiving SMs drain the rows
        port_from = np.maximum(port_from, ready)
    free = np.full(ranks, -np.inf) if port_free is None else port_free
    # its own bytes alone: rows taken from the earlier of its start and its senders', so a
    # late first sender shows as waiting for peers (end - own), not as its own time
    own_port = np.maximum(np.minimum(port_from, ready) + latency, free) + recv_t
    own = np.maximum(ready + latency + send_t, own_port)
    port_done = np.maximum(port_from + latency, free) + recv_t
    lag = send_t[:, None] if pair_t is None else pair_t
    senders = np.where(sends_to, ready[:, None] + latency + lag, -np.inf)  # [p, r]: p's rows land
    from_peer = senders.max(axis=0)
    end = np.maximum(np.maximum(own, port_done), from_peer)
    gate = np.arange(ranks)
    gate = np.where(port_done > own + 1e-9, starts.argmin(axis=0), gate)
    gate = np.where(from_peer > np.maximum(own, port_done) + 1e-9, senders.argmax(axis=0), gate)
    return AllToAllEnds(end, own, gate, port_done)


def couple_to_peers(
    profile: HardwareProfile, mode: str, ready: float, peers: Any, rdma_share: float = 1.0
) -> tuple[float, float, int]:
    """One rank's side of a coupled all-to-all across processes: (end, time waited for peers,
    gating rank). `peers` has `rank` (this EP rank), `send_bytes` (what this rank sends each
    EP rank) and `exchange(values)`, an all_gather over the group returning every rank's
    values; this rank's start and `send_bytes` go out, and every rank applies
    `all_to_all_ends` to the same table. Each call is one collective on its own: a port's
    backlog from the previous one is not carried across processes (the replay carries it)."""
    table = np.asarray(peers.exchange([ready, *peers.send_bytes]), dtype=float)
    ends = all_to_all_ends(profile, mode, table[:, 0], table[:, 1:], rdma_share=rdma_share)
    me = int(peers.rank)
    return float(ends.end[me]), float(ends.peer_wait_us[me]), int(ends.gate[me])
