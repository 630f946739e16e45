"""Virtual ranks in one process: a recorded rank's step replayed for an EP group."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from dbo.sim import SimDevice
from dbo.sim.cluster import simulate_cluster
from dbo.sim.cluster_program import record_program, tile_layers
from dbo.sim.cluster_report import (
    critical_path,
    gating_table,
    plot_cluster,
    rank_figures,
    rank_records,
    shown_window,
)
from dbo.sim.hardware import H800
from dbo.sim.options import SimOptions
from dbo.sim.routing import Routing, balanced, cap_shares, contiguous, sampled, zipf
from scenarios.lib.cluster_step import (
    StepSpec,
    dp_agreement,
    engine_knobs,
    record_step,
    routing_from_spec,
)
from scenarios.lib.simulate import simulate_step
from scenarios.model import preset


def _spec(phase: str, ep: int, n: int | None, moe_layers: int = 4, tokens: int = 0) -> StepSpec:
    config = preset("deepseek-v3", ep_size=ep, num_layers=1 + moe_layers, num_dense_layers=1)
    tokens = tokens or (64 if phase == "decode" else 8192)
    return StepSpec(config, phase, tokens, n, H800)


def _replay(spec: StepSpec, routing=None):
    program = record_step(spec)
    config = spec.config
    routing = routing or routing_from_spec("balanced", config)  # the recording's groups
    return program, simulate_cluster(
        program, routing, contiguous(config.num_experts, config.ep_size)
    )


@pytest.mark.parametrize(
    "phase,n", [("decode", 2), ("decode", None), ("prefill", 2), ("prefill", None)]
)
def test_balanced_routing_replays_the_recorded_rank_on_every_rank(phase, n):
    program, result = _replay(_spec(phase, 16, n))
    assert np.allclose(result.start, program.start0[:, None], rtol=0, atol=1e-6)
    assert np.allclose(result.end, program.end0[:, None], rtol=0, atol=1e-6)


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_balanced_replay_agrees_with_the_one_rank_simulation_at_full_depth(phase):
    spec = _spec(phase, 32, 2, moe_layers=8)
    _, result = _replay(spec)
    mode = "ll" if phase == "decode" else "ht"
    engine = engine_knobs(spec)  # the recording's GEMM SM cap and DeepEP byte shares
    one_rank = simulate_step(
        spec.config,
        spec.batch(),
        mode,
        profile=H800,
        num_ubatches=2,
        graph=phase == "decode",
        engine=engine,
    )
    assert result.step_us.max() == pytest.approx(one_rank.step_us, rel=0.02)


def test_a_deeper_model_tiles_its_steady_layer_exactly():
    full = record_step(_spec("decode", 16, 2, moe_layers=8))
    tiled = tile_layers(record_step(_spec("decode", 16, 2, moe_layers=4)), 8)
    routing = zipf(8, 256, 0.4, top_k=8, seed=3)
    a = simulate_cluster(full, routing, contiguous(256, 16)).step_us
    b = simulate_cluster(tiled, routing, contiguous(256, 16)).step_us
    assert tiled.num_ops == full.num_ops and np.allclose(a, b, rtol=1e-9)


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_skew_makes_the_step_monotonically_slower(phase):
    program = record_step(_spec(phase, 16, 2))
    steps = [
        simulate_cluster(
            program, zipf(program.num_layers, 256, s, top_k=8), contiguous(256, 16)
        ).step_us.max()
        for s in (0.0, 0.2, 0.4, 0.8)
    ]
    assert all(a < b for a, b in zip(steps, steps[1:])), steps


def _toward(layers: int, heat: float, seed: int) -> Routing:
    """Balanced mixed with a share `heat` of tokens that all want the same expert (then its
    next experts in index order), per layer, for top-8 of 256 experts in 8 groups."""
    rng = np.random.default_rng(seed)
    load = np.full((layers, 256), (1 - heat) / 256)
    for j in range(layers):
        load[j, rng.integers(256)] += heat
    return replace(Routing(cap_shares(load, 8), f"heat {heat}", 8), groups=(8, 4))


@pytest.mark.parametrize("phase", ["decode", "prefill"])
@pytest.mark.parametrize("seed", [0, 1])
def test_more_skew_never_makes_a_step_faster_up_to_every_token_wanting_one_expert(phase, seed):
    program = record_step(_spec(phase, 16, 2))
    steps = []
    for heat in (0.0, 0.1, 0.3, 0.6, 0.9, 1.0):
        result = simulate_cluster(
            program, _toward(program.num_layers, heat, seed), contiguous(256, 16)
        )
        assert np.allclose(result.expert_factor.sum(axis=1), 16)  # every row lands somewhere
        steps.append(result.step_us.max())
    assert all(a <= b * (1 + 1e-9) for a, b in zip(steps, steps[1:])), steps


def _hot(layers: int, rank: int, ranks: int = 16, heat: float = 3.0) -> Routing:
    """Balanced except the experts of `rank`, each `heat` times as popular, in every layer."""
    load = np.ones((layers, 256))
    per = 256 // ranks
    load[:, rank * per : (rank + 1) * per] *= heat
    return Routing(load / load.sum(axis=1, keepdims=True), f"hot rank {rank}")


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_the_most_loaded_rank_gates_every_combine(phase):
    program = record_step(_spec(phase, 16, 2))
    result = simulate_cluster(program, _hot(program.num_layers, 5), contiguous(256, 16))
    assert int(np.argmax(result.expert_factor.sum(axis=0))) == 5
    combines = [c for c in result.collectives if c.kind == "combine"]
    assert combines
    for c in combines:
        waiting = c.peer_wait_us > 0
        gates = set(c.gate[waiting].tolist())
        if phase == "decode":  # LL: its node's peers get its rows over NVLink, sooner
            assert waiting[8:].all() and gates == {5}
            assert c.peer_wait_us[8:].min() > c.peer_wait_us[:8].max()
        elif c.ubatch == 0:
            assert waiting.sum() == 15 and gates == {5}
        else:  # its node's ranks waited for it in ubatch 0 and hold the other node back
            assert gates and gates <= set(range(8))


def test_peers_of_a_hot_rank_wait_for_it_and_it_does_not_wait():
    program = record_step(_spec("prefill", 16, 2))
    result = simulate_cluster(
        program, zipf(program.num_layers, 256, 0.6, top_k=8), contiguous(256, 16)
    )
    hot = int(np.argmax(result.expert_factor.sum(axis=0)))
    figures = rank_figures(result)
    assert figures[hot].peer_wait_us < min(f.peer_wait_us for f in figures if f.rank != hot)


def test_a_multi_node_dispatch_is_slower_than_one_node_with_the_same_bytes():
    one_node = record_step(_spec("decode", 8, None))
    two_nodes = record_step(_spec("decode", 16, None))
    ll = [c for c in two_nodes.collectives if c.kind == "dispatch"]
    assert ll and all(c.mode == "ll" for c in ll)
    r1 = simulate_cluster(one_node, zipf(4, 256, 0.4, top_k=8), contiguous(256, 8))
    r2 = simulate_cluster(two_nodes, zipf(4, 256, 0.4, top_k=8), contiguous(256, 16))
    d1 = r1.end[ll[0].op] - r1.start[ll[0].op]
    d2 = r2.end[ll[0].op] - r2.start[ll[0].op]
    assert d2.min() > d1.max()


def _comm_beside_a_gemm(mode: str):
    """A dispatch on one stream, then a GEMM on another that runs while it does."""
    device = SimDevice(SimOptions(H800, tensor_device="meta"))
    comm, compute = device.Stream("comm"), device.Stream("compute")
    a = torch.empty(4096, 7168, device="meta", dtype=torch.bfloat16)
    w = torch.empty(7168, 7168, device="meta", dtype=torch.bfloat16)

    def step() -> None:
        with device.thread_scope(0):
            device.set_stream(comm)
            with device.comm_region("dispatch", nbytes=200_000_000, mode=mode, ep_size=16):
                pass
            device.set_stream(compute)
            a @ w

    return record_program(step, device)


@pytest.mark.parametrize("mode,slower", [("ht", True), ("ll", False)])
def test_ht_kernels_take_sms_from_the_compute_beside_them_and_ll_kernels_do_not(mode, slower):
    program = _comm_beside_a_gemm(mode)
    gemm = program.names.index("aten::mm")
    routing, placement = balanced(1, 256), contiguous(256, 16)
    held = simulate_cluster(program, routing, placement).end[gemm]
    free = replace(program, profile=replace(program.profile, comm_sms=0))
    unheld = simulate_cluster(free, routing, placement).end[gemm]
    assert (held > unheld).all() if slower else np.allclose(held, unheld)


def test_the_critical_path_runs_through_the_hot_rank():
    program = record_step(_spec("prefill", 16, 2))
    result = simulate_cluster(program, _hot(program.num_layers, 5), contiguous(256, 16))
    path = critical_path(result)
    assert path[-1].end_us == pytest.approx(result.end.max())
    experts = [s for s in path if program.expert_layer[s.op] >= 0]
    assert experts and {s.rank for s in experts} == {5}
    assert "rank 5 gates" in gating_table(result)[0]


def test_rank_records_draw_a_process_per_rank_up_to_16_else_three():
    _, small = _replay(_spec("decode", 16, 2))
    assert {r.rank for r in rank_records(small)} == set(range(16))
    _, big = _replay(_spec("decode", 32, 2))
    assert len({r.rank for r in rank_records(big)}) <= 3


def test_dp_ranks_split_only_if_every_rank_can_and_pad_to_the_largest():
    agreed = dp_agreement([64, 40, 50], 2)
    assert agreed.split and agreed.padded_tokens == 64
    assert agreed.padding_share == pytest.approx(1 - 154 / 192)
    refused = dp_agreement([64, 1], 4)
    assert not refused.split and refused.reason


def _per_ubatch(layers: int, skewed: Routing) -> Routing:
    """Ubatch 0 balanced, ubatch 1 `skewed`; the batch is their union (equal halves)."""
    even = balanced(layers, 256, 8)
    union = (even.load + skewed.load) / 2
    return Routing(union, "ubatch 0 even, 1 skewed", 8, None, (even, skewed))


def test_each_ubatch_s_collectives_move_its_own_tokens_draw():
    program = record_step(_spec("decode", 16, 2))
    routing = _per_ubatch(program.num_layers, _hot(program.num_layers, 5))
    result = simulate_cluster(program, routing, contiguous(256, 16))
    for c in result.collectives:
        if c.kind == "combine":
            uneven = c.send_mb.max() > c.send_mb.min() * 1.01
            assert uneven == (c.ubatch == 1), (c.layer, c.ubatch)


def test_a_routing_drawn_for_other_ubatches_than_the_step_runs_is_refused():
    program = record_step(_spec("decode", 16, 2))
    base = balanced(program.num_layers, 256, 8)
    routing = sampled(base, 64, 8, ranks=16, ubatches=(20, 20, 24))
    with pytest.raises(ValueError, match="drawn for 3 ubatches but the step runs 2"):
        simulate_cluster(program, routing, contiguous(256, 16))


def test_a_placement_of_another_ep_size_is_refused():
    program = record_step(_spec("decode", 16, 2))
    with pytest.raises(ValueError, match="recorded exchanging over EP 16"):
        simulate_cluster(program, balanced(4, 256, 8), contiguous(256, 8))


def test_a_routing_with_a_row_per_rank_of_another_group_is_refused():
    program = record_step(_spec("decode", 16, 2))
    routing = Routing(np.full((4, 8, 256), 1 / 256), "8 ranks' histogram", 8)
    with pytest.raises(ValueError, match="8 source ranks, the group 16"):
        simulate_cluster(program, routing, contiguous(256, 16))


def test_the_timeline_png_shows_a_window_of_middle_layers_and_names_it(tmp_path):
    _, result = _replay(_spec("decode", 16, 2, moe_layers=8))
    records = rank_records(result)
    window, shown = shown_window(records)
    assert window is not None and "MoE layers 4-5 of 8" in shown
    step = max(r.end_us for r in records) - min(r.start_us for r in records)
    assert window.end_us - window.start_us < step / 3
    assert plot_cluster(result, tmp_path / "t.png", title="decode").read_bytes()[:4] == b"\x89PNG"


def test_a_step_of_few_layers_is_drawn_whole():
    _, result = _replay(_spec("decode", 16, 2, moe_layers=2))
    window, shown = shown_window(rank_records(result))
    assert window is None and "whole step" in shown
