"""`plan`'s memory check: one rank's weights, KV cache and DeepEP buffers against its GPU."""

from __future__ import annotations

import pytest

from dbo.sim.hardware import H100, H200, H800, PROFILES
from scenarios.model_presets import preset
from scenarios.tools.plan_memory import (
    deepep_bytes,
    kv_cache_bytes,
    memory_need,
    weight_bytes,
)
from scenarios.tools.plan_output import PlanPoint
from scenarios.tools.plan_sim import answer

DSV3 = preset("deepseek-v3")


def test_every_profile_carries_its_published_hbm_capacity():
    assert (H200.hbm_gb, H100.hbm_gb, H800.hbm_gb) == (141.0, 80.0, 80.0)
    assert all(p.hbm_gb for p in PROFILES.values())


def test_mla_caches_the_latent_and_the_rope_key_per_token_and_layer():
    per_token = (DSV3.kv_lora_rank + DSV3.qk_rope_dim) * 2 * DSV3.num_layers  # bf16
    assert kv_cache_bytes(DSV3, 1000) == pytest.approx(1000 * per_token)


def test_a_rank_holds_only_its_share_of_the_routed_experts():
    expert = 3 * DSV3.hidden * DSV3.moe_inter  # FP8: one byte per weight
    moe_layers = DSV3.num_layers - DSV3.num_dense_layers
    saved = weight_bytes(DSV3, 32) - weight_bytes(DSV3, 64)
    assert saved == pytest.approx(moe_layers * (256 // 32 - 256 // 64) * expert)


def test_redundant_experts_add_their_replicas_to_each_rank():
    assert weight_bytes(DSV3, 32, redundant=32) > weight_bytes(DSV3, 32)


def test_low_latency_buffers_grow_with_the_tokens_a_rank_may_dispatch():
    small = deepep_bytes(DSV3, "decode", 64, 128, 256)
    assert deepep_bytes(DSV3, "decode", 64, 256, 256) == pytest.approx(2 * small, rel=1e-3)


def test_normal_kernels_need_an_rdma_buffer_only_across_nodes():
    inside = deepep_bytes(DSV3, "prefill", 8, 4096, 256)
    across = deepep_bytes(DSV3, "prefill", 16, 4096, 256)
    assert across > inside


def test_a_long_context_decode_batch_does_not_fit_where_a_small_one_does():
    assert memory_need(DSV3, H800, "decode", 64, 128).fits
    assert not memory_need(DSV3, H800, "decode", 64, 512).fits


def _point(tokens: int, gain: float, fits: bool) -> PlanPoint:
    return PlanPoint(
        "decode", 64, "balanced", tokens, 2, 1.0, gain, 0, 0.0, 0.0, tokens, 0.0, True, fits
    )


def test_a_point_that_does_not_fit_is_marked_and_left_out_of_the_answer():
    points = [_point(128, -5.0, True), _point(256, 10.0, False)]
    a = answer("decode", 64, "balanced", points)
    assert a.pays_from is None and a.unfit_tokens == (256,)
