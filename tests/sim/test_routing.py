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
    assert np.allclose(a.load.sum(axis=-1), 1.0) and not np.allclose(a.load, b.load)


def test_no_expert_gets_more_than_one_copy_of_each_token():
    shares = cap_shares(np.array([[0.9, 0.05, 0.05, 0.0]]), top_k=2)
    assert shares.max() <= 0.5 + 1e-12 and shares.sum() == pytest.approx(1.0)


def test_a_histogram_csv_with_a_header_is_read_per_layer(tmp_path):
    path = tmp_path / "h.csv"
    path.write_text("e0,e1,e2,e3\n1,1,1,1\n4,0,0,0\n")
    r = from_histogram(path, num_layers=2, num_experts=4, top_k=1)
    load = r.expert_load()
    assert np.allclose(load[0], 0.25) and load[1, 0] == pytest.approx(1.0)


def test_a_single_row_json_histogram_applies_to_every_layer(tmp_path):
    path = tmp_path / "h.json"
    path.write_text(json.dumps({"tokens": [[3, 1]]}))
    r = from_histogram(path, num_layers=3, num_experts=2)
    assert r.num_layers == 3 and np.allclose(r.expert_load()[:, 0], 0.75)


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
    load = zipf(1, 64, 1.0, seed=2).expert_load()[0]
    plain = contiguous(64, 8).rank_shares(load)
    redundant = eplb(load, 8, 16).rank_shares(load)
    assert redundant.sum() == pytest.approx(1.0)
    assert redundant.max() < plain.max()


def test_a_sampled_batch_routes_top_k_copies_per_token_around_the_shares():
    base = balanced(2, 64, top_k=8)
    small = sampled(base, 16, 8, seed=0)
    large = sampled(base, 20000, 8, seed=0)
    assert np.allclose(small.load.sum(axis=-1), 1.0)
    assert small.imbalance() > large.imbalance() > 1.0
    assert np.abs(large.load - base.load).max() < 0.1 / 64


def test_each_rank_samples_its_own_tokens_seeded():
    base = balanced(3, 256, top_k=8)
    a = sampled(base, 128, 8, ranks=16, seed=4)
    again = sampled(base, 128, 8, ranks=16, seed=4)
    assert a.load.shape == (3, 16, 256) and np.array_equal(a.load, again.load)
    assert not np.allclose(a.load[:, 0], a.load[:, 1])  # two ranks, two batches


def test_the_group_load_evens_out_as_more_ranks_route_their_own_tokens():
    base = balanced(4, 256, top_k=8)
    one_draw = sampled(base, 128, 8, seed=0)  # every rank routing the same batch
    group = sampled(base, 128, 8, ranks=64, seed=0)
    assert group.imbalance() < 1.2 < one_draw.imbalance()


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("split", [(8, 8), (3, 13), (5, 5, 6)])
def test_the_ubatches_routed_rows_sum_to_the_serial_step_s_per_rank(seed, split):
    base = zipf(2, 64, 0.8, top_k=8, seed=seed)
    batch = sampled(base, sum(split), 8, ranks=4, seed=seed, ubatches=split)
    rows = sum(batch.of_ubatch(u).load * t * 8 for u, t in enumerate(split))
    assert len(batch.ubatches) == len(split)
    assert np.allclose(rows, batch.load * sum(split) * 8)


def test_each_ubatch_routes_its_own_draw_so_it_is_more_uneven_than_the_whole():
    base = balanced(6, 256, top_k=8)
    batch = sampled(base, 64, 8, ranks=8, seed=1, ubatches=(32, 32))
    first, second = batch.of_ubatch(0), batch.of_ubatch(1)
    assert not np.allclose(first.load, second.load)
    assert min(first.imbalance(), second.imbalance()) > batch.imbalance()


def test_a_batch_drawn_whole_routes_every_ubatch_as_itself():
    batch = sampled(balanced(1, 64, top_k=8), 32, 8, ranks=2, seed=0)
    assert batch.of_ubatch(0) is batch and batch.of_ubatch(None) is batch


