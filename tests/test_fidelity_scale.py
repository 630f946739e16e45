"""Fidelity at scale: the published multi-GPU rows on the virtual EP group."""

from __future__ import annotations

import pytest

from scenarios.tools.fidelity_kernels import deepep_ll_us
from scenarios.tools.fidelity_scale import deepep_ll_cluster_us


@pytest.mark.parametrize("kind", ["dispatch", "combine"])
def test_random_routing_makes_the_group_slower_than_the_balanced_formula(kind):
    for ep in (8, 64):
        assert deepep_ll_cluster_us(kind, ep) > deepep_ll_us(kind, ep)


def test_one_node_stays_close_to_the_balanced_formula():
    # 128 tokens x top-8 over 8 ranks: a sampled batch is within a few percent of balanced
    assert deepep_ll_cluster_us("dispatch", 8) == pytest.approx(
        deepep_ll_us("dispatch", 8), rel=0.05
    )
