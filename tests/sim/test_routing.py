"""Expert routing families and placements for the virtual EP group."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dbo.sim.routing import (
    balanced,
    cap_shares,
    contiguous,
    dirichlet,
    eplb,
    from_histogram,
    sampled,
    zipf,
)


def test_balanced_routing_gives_every_expert_the_same_share():
    r = balanced(3, 8, top_k=2)
    assert np.allclose(r.load, 1 / 8) and r.imbalance() == pytest.approx(1.0)


def test_zipf_is_seeded_and_skews_more_with_a_larger_exponent():
    a, b = zipf(4, 64, 0.5, seed=1), zipf(4, 64, 0.5, seed=1)
    assert np.array_equal(a.load, b.load)
    assert zipf(4, 64, 1.0).imbalance() > a.imbalance() > zipf(4, 64, 0.0).imbalance()


def test_dirichlet_shares_sum_to_one_per_layer_and_depend_on_the_seed():
    a, b = dirichlet(5, 32, 2.0, seed=0), dirichlet(5, 32, 2.0, seed=1)
    assert np.allclose(a.load.sum(axis=1), 1.0) and not np.allclose(a.load, b.load)


def test_no_expert_gets_more_than_one_copy_of_each_token():
    shares = cap_shares(np.array([[0.9, 0.05, 0.05, 0.0]]), top_k=2)
    assert shares.max() <= 0.5 + 1e-12 and shares.sum() == pytest.approx(1.0)


def test_a_histogram_csv_with_a_header_is_read_per_layer(tmp_path):
    path = tmp_path / "h.csv"
    path.write_text("e0,e1,e2,e3\n1,1,1,1\n4,0,0,0\n")
    r = from_histogram(path, num_layers=2, num_experts=4, top_k=1)
    assert np.allclose(r.load[0], 0.25) and r.load[1, 0] == pytest.approx(1.0)


def test_a_single_row_json_histogram_applies_to_every_layer(tmp_path):
    path = tmp_path / "h.json"
    path.write_text(json.dumps({"tokens": [[3, 1]]}))
    r = from_histogram(path, num_layers=3, num_experts=2)
    assert r.num_layers == 3 and np.allclose(r.load[:, 0], 0.75)


@pytest.mark.parametrize(
    "text,match",
    [("1,2,3\n", "3 experts per row but the model has 4"), ("1,1,1,1\n" * 2, "2 layers")],
)
def test_a_histogram_of_the_wrong_shape_says_which_dimension(tmp_path, text, match):
    path = tmp_path / "h.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        from_histogram(path, num_layers=3, num_experts=4)


def test_contiguous_placement_refuses_an_ep_size_that_does_not_divide_the_experts():
    with pytest.raises(ValueError, match="does not divide the 256 experts"):
        contiguous(256, 72)


def test_eplb_replicas_flatten_the_ranks_load():
    load = zipf(1, 64, 1.0, seed=2).load[0]
    plain = contiguous(64, 8).rank_shares(load)
    redundant = eplb(load, 8, 16).rank_shares(load)
    assert redundant.sum() == pytest.approx(1.0)
    assert redundant.max() < plain.max()


def test_a_sampled_batch_routes_top_k_distinct_experts_per_token_around_the_shares():
    base = balanced(2, 64, top_k=8)
    small = sampled(base, 16, 8, seed=0)
    large = sampled(base, 20000, 8, seed=0)
    assert np.allclose(small.load.sum(axis=1), 1.0)
    assert small.imbalance() > large.imbalance() > 1.0
    assert np.abs(large.load - base.load).max() < 0.1 / 64