def test_ubatch_token_counts_that_miss_the_batch_are_refused():
    with pytest.raises(ValueError, match="sum to the batch"):
        sampled(balanced(1, 64, top_k=8), 32, 8, ubatches=(16, 8))


def test_a_per_rank_histogram_csv_gives_a_source_row_per_rank(tmp_path):
    path = tmp_path / "h.csv"
    path.write_text("layer,rank,e0,e1\n0,0,3,1\n0,1,1,3\n1,0,1,1\n1,1,1,1\n")
    r = from_histogram(path, num_layers=2, num_experts=2)
    assert r.num_sources == 2 and r.load[0, 1, 1] == pytest.approx(0.75)
    assert np.allclose(r.sources(1, 2), 0.5)


@pytest.mark.parametrize("seed", range(40))
def test_capping_never_loses_a_row_however_strong_the_skew(seed):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 9))
    raw = rng.dirichlet(np.full(32, 10.0 ** rng.uniform(-3, 1)), size=4)
    raw[0, rng.integers(0, 32, size=3)] = 0.0  # experts nobody picks
    raw[1] = 0.0
    raw[1, : max(k - 2, 1)] = 1.0  # fewer popular experts than a token picks
    capped = cap_shares(raw / raw.sum(axis=1, keepdims=True), k)
    assert np.allclose(capped.sum(axis=1), 1.0)
    assert capped.max() <= 1 / k + 1e-12


def test_capping_moves_the_excess_to_the_next_experts_in_popularity_order():
    capped = cap_shares(np.array([[0.1, 0.7, 0.15, 0.05, 0.0]]), top_k=4)
    assert capped[0] == pytest.approx([0.25, 0.25, 0.25, 0.25, 0.0])
    capped = cap_shares(np.array([[0.1, 0.6, 0.2, 0.1]]), top_k=2)
    assert capped[0] == pytest.approx([0.1, 0.5, 0.3, 0.1])


def test_eplb_places_each_layer_by_its_own_load():
    load = zipf(2, 64, 1.2, seed=5).expert_load()
    placement = eplb(load, 8, 8)
    assert placement.share.shape == (2, 64, 8)
    for j in range(2):
        rank_load = load[j] @ placement.layer(j)
        assert rank_load.max() < (load[j] @ placement.layer(1 - j)).max()


@pytest.mark.parametrize("seed", range(30))
def test_eplb_is_never_heavier_on_its_busiest_rank_than_contiguous(seed):
    rng = np.random.default_rng(seed)
    experts, ranks = 64, int(rng.choice([4, 8, 16]))
    redundant = ranks * int(rng.integers(0, 3))
    family = [
        lambda: rng.dirichlet(np.full(experts, 10.0 ** rng.uniform(-1, 1))),
        lambda: rng.integers(0, 100, size=experts).astype(float) + 1e-9,
        lambda: 1.0 / (1 + rng.permutation(experts)) ** rng.uniform(0, 2),
    ][seed % 3]
    load = np.stack([family() for _ in range(3)])
    load = load / load.sum(axis=1, keepdims=True)
    placement, plain = eplb(load, ranks, redundant), contiguous(experts, ranks)
    for j in range(3):
        assert (load[j] @ placement.layer(j)).max() <= (load[j] @ plain.share).max() + 1e-12
        assert np.allclose(placement.layer(j).sum(axis=1), 1.0)  # every expert's rows served


def test_a_per_rank_json_histogram_is_a_list_of_per_rank_lists_per_layer(tmp_path):
    path = tmp_path / "h.json"
    path.write_text(json.dumps([[[1, 3], [3, 1], [2, 2]]]))
    r = from_histogram(path, num_layers=2, num_experts=2)
    assert r.load.shape == (2, 3, 2) and np.allclose(r.expert_load(), 0.5)
