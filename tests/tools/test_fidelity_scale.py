"""Fidelity at scale: the published multi-GPU rows on the virtual EP group."""

from __future__ import annotations

import pytest

from dbo.sim.hardware import H800
from scenarios.tools.fidelity_kernels import deepep_ll_us, normal_bandwidth_gbps
from scenarios.tools.fidelity_scale import deepep_ll_cluster_us, deepep_normal_cluster_gbps


@pytest.mark.parametrize("kind", ["dispatch", "combine"])
def test_random_routing_makes_the_group_slower_than_the_balanced_formula(kind):
    for ep in (8, 64):
        assert deepep_ll_cluster_us(kind, ep) > deepep_ll_us(kind, ep)


def test_one_node_stays_close_to_the_balanced_formula():
    # 128 tokens x top-8 over 8 ranks: a sampled batch is within a few percent of balanced
    assert deepep_ll_cluster_us("dispatch", 8) == pytest.approx(
        deepep_ll_us("dispatch", 8), rel=0.05
    )


@pytest.mark.parametrize(("kind", "ep"), [("dispatch", 8), ("combine", 8), ("dispatch", 32)])
def test_normal_mode_on_the_group_stays_close_to_the_one_rank_bandwidth(kind, ep):
    # 4096 tokens x top-8: a sampled batch is near balanced; RDMA at EP 32 is deduplicated
    # per node on both sides, so the two agree on bytes as well as links
    one_rank, _ = normal_bandwidth_gbps(kind, ep, H800)
    assert deepep_normal_cluster_gbps(kind, ep) == pytest.approx(one_rank, rel=0.05)


@pytest.mark.parametrize(("kind", "ep"), [("dispatch", 8), ("dispatch", 32)])
def test_random_routing_never_beats_the_balanced_normal_mode_bandwidth(kind, ep):
    one_rank, _ = normal_bandwidth_gbps(kind, ep, H800)
    assert deepep_normal_cluster_gbps(kind, ep) <= one_rank
