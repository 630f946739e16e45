"""The bytes DeepEP's kernels move for a layer's routing, counted as DeepEP's tests count them."""

from __future__ import annotations

import numpy as np
import pytest

from dbo.sim.routing import contiguous, zipf
from dbo.sim.traffic import balanced_dedup, fair_share_ends, layer_bytes


def _picks(shares: np.ndarray, tokens: int, k: int, groups, rng) -> np.ndarray:
    """(tokens, k) distinct experts per token drawn from `shares`, inside the top groups
    (by their best expert's score, as DeepEP's tests and group-limited routers pick them)."""
    scores = np.log(np.maximum(shares, 1e-300)) + rng.gumbel(size=(tokens, shares.size))
    if groups is not None:
        n_group, topk_group = groups
        best = scores.reshape(tokens, n_group, -1).max(axis=2)
        keep = np.argsort(-best, axis=1)[:, :topk_group]
        mask = np.zeros((tokens, n_group), bool)
        np.put_along_axis(mask, keep, True, axis=1)
        scores = np.where(np.repeat(mask, shares.size // n_group, axis=1), scores, -np.inf)
    return np.argsort(-scores, axis=1)[:, :k]


def _deepep_counts(shares, ranks, g, tokens, k, groups, seed=0):
    """Per sending rank, as DeepEP's tests count: (rows each rank receives over all senders,
    own included; (token, node) pairs each rank sends, own node included)."""
    rng = np.random.default_rng(seed)
    e = shares.shape[-1]
    recv, rdma_sent = np.zeros(ranks), np.zeros(ranks)
    for p in range(ranks):
        picks = _picks(shares[p], tokens, k, groups, rng)
        rank = picks // (e // ranks)
        for r in range(ranks):
            recv[r] += (rank == r).any(axis=1).sum()
        node = rank // g
        rdma_sent[p] = sum((node == n).any(axis=1).sum() for n in range(ranks // g))
    return recv, rdma_sent


def test_low_latency_kernels_send_every_expert_copy_bound_for_another_rank():
    shares = zipf(1, 64, 0.8, seed=1).load[0].repeat(16, axis=0)
    b = layer_bytes(shares, contiguous(64, 16).share, 1000.0, 8, "ll", 8)
    own = (shares @ contiguous(64, 16).share).diagonal()
    assert b.nvl_send + b.rdma_send == pytest.approx(1000.0 * (1 - own))
    assert (b.nvl_recv + b.rdma_recv).sum() == pytest.approx((b.nvl_send + b.rdma_send).sum())


@pytest.mark.parametrize("groups", [None, (8, 4)])
def test_normal_kernels_in_one_node_move_one_row_per_token_and_rank_as_deepep_counts(groups):
    ranks, tokens, k = 8, 512, 8
    shares = np.full((ranks, 256), 1 / 256)
    b = layer_bytes(shares, contiguous(256, ranks).share, tokens * k, k, "ht", 8, groups)
    recv, _ = _deepep_counts(shares, ranks, 8, tokens, k, groups)
    assert b.nvl_recv == pytest.approx(recv, rel=0.03)
    assert not b.rdma_send.any()


@pytest.mark.parametrize("groups", [(4, 4), (8, 4), (32, 4)])
def test_normal_kernels_across_nodes_send_one_rdma_row_per_token_and_node(groups):
    ranks, tokens, k = 32, 256, 8
    shares = np.full((ranks, 256), 1 / 256)
    b = layer_bytes(shares, contiguous(256, ranks).share, tokens * k, k, "ht", 8, groups)
    _, rdma_sent = _deepep_counts(shares, ranks, 8, tokens, k, groups)
    assert b.rdma_counted.mean() == pytest.approx(rdma_sent.mean(), rel=0.02)
    assert b.rdma_send.mean() < b.rdma_counted.mean()  # the NIC carries the remote nodes only


def test_skewed_shares_reach_fewer_ranks_per_token_within_a_few_percent():
    ranks, tokens, k = 8, 512, 8
    shares = zipf(1, 256, 0.6, seed=2).load[0].repeat(ranks, axis=0)
    b = layer_bytes(shares, contiguous(256, ranks).share, tokens * k, k, "ht", 8)
    recv, _ = _deepep_counts(shares, ranks, 8, tokens, k, None)
    assert b.nvl_recv == pytest.approx(recv, rel=0.05)


def test_a_combine_moves_a_dispatch_s_bytes_back():
    shares = zipf(1, 256, 0.5, seed=3).load[0].repeat(16, axis=0)
    b = layer_bytes(shares, contiguous(256, 16).share, 1.0, 8, "ht", 8, (8, 4))
    back = b.reversed()
    assert np.array_equal(back.nvl_send, b.nvl_recv) and np.array_equal(back.sends_to, b.sends_to.T)


def test_the_one_rank_shares_are_the_balanced_group_s_bytes():
    nvl, rdma = balanced_dedup(8, 256, 32, 8, (8, 4))
    shares = np.full((32, 256), 1 / 256)
    b = layer_bytes(shares, contiguous(256, 32).share, 1.0, 8, "ht", 8, (8, 4))
    assert b.nvl_send[0] == pytest.approx(nvl * 31 / 32)
    assert b.rdma_send[0] == pytest.approx(rdma * 24 / 32)


@pytest.mark.parametrize("seed", range(5))
def test_a_fairly_shared_link_ends_each_flow_by_its_size_and_the_largest_with_the_send(seed):
    rng = np.random.default_rng(seed)
    flows = rng.integers(0, 50, size=(6, 9)).astype(float)
    ends = fair_share_ends(flows)
    whole = flows.sum(axis=1)
    assert np.allclose(ends.max(axis=1), whole)  # the largest flow leaves with the last row
    assert (ends <= whole[:, None] + 1e-9).all() and (ends >= flows - 1e-9).all()
    for row, end in zip(flows, ends):  # a larger flow never leaves earlier
        order = np.argsort(row, kind="stable")
        assert (np.diff(end[order]) >= -1e-9).all()


def test_equal_flows_all_end_with_the_whole_send():
    assert np.allclose(fair_share_ends(np.full((3, 4), 2.0)), 8.0)
