"""How vLLM's workspace consumers use it (DCP attention, fused MoE, the sparse indexer, an
init-time MLA reservation, elastic EP), each asserting the memory relation that consumer relies
on, through the module-level registry as consumers use it."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from workspace import (
    WorkspaceLockedError,
    current_workspace_manager,
    init_workspace_manager,
    lock_workspace,
    reset_workspace_manager,
    unlock_workspace,
)
from workspace.testing import as_ubatch, record_allocations

# Tests here start threads: each gets this bound unless it carries its own, so a hang fails
# the test, never the whole run.
pytestmark = pytest.mark.timeout(30)

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def manager():
    reset_workspace_manager()
    yield init_workspace_manager("cpu", num_ubatches=2)
    reset_workspace_manager()


def byte_range(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = byte_range(a), byte_range(b)
    return a0 < b1 and b0 < a1


def resize_cache(buffer: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The MoE kernel's way to reuse one flat region under another shape."""
    return buffer.flatten()[: math.prod(shape)].view(shape)


# ------------------------------------------------------------------ DCP attention outputs


def test_dcp_context_and_query_outputs_alias_the_same_memory():
    num_heads, dcp_world_size, head_size = 8, 4, 64
    n_context, n_query = 48, 16
    ws = current_workspace_manager()
    (context_out,) = ws.get_simultaneous(((n_context, num_heads * dcp_world_size, head_size), BF16))
    context_out.fill_(1.0)  # the context attention result, consumed before the next call
    (query_out,) = ws.get_simultaneous(((n_query, num_heads, head_size), BF16))
    assert query_out.data_ptr() == context_out.data_ptr()
    query_out.fill_(2.0)
    assert context_out.flatten()[: query_out.numel()].eq(2.0).all()  # overwritten: aliased
    # the two large outputs never coexist: the slot holds the larger one, not the sum
    assert ws.capacity == context_out.numel() * 2


# ------------------------------------------------------------------ fused MoE buffers


def test_fused_moe_shared_region_views_alias_each_other_and_not_workspace2():
    m_chunk, m_full, n, k, top_k = 32, 64, 256, 128, 2
    workspace13_shape = (m_chunk, top_k, max(n, k))
    workspace2_shape = (m_chunk, top_k, n // 2)
    fused_out_shape = (m_full, top_k, k)
    common_numel = max(math.prod(workspace13_shape), math.prod(fused_out_shape))
    common, workspace2 = current_workspace_manager().get_simultaneous(
        ((common_numel,), BF16), (workspace2_shape, BF16)
    )
    workspace13 = resize_cache(common, workspace13_shape)
    fused_out = resize_cache(common, fused_out_shape)
    assert workspace13.data_ptr() == fused_out.data_ptr() == common.data_ptr()
    assert overlaps(workspace13, fused_out)
    assert not overlaps(common, workspace2)
    assert not overlaps(workspace13, workspace2) and not overlaps(fused_out, workspace2)
    # layout: [common | pad to 256 | workspace2]
    assert workspace2.data_ptr() - common.data_ptr() == -(-common_numel * 2 // 256) * 256


# ------------------------------------------------------------------ sparse indexer


def test_sparse_indexer_profiles_once_and_allocates_nothing_at_run():
    total_seq_lens, head_dim, radix_topk_workspace = 4096, 128, 1 << 20
    ws = current_workspace_manager()
    ws.get_simultaneous(  # profiling: reserve all three at once
        ((total_seq_lens, head_dim), torch.float8_e4m3fn),
        ((total_seq_lens, 4), torch.uint8),
        ((radix_topk_workspace,), torch.uint8),
    )
    lock_workspace()
    with record_allocations(ws) as allocations:
        for _step in range(3):  # prefill path: key and scale, sliced per chunk
            k_fp8_full, k_scale_full = ws.get_simultaneous(
                ((total_seq_lens, head_dim), torch.float8_e4m3fn),
                ((total_seq_lens, 4), torch.uint8),
            )
            for chunk in (1024, 2048, 4096):
                k_fp8 = k_fp8_full[:chunk]
                assert k_fp8.data_ptr() == k_fp8_full.data_ptr()
                assert k_scale_full[:chunk].shape == (chunk, 4)
            (topk_workspace,) = ws.get_simultaneous(  # decode path: topk only
                ((radix_topk_workspace,), torch.uint8)
            )
            assert topk_workspace.numel() == radix_topk_workspace
    assert allocations == []


# ------------------------------------------------------------------ init-time reservation


class FlashMLASparseLike:
    """Reserves its buffers in __init__ and keeps them as attributes."""

    def __init__(self, max_tokens: int, num_heads: int, head_size: int) -> None:
        self.q_concat_buffer, self.prefill_bf16_workspace = (
            current_workspace_manager().get_simultaneous(
                ((max_tokens, num_heads, head_size), BF16),
                ((max_tokens, 2 * head_size), BF16),
            )
        )


def test_init_time_reservation_held_as_attribute_is_aliased_by_later_calls():
    impl = FlashMLASparseLike(max_tokens=64, num_heads=4, head_size=32)
    (moe_scratch,) = current_workspace_manager().get_simultaneous(((64, 128), BF16))
    assert moe_scratch.data_ptr() == impl.q_concat_buffer.data_ptr()
    moe_scratch.fill_(5.0)
    assert impl.q_concat_buffer.eq(5.0).all()  # another module's call overwrote it: aliased
    assert current_workspace_manager().orphaned_bytes() == 0


def test_growth_after_the_reservation_orphans_it_and_says_so():
    """The design tension, made visible: a later, larger request replaces the slot the held
    attribute points into; the old buffer lives on (orphaned) and is counted."""
    ws = current_workspace_manager()
    impl = FlashMLASparseLike(max_tokens=64, num_heads=4, head_size=32)
    reserved = ws.capacity
    (bigger,) = ws.get_simultaneous(((4096, 128), BF16))
    assert bigger.data_ptr() != impl.q_concat_buffer.data_ptr()  # no longer aliased
    assert ws.orphaned_bytes() == reserved
    assert ws.stats().orphaning_growths == 1
    assert ws.describe_buffer(impl.q_concat_buffer.data_ptr()).live is False
    del impl
    assert ws.orphaned_bytes() == 0


# ------------------------------------------------------------------ elastic EP


def warm_up(num_experts: int) -> list[torch.Tensor]:
    """A MoE warmup on both ubatches whose scratch scales with the local expert count."""
    request = ((num_experts, 64, 128), BF16)
    results = [current_workspace_manager().get_simultaneous(request)[0]]

    def ubatch_1() -> None:
        with as_ubatch(1):
            results.append(current_workspace_manager().get_simultaneous(request)[0])

    thread = threading.Thread(target=ubatch_1)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    return results


def test_elastic_ep_unlock_grow_lock_grows_only_while_unlocked():
    ws = current_workspace_manager()
    warm_up(num_experts=8)
    lock_workspace()
    before = ws.capacity
    with pytest.raises(WorkspaceLockedError):  # scaled up but still locked: refused
        current_workspace_manager().get_simultaneous(((16, 64, 128), BF16))
    assert ws.capacity == before and len(ws.growth_history()) == 1
    unlock_workspace()
    warm_up(num_experts=16)  # re-warmup grows every slot
    lock_workspace()
    assert ws.is_locked()
    assert ws.slot_capacities() == [16 * 64 * 128 * 2] * 2 and ws.capacity > before
    assert len(ws.growth_history()) == 2
    with record_allocations(ws) as allocations:
        warm_up(num_experts=16)  # serving after the re-lock: no allocation
    assert allocations == []
