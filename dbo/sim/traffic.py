"""What DeepEP's kernels move between the ranks of an EP group in one MoE layer: from the
routing's traffic matrix, the bytes each rank sends and receives over NVLink and RDMA, and
which ranks send which.

- Low-latency (LL) kernels send every (token, expert) copy as its own message: rank p sends
  rank r its tokens x top_k x (p's share of copies bound for r's experts) copies, over
  NVLink inside a node and RDMA across nodes.
- Normal (HT) kernels: inside one node, a token once per destination rank, its own rank
  included, as DeepEP's tests count their NVLink bytes (`recv_x` rows per rank): the local
  leg goes through the same buffers and SMs, and `nvlink_efficiency` was read off that
  count. Across nodes, a token once per destination node over RDMA to the GPU of its
  sender's local index there, which forwards it over NVLink once per destination rank (its
  own rank included). The NIC carries the remote nodes only; DeepEP's tests count their
  RDMA bytes per (token, node) with the own node included (`num_rdma_token_sent`), which
  `LayerBytes.rdma_counted` keeps for comparing with their bandwidths. A combine moves the
  same bytes back.

How many distinct tokens reach a destination holding share c of a rank's copies: a token's
top_k picks are distinct experts, so it misses the destination with probability
prod_{i<k} (1 - c E / (E - i)) (exact for balanced routing: the hypergeometric; for skewed
shares, the same draw without replacement over experts of equal weight). Group-limited
routing (n_group G, topk_group g: a token picks its experts inside g of G groups, DeepSeek-
V3's 8 and 4; each chosen group receives about k / g of them) changes how often a node or
rank that holds whole groups, or lies inside one, is missed: computed for balanced routing,
and applied to skewed shares as the same power of the free miss probability.

`fair_share_ends` says when each of a sender's flows has left a link the flows share
fairly, all starting together: the LL kernels' (expert, destination) senders.

`balanced_dedup` is the one-rank form of the same count (the `ht_nvl_share` and
`ht_rdma_share` a `SimDevice` prices an HT region with), so a group under balanced routing
replays its recording exactly.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "LayerBytes",
    "miss_probability",
    "layer_bytes",
    "balanced_dedup",
    "fair_share_ends",
    "kept_layer_bytes",
]


def _free_miss(c: np.ndarray, top_k: int, num_experts: int) -> np.ndarray:
    """P(a token's top_k distinct picks all avoid a destination with share c of its copies)."""
    miss = np.ones_like(c, dtype=float)
    for i in range(top_k):
        miss = miss * np.clip(1.0 - c * num_experts / (num_experts - i), 0.0, 1.0)
    return miss


def _group_miss(num_experts: int, top_k: int, groups: tuple[int, int], dests: int) -> float | None:
    """Balanced routing's miss probability for one of `dests` equal destinations under
    group-limited routing, or None where the destinations do not align with the groups. A
    group is chosen for its best experts, so each chosen group receives its share of the
    token's picks, top_k / topk_group of them (at least one)."""
    n_group, topk_group = groups
    if dests % n_group == 0:
        touched = 1  # a destination inside one group
    elif n_group % dests == 0:
        touched = n_group // dests  # a destination of whole groups
    else:
        return None
    per_group = num_experts / n_group
    held = num_experts / dests / touched  # of each group it touches
    picks = max(1, round(top_k / topk_group))
    miss_in_group = 1.0
    for i in range(picks):
        miss_in_group *= max(0.0, 1.0 - held / (per_group - i))
    total = 0.0
    for j in range(0, min(touched, topk_group) + 1):
        ways = math.comb(touched, j) * math.comb(n_group - touched, topk_group - j)
        total += ways / math.comb(n_group, topk_group) * miss_in_group**j
    return total


def miss_probability(
    c: np.ndarray, top_k: int, num_experts: int, dests: int, groups: tuple[int, int] | None
) -> np.ndarray:
    """P(a token misses a destination) for shares `c` of its copies, the group being split
    into `dests` destinations (ranks or nodes) for the group-limited correction."""
    c = np.asarray(c, dtype=float)
    free = _free_miss(c, top_k, num_experts)
    if groups is None or dests <= 1:
        return free
    grouped = _group_miss(num_experts, top_k, groups, dests)
    base = float(_free_miss(np.array(1.0 / dests), top_k, num_experts))
    if grouped is None or not 0.0 < base < 1.0 or grouped <= 0.0:
        return free
    return free ** (math.log(grouped) / math.log(base))


@dataclass(frozen=True)
class LayerBytes:
    """One dispatch's bytes per rank (a combine moves them back: swap send and recv)."""

    nvl_send: np.ndarray
    nvl_recv: np.ndarray
    rdma_send: np.ndarray
    rdma_recv: np.ndarray
    sends_to: np.ndarray  # [p, r]: p has rows for r
    rdma_counted: np.ndarray | None = None  # per sender, (token, node) pairs, own node too
    pair_nvl: np.ndarray | None = None  # LL: [p, r] bytes p sends r over NVLink
    pair_rdma: np.ndarray | None = None  # LL: [p, r] bytes p sends r over RDMA

    def reversed(self) -> LayerBytes:
        return LayerBytes(
            self.nvl_recv,
            self.nvl_send,
            self.rdma_recv,
            self.rdma_send,
            self.sends_to.T,
            self.rdma_counted,
            None if self.pair_nvl is None else self.pair_nvl.T,
            None if self.pair_rdma is None else self.pair_rdma.T,
        )


def layer_bytes(
    sources: np.ndarray,
    placement: np.ndarray,
    copy_bytes: float,
    top_k: int,
    mode: str,
    gpus_per_node: int,
    groups: tuple[int, int] | None = None,
) -> LayerBytes:
    """A dispatch's bytes, every rank routing `sources[p]` (ranks x experts shares, or one row
    every rank follows) and sending `copy_bytes` for all its (token, expert) copies together
    (tokens x top_k x bytes per copy); `placement` is experts x ranks."""
    ranks = placement.shape[1]
    node = np.arange(ranks) // gpus_per_node
    nodes = int(node[-1]) + 1
    same = node[:, None] == node[None, :]
    off_diag = ~np.eye(ranks, dtype=bool)
    # [p, r]: p's share of copies bound for r (einsum: a small product BLAS threads slow down)
    c = np.einsum("pe,er->pr", np.atleast_2d(sources), placement)
    c = np.broadcast_to(c, (ranks, ranks))
    sends_to = (c > 0) & off_diag
    if mode == "ll":
        pair = copy_bytes * c * off_diag
        nvl, rdma = pair * same, pair * ~same
        return LayerBytes(
            nvl.sum(1), nvl.sum(0), rdma.sum(1), rdma.sum(0), sends_to, None, nvl, rdma
        )
    token_bytes = copy_bytes / max(int(top_k), 1)
    e = placement.shape[0]
    to_rank = token_bytes * (1.0 - miss_probability(c, top_k, e, ranks, groups))  # [p, r]
    if nodes == 1:
        return LayerBytes(
            to_rank.sum(1), to_rank.sum(0), np.zeros(ranks), np.zeros(ranks), sends_to
        )
    node_c = np.stack([c[:, node == n].sum(axis=1) for n in range(nodes)], axis=1)  # [p, n]
    counted = token_bytes * (1.0 - miss_probability(node_c, top_k, e, nodes, groups))
    to_node = counted * (node[:, None] != np.arange(nodes)[None, :])  # the NIC: remote nodes
    # Every token goes over RDMA to the GPU of its sender's local index in each node it
    # routes to, which forwards it over NVLink to the ranks there.
    local = np.arange(ranks) % gpus_per_node
    rdma_recv, nvl_send = np.zeros(ranks), np.zeros(ranks)
    for n in range(nodes):
        members = np.flatnonzero(node == n)
        forwarder = members[np.minimum(local, len(members) - 1)]  # [p]
        np.add.at(rdma_recv, forwarder, to_node[:, n])
        np.add.at(nvl_send, forwarder, to_rank[:, members].sum(axis=1))
    return LayerBytes(nvl_send, to_rank.sum(0), to_node.sum(1), rdma_recv, sends_to, counted.sum(1))


def balanced_dedup(
    top_k: int,
    num_experts: int,
    ranks: int,
    gpus_per_node: int,
    groups: tuple[int, int] | None = None,
) -> tuple[float, float]:
    """Balanced routing under HT kernels, per (token, expert) copy a rank sends other ranks:
    (the NVLink bytes, one per token and destination rank; the RDMA bytes per off-node copy,
    one per token and destination node), as `SimDevice`'s `ht_nvl_share` and
    `ht_rdma_share`."""
    if ranks <= 1 or top_k <= 0:
        return 1.0, 1.0
    placement = np.kron(np.eye(ranks), np.ones((num_experts // ranks, 1)))
    sources = np.full((ranks, placement.shape[0]), 1.0 / placement.shape[0])
    b = layer_bytes(sources, placement, 1.0, top_k, "ht", gpus_per_node, groups)
    sent = (ranks - 1) / ranks  # the copies a rank sends other ranks, per copy it routes
    off_node = (ranks - min(gpus_per_node, ranks)) / ranks
    rdma = float(b.rdma_send[0]) / off_node if off_node > 0 else 1.0
    return float(b.nvl_send[0]) / sent, rdma


def fair_share_ends(pair: np.ndarray) -> np.ndarray:
    """[p, r]: when p's flow to r has fully left, in bytes of p's link, every flow of p
    starting together and the link shared fairly among those still sending (processor
    sharing): a flow of s bytes ends after sum_j min(s_pj, s); the largest ends with p's
    whole send."""
    pair = np.asarray(pair, dtype=float)
    out = np.where(pair > 0, pair.sum(axis=1, keepdims=True), 0.0)
    # A sender whose flows are all equal ends them together, with its whole send; senders
    # with the same flows (a node's ranks under one routing row) share one sort.
    low = np.where(pair > 0, pair, np.inf).min(axis=1)
    mixed = np.flatnonzero(pair.max(axis=1) > low)
    if mixed.size == 0:
        return out
    rows = pair[mixed]
    first = np.ones(len(rows), dtype=bool)
    first[1:] = (rows[1:] != rows[:-1]).any(axis=1)
    distinct = rows[first]
    order = np.argsort(distinct, axis=1, kind="stable")
    ranked = np.take_along_axis(distinct, order, axis=1)
    n = distinct.shape[1]
    done = np.cumsum(ranked, axis=1) + ranked * (n - 1 - np.arange(n))  # sum_j min(s_j, s_k)
    ends = np.empty_like(done)
    np.put_along_axis(ends, order, done, axis=1)
    out[mixed] = ends[np.cumsum(first) - 1]
    return out


_KEPT: dict[tuple, LayerBytes] = {}
MAX_KEPT_LAYERS = 1024  # layers' bytes kept across replays (a few KB to a few MB each)


def _digest(a: np.ndarray) -> tuple:
    return (a.shape, a.dtype.str, hashlib.blake2b(np.ascontiguousarray(a).data).digest())


def kept_layer_bytes(
    sources: np.ndarray, placement: np.ndarray, top_k: int, mode: str, g: int, groups: Any
) -> LayerBytes:
    """`layer_bytes` of one layer per byte of copies, kept by the layer's content: every
    layer of a balanced routing is the same, and `plan` replays one routing for each of its
    steps (the result is read, never changed)."""
    key = (_digest(sources), _digest(placement), top_k, mode, g, groups)
    b = _KEPT.get(key)
    if b is None:
        if len(_KEPT) >= MAX_KEPT_LAYERS:
            _KEPT.clear()
        b = _KEPT[key] = layer_bytes(sources, placement, 1.0, top_k, mode, g, groups)
    return b
