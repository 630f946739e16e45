"""Fidelity at scale: the published multi-GPU rows on the virtual EP group."""

from __future__ import annotations

import numpy as np
import pytest

from dbo.sim.hardware import H800
from dbo.sim.routing import eplb
from scenarios.lib.fidelity_rows import DEEPEP_RDMA_PUBLISHED
from scenarios.tools.fidelity_kernels import deepep_ll_us, normal_bandwidth_gbps
from scenarios.tools.fidelity_scale import (
    deepep_ll_cluster_us,
    deepep_normal_cluster_gbps,
    eplb_evened_load,
    sglang_group,
)


@pytest.mark.parametrize("kind", ["dispatch", "combine"])
def test_random_routing_makes_the_group_slower_than_the_balanced_formula(kind):
    for ep in (8, 64):
        assert deepep_ll_cluster_us(kind, ep) > deepep_ll_us(kind, ep)


def test_one_node_stays_close_to_the_balanced_formula():
    # 128 tokens x top-8 over 8 ranks: a sampled batch is within a few percent of balanced
    assert deepep_ll_cluster_us("dispatch", 8) == pytest.approx(
        deepep_ll_us("dispatch", 8), rel=0.05
    )


@pytest.mark.parametrize("ep", [8, 64])
def test_back_to_back_runs_cost_every_rank_the_same_period(ep):
    # every rank's LL kernel waits for every peer: whatever a rank gains in its combine it
    # waits for in its next dispatch, so dispatch + combine is the group's period on each
    # rank, and no shorter than one run started together
    period = [deepep_ll_cluster_us(k, ep, runs=12) for k in ("dispatch", "combine")]
    once = [deepep_ll_cluster_us(k, ep, runs=1) for k in ("dispatch", "combine")]
    assert sum(period) >= sum(once) * (1 - 1e-9)
    assert sum(period) == pytest.approx(sum(once), rel=0.03)


@pytest.mark.parametrize(("kind", "ep"), [("dispatch", 8), ("combine", 8), ("dispatch", 32)])
def test_normal_mode_random_routing_stays_close_to_the_balanced_group(kind, ep):
    # 4096 tokens x top-8 on each rank: its own batch is near balanced
    balanced = deepep_normal_cluster_gbps(kind, ep, random=False)
    assert deepep_normal_cluster_gbps(kind, ep) == pytest.approx(balanced, rel=0.05)


@pytest.mark.parametrize(("kind", "ep"), [("dispatch", 8), ("dispatch", 32)])
def test_random_routing_never_beats_the_balanced_normal_mode_bandwidth(kind, ep):
    assert deepep_normal_cluster_gbps(kind, ep) <= deepep_normal_cluster_gbps(
        kind, ep, random=False
    )


def test_in_one_node_the_group_counts_what_the_one_rank_formula_counts():
    one_rank, _ = normal_bandwidth_gbps("dispatch", 8, H800)
    assert deepep_normal_cluster_gbps("dispatch", 8, random=False) == pytest.approx(
        one_rank, rel=0.01
    )


@pytest.mark.parametrize(
    ("kind", "ep"), [(k, ep) for ep in DEEPEP_RDMA_PUBLISHED for k in ("dispatch", "combine")]
)
def test_deepep_s_internode_normal_bandwidths_within_10_percent_on_all_ranks(kind, ep):
    published = DEEPEP_RDMA_PUBLISHED[ep][0 if kind == "dispatch" else 1]
    assert deepep_normal_cluster_gbps(kind, ep) == pytest.approx(published, rel=0.10)


def test_the_rdma_figure_counts_the_own_node_as_deepep_s_test_does():
    # the NIC carries the remote nodes at its effective bandwidth; DeepEP's count adds the
    # own node's tokens, so the figure exceeds it (by about 4/3 over 4 nodes)
    nic = H800.rdma_gbps * H800.rdma_efficiency
    assert 1.2 * nic < deepep_normal_cluster_gbps("dispatch", 32, random=False) < 1.4 * nic


def test_sglang_s_eplb_places_by_the_long_run_load_not_by_the_batch_it_runs():
    one, other = (sglang_group("decode", 72, 32, True, seed=s) for s in (0, 1))
    assert not np.allclose(one.routing.load, other.routing.load)
    assert np.array_equal(one.placement.share, other.placement.share)


def test_sglang_s_tbo_step_routes_each_ubatch_s_own_half_of_the_serial_tokens():
    group = sglang_group("decode", 72, 32, True)
    assert group.specs[2].ubatch_tokens() == (16, 16)
    halves = [group.routing.of_ubatch(u).load for u in (0, 1)]
    assert np.allclose((halves[0] + halves[1]) / 2, group.routing.load)


@pytest.mark.parametrize("ep", [32, 72])
def test_sglang_s_long_run_load_is_one_eplb_s_replicas_even_out(ep):
    # SGLang runs 32 redundant experts because its load is skewed; on a uniform load EPLB
    # would leave some ranks whole experts and others halves, the very imbalance it exists
    # to remove
    load = eplb_evened_load(1, 256, 32).expert_load()
    ranks = eplb(load, ep, 32).rank_shares(load[0])
    assert np.allclose(ranks, 1.0 / ep)


def test_eplb_on_a_uniform_load_leaves_ep72_s_ranks_uneven():
    uniform = np.full((1, 256), 1.0 / 256)
    ranks = eplb(uniform, 72, 32).rank_shares(uniform[0])
    assert ranks.max() * 72 == pytest.approx(1.125)


def test_sglang_s_group_places_its_long_run_load_evenly_on_every_rank():
    group = sglang_group("decode", 72, 32, True)
    long_run = eplb_evened_load(1, 256, 32).expert_load()[0]
    assert np.allclose(group.placement.rank_shares(long_run), 1.0 / 72)
