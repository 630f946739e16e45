"""The WorkspaceManager API that current vLLM has (lanes, persistent resources, try/reserve,
available_bytes, alloc_context), its tests' behaviours in our words, and the deliberate
differences; plus the regressions for requests that could never be allocated and for
dims that are not integers."""

from __future__ import annotations

import os
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from dbo.ubatching import bind_thread_to_ubatch
from workspace import (
    WorkspaceAllocationError,
    WorkspaceLockedError,
    WorkspaceManager,
    WorkspaceNotInitializedError,
    WorkspaceSlotError,
    current_workspace_lane,
    current_workspace_manager,
    init_workspace_manager,
    lock_workspace,
    reserve_workspace,
    reset_workspace_manager,
    use_workspace_lane,
)
from workspace.testing import failing_allocations, record_allocations

F32 = torch.float32
U8 = torch.uint8
INT64_MAX = (1 << 63) - 1


as_ubatch = bind_thread_to_ubatch  # the calling thread counts as ubatch k in the block


@pytest.fixture(autouse=True)
def fresh_registry():
    reset_workspace_manager()
    yield
    reset_workspace_manager()


def unchanged_state(m: WorkspaceManager) -> tuple:
    s = m.stats()
    return (s.capacities, s.generations, s.allocations, s.failed_growths, s.orphaned_bytes)


# ------------------------------------------------------------------ lanes


def test_lanes_do_not_alias_and_the_lane_is_restored_after_the_block():
    m = WorkspaceManager("cpu", num_ubatches=2, num_lanes=2)
    assert m.slot_capacities() == [0, 0, 0, 0]
    (target,) = m.get_simultaneous(((512,), U8))
    with use_workspace_lane(1):
        assert current_workspace_lane() == 1
        (draft,) = m.get_simultaneous(((256,), U8))
        (draft_again,) = m.get_simultaneous(((8,), U8))
    assert current_workspace_lane() == 0
    (target_again,) = m.get_simultaneous(((8,), U8))
    assert target.data_ptr() != draft.data_ptr()
    assert draft_again.data_ptr() == draft.data_ptr()
    assert target_again.data_ptr() == target.data_ptr()


def test_the_lane_is_restored_when_the_block_raises():
    with pytest.raises(KeyError), use_workspace_lane(3):
        raise KeyError("inside")
    assert current_workspace_lane() == 0


def test_lanes_compose_with_ubatches_into_one_slot_each():
    m = WorkspaceManager("cpu", num_ubatches=2, num_lanes=2)
    pointers = set()
    for k in range(2):
        with as_ubatch(k):
            for lane in range(2):
                with use_workspace_lane(lane):
                    (v,) = m.get_simultaneous(((16,), U8))
                    pointers.add(v.data_ptr())
    assert len(pointers) == 4


def test_growth_is_synchronous_within_a_lane_and_leaves_other_lanes_alone():
    m = WorkspaceManager("cpu", num_ubatches=2, num_lanes=2)
    m.get_simultaneous(((512,), U8))
    gens_lane_0 = [m.slot_generation(0), m.slot_generation(2)]
    with use_workspace_lane(1):
        m.get_simultaneous(((4096,), U8))
    # slots are numbered ubatch * num_lanes + lane: lane 0 = [0, 2], lane 1 = [1, 3]
    assert m.slot_capacities() == [512, 4096, 512, 4096]
    assert [m.slot_generation(0), m.slot_generation(2)] == gens_lane_0
    assert [g.lane for g in m.growth_history()] == [0, 1]
    assert (m.lane_capacity(0), m.lane_capacity(1)) == (512, 4096)


def test_a_lane_grown_by_one_ubatch_serves_the_other_under_lock():
    m = WorkspaceManager("cpu", num_ubatches=2, num_lanes=2)
    with use_workspace_lane(1):
        m.get_simultaneous(((1024,), F32))
    m.lock()
    with as_ubatch(1), use_workspace_lane(1):
        (v,) = m.get_simultaneous(((1024,), F32))
    assert v.numel() == 1024


def test_lock_applies_to_every_lane_and_unlock_restores_growth():
    m = WorkspaceManager("cpu", num_lanes=2)
    (buf,) = m.get_simultaneous(((256,), U8))
    m.lock()
    assert m.is_locked()
    (same,) = m.get_simultaneous(((8,), U8))
    assert same.data_ptr() == buf.data_ptr()
    with use_workspace_lane(1), pytest.raises(AssertionError, match="Workspace is locked"):
        m.get_simultaneous(((1,), U8))
    m.unlock()
    with use_workspace_lane(1):
        (grown,) = m.get_simultaneous(((512,), U8))
    assert grown.numel() == 512


def test_a_negative_lane_is_refused_before_entering():
    with pytest.raises(ValueError, match=">= 0"), use_workspace_lane(-1):
        pass


def test_a_negative_lane_is_refused_in_vllms_words_too():
    with pytest.raises(ValueError, match="non-negative"), use_workspace_lane(-1):
        pass


def test_zero_lanes_are_refused_in_vllms_words_too():
    with pytest.raises(ValueError, match="num_lanes must be >= 1 \\(at least one\\), got 0"):
        WorkspaceManager("cpu", num_lanes=0)


def test_a_lane_that_is_not_an_int_is_refused():
    with pytest.raises(TypeError, match="lane"), use_workspace_lane(True):
        pass


def test_an_unconfigured_lane_is_a_runtime_error_saying_how_many_lanes_exist():
    m = WorkspaceManager("cpu", num_lanes=1)
    with use_workspace_lane(1), pytest.raises(RuntimeError, match="is not configured") as info:
        m.get_simultaneous(((1,), U8))
    assert isinstance(info.value, WorkspaceSlotError) and "1 lane(s)" in str(info.value)


def test_an_unconfigured_lane_fails_even_for_a_signature_another_lane_cached():
    m = WorkspaceManager("cpu", num_ubatches=2, num_lanes=1)
    m.get_simultaneous(((8,), U8))
    with use_workspace_lane(1), pytest.raises(WorkspaceSlotError):
        m.get_simultaneous(((8,), U8))


@pytest.mark.parametrize(
    "value, error", [(0, ValueError), (-1, ValueError), (True, TypeError), (1.0, TypeError)]
)
def test_bad_num_lanes_is_refused_naming_it(value, error):
    with pytest.raises(error, match="num_lanes"):
        WorkspaceManager("cpu", num_lanes=value)


# ------------------------------------------------------------------ persistent resources


def test_persistent_resources_are_made_once_per_ubatch_and_lane():
    m = WorkspaceManager("cpu", num_ubatches=2, num_lanes=2)
    calls = []

    def factory():
        calls.append(1)
        return {"buffer": torch.zeros(8)}

    made = []
    for k in range(2):
        with as_ubatch(k):
            for lane in range(2):
                with use_workspace_lane(lane):
                    r = m.get_persistent_resource("scratch", factory)
                    made.append(r)
                    r["buffer"].fill_(len(made))
                    assert m.get_persistent_resource("scratch", factory) is r
                    assert len(calls) == len(made)
    assert len({r["buffer"].data_ptr() for r in made}) == 4
    assert [int(r["buffer"][0]) for r in made] == [1, 2, 3, 4]
    assert m.persistent_resource_count() == 4 and m.stats().persistent_resources == 4


def test_a_locked_manager_refuses_a_new_key_in_each_ubatch_and_lane():
    m = WorkspaceManager("cpu", num_lanes=2)
    calls = []

    def factory():
        calls.append(1)
        return object()

    first = m.get_persistent_resource("scratch", factory)
    m.lock()
    assert m.get_persistent_resource("scratch", factory) is first
    with pytest.raises(WorkspaceLockedError, match="was not allocated during warmup"):
        m.get_persistent_resource("new", factory)
    with use_workspace_lane(1):
        # lane 1 never made "scratch": refused too, naming the lane
        with pytest.raises(AssertionError, match="lane 1"):
            m.get_persistent_resource("scratch", factory)
        assert len(calls) == 1
        m.unlock()
        assert m.get_persistent_resource("scratch", factory) is not first
    assert m.get_persistent_resource("scratch", factory) is first


def test_a_persistent_resource_survives_growth_with_its_contents():
    m = WorkspaceManager("cpu", num_ubatches=2)
    kept = m.get_persistent("locks", (8,), torch.int32, zero_init=True)
    kept.fill_(7)
    ptr = kept.data_ptr()
    for size in (1 << 10, 1 << 14, 1 << 18):
        (scratch,) = m.get_simultaneous(((size,), U8))
        scratch.fill_(0)
    assert len(m.growth_history()) == 3
    again = m.get_persistent("locks", (8,), torch.int32)
    assert again is kept and again.data_ptr() == ptr and bool((again == 7).all())


def test_a_persistent_tensor_is_zeroed_once_and_refuses_another_shape_or_dtype():
    m = WorkspaceManager("cpu")
    first = m.get_persistent("locks", (8,), torch.int32, zero_init=True)
    assert torch.count_nonzero(first) == 0
    first.fill_(1)
    assert m.get_persistent("locks", [8], torch.int32, zero_init=True) is first
    assert bool((first == 1).all())
    with pytest.raises(ValueError, match="requested shape"):
        m.get_persistent("locks", (16,), torch.int32)
    with pytest.raises(ValueError, match="requested shape"):
        m.get_persistent("locks", (8,), torch.int64)
    m.lock()
    assert m.get_persistent("locks", (8,), torch.int32) is first
    with pytest.raises(AssertionError, match="was not allocated during warmup"):
        m.get_persistent("new", (8,), torch.int32)


def test_persistent_tensor_keys_do_not_collide_with_resource_keys():
    m = WorkspaceManager("cpu")
    obj = m.get_persistent_resource("k", object)
    t = m.get_persistent("k", (2,), F32)
    assert isinstance(t, torch.Tensor) and m.get_persistent_resource("k", object) is obj


def test_a_failing_factory_stores_nothing():
    m = WorkspaceManager("cpu")

    def broken():
        raise OSError("no")

    with pytest.raises(OSError):
        m.get_persistent_resource("k", broken)
    assert m.get_persistent_resource("k", lambda: 5) == 5


@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (lambda m: m.get_persistent_resource("k", 3), TypeError, "factory must be callable"),
        (lambda m: m.get_persistent_resource(["unhashable"], object), TypeError, "hashable"),
        (lambda m: m.get_persistent("k", (-1,), F32), ValueError, "get_persistent: dimension 0"),
        (lambda m: m.get_persistent("k", (True,), F32), TypeError, "get_persistent: dimension 0"),
        (lambda m: m.get_persistent("k", (2,), "f32"), TypeError, "get_persistent: the dtype"),
        (lambda m: m.get_persistent("k", (2,), F32, zero_init=1), TypeError, "zero_init"),
    ],
    ids=["factory", "key", "negative-dim", "bool-dim", "dtype", "zero_init"],
)
def test_bad_persistent_requests_are_refused_naming_the_argument(call, error, pattern):
    m = WorkspaceManager("cpu")
    with pytest.raises(error, match=pattern):
        call(m)
    assert m.persistent_resource_count() == 0


# ------------------------------------------------------------------ try_get_simultaneous, reserve

DECODE_REQUEST = (((24, 4, 8, 257), F32), ((24, 4, 256), torch.bfloat16), ((24, 4), F32))


def test_try_get_simultaneous_answers_none_when_locked_and_too_small():
    m = WorkspaceManager("cpu")
    m.lock()
    before = unchanged_state(m)
    assert m.try_get_simultaneous(*DECODE_REQUEST) is None
    assert unchanged_state(m) == before


def test_try_get_simultaneous_serves_views_when_locked_and_it_fits():
    m = WorkspaceManager("cpu")
    m.get_simultaneous(*DECODE_REQUEST)
    m.lock()
    mid, out, lse = m.try_get_simultaneous(*DECODE_REQUEST)
    assert tuple(mid.shape) == (24, 4, 8, 257) and out.dtype == torch.bfloat16
    assert tuple(lse.shape) == (24, 4)


def test_try_get_simultaneous_grows_when_unlocked():
    m = WorkspaceManager("cpu")
    (t,) = m.try_get_simultaneous(((1024,), F32))
    assert tuple(t.shape) == (1024,) and m.capacity == 4096


def test_try_get_simultaneous_still_refuses_bad_input():
    m = WorkspaceManager("cpu")
    m.lock()
    with pytest.raises(TypeError, match="dimension 0"):
        m.try_get_simultaneous(((2.0,), F32))


def test_reserve_sizes_every_ubatch_slot_and_hands_out_nothing():
    m = WorkspaceManager("cpu", num_ubatches=2)
    assert m.reserve(*DECODE_REQUEST) is None
    m.lock()
    for k in range(2):
        with as_ubatch(k):
            views = m.try_get_simultaneous(*DECODE_REQUEST)
            assert views is not None, f"ubatch {k} was not reserved"
    assert m.orphaned_bytes() == 0


def test_reserve_that_already_fits_allocates_nothing():
    m = WorkspaceManager("cpu", num_ubatches=2)
    m.reserve(((4096,), U8))
    with record_allocations(m) as sizes:
        m.reserve(((100,), U8), ((200,), U8))
    assert sizes == []


def test_reserve_while_locked_and_too_small_raises_the_locked_error():
    m = WorkspaceManager("cpu")
    m.lock()
    with pytest.raises(WorkspaceLockedError, match="Workspace is locked"):
        m.reserve(((64,), U8))


def test_reserve_sizes_only_the_callers_lane():
    m = WorkspaceManager("cpu", num_ubatches=2, num_lanes=2)
    with use_workspace_lane(1):
        m.reserve(((1024,), U8))
    assert m.slot_capacities() == [0, 1024, 0, 1024]


def test_reserve_workspace_acts_on_the_process_wide_manager():
    m = init_workspace_manager("cpu", 2)
    reserve_workspace(((2048,), U8))
    lock_workspace()
    assert m.slot_capacities() == [2048, 2048] and m.is_locked()


def test_get_simultaneous_sizes_sibling_ubatches_unlike_vllm():
    """Deliberate difference: vLLM grows only the caller's slot, so a sibling locked at 0
    bytes falls back; here the sibling was grown with it and is served."""
    m = WorkspaceManager("cpu", num_ubatches=2)
    m.get_simultaneous(((1024,), F32))
    m.lock()
    with as_ubatch(1):
        assert m.try_get_simultaneous(((128,), F32)) is not None


def test_available_bytes_is_what_the_callers_slot_serves_without_growing():
    m = WorkspaceManager("cpu", num_ubatches=2, num_lanes=2)
    assert m.available_bytes() == 0
    m.get_simultaneous(((1000,), U8))
    assert m.available_bytes() == 1024
    with use_workspace_lane(1):
        assert m.available_bytes() == 0
    with as_ubatch(1):
        assert m.available_bytes() == 1024


# ------------------------------------------------------------------ alloc_context and init


def test_alloc_context_is_entered_around_every_slot_allocation():
    inside = []

    @contextmanager
    def pool():
        inside.append("enter")
        yield
        inside.append("exit")

    m = WorkspaceManager("cpu", num_ubatches=2, alloc_context=pool)
    seen = []

    def allocate(nbytes, real):
        seen.append(inside[-1] if inside else None)
        return real(nbytes)

    with m.allocation_hook(allocate):
        m.get_simultaneous(((64,), U8))
    assert seen == ["enter", "enter"] and inside == ["enter", "exit"] * 2


def test_a_non_callable_alloc_context_is_refused():
    with pytest.raises(TypeError, match="alloc_context"):
        WorkspaceManager("cpu", alloc_context=3)


def test_stats_count_a_slot_per_ubatch_and_lane():
    m = WorkspaceManager("cpu", num_ubatches=2, num_lanes=3)
    with use_workspace_lane(2):
        m.get_simultaneous(((256,), U8))
    s = m.stats()
    assert (s.num_ubatches, s.num_lanes, s.capacities) == (2, 3, (0, 0, 256, 0, 0, 256))
    assert "6 slot(s) (2 ubatch(es) x 3 lane(s))" in s.summary()


def test_init_passes_lanes_and_alloc_context_to_the_manager():
    m = init_workspace_manager("cpu", 2, num_lanes=3)
    assert current_workspace_manager() is m
    assert (m.num_ubatches, m.num_lanes, len(m.slot_capacities())) == (2, 3, 6)


def test_current_manager_before_init_is_both_an_assertion_and_a_runtime_error():
    with pytest.raises(AssertionError, match="init_workspace_manager"):
        current_workspace_manager()
    assert issubclass(WorkspaceNotInitializedError, RuntimeError)


def test_current_manager_before_init_says_so_in_vllms_words_too():
    with pytest.raises(WorkspaceNotInitializedError, match="^WorkspaceManager not initialized"):
        current_workspace_manager()


# ------------------------------------------------------------------ requests that can never be
# allocated, and dims that are not integers: refused before any slot is touched


def test_a_total_beyond_int64_is_refused_before_the_callers_slot_is_released():
    m = WorkspaceManager("cpu", num_ubatches=2)
    (held,) = m.get_simultaneous(((1024,), U8))
    before = unchanged_state(m)
    with record_allocations(m) as sizes, pytest.raises(ValueError, match="beyond int64"):
        m.get_simultaneous(((1 << 62,), U8), ((1 << 62,), U8))
    assert sizes == [] and unchanged_state(m) == before
    assert m.orphaned_bytes() == 0 and m.describe_buffer(held.data_ptr()).live


def test_a_total_beyond_int64_is_refused_by_reserve_and_try_get_alike():
    m = WorkspaceManager("cpu")
    huge = (((1 << 62,), U8), ((1 << 62,), U8))
    with pytest.raises(ValueError, match="reserve: the request needs"):
        m.reserve(*huge)
    with pytest.raises(ValueError, match="beyond int64"):
        m.try_get_simultaneous(*huge)
    assert m.stats().allocations == 0


def physical_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_a_growth_beyond_the_devices_memory_is_refused_before_the_callers_slot_is_released():
    m = WorkspaceManager("cpu", num_ubatches=2)
    (held,) = m.get_simultaneous(((100,), U8))
    before = unchanged_state(m)
    with record_allocations(m) as sizes, pytest.raises(ValueError) as info:
        m.get_simultaneous(((1 << 62,), U8))
    message = str(info.value)
    assert "get_simultaneous" in message and "((4611686018427387904,), torch.uint8)" in message
    assert f"{2 << 62} bytes" in message and f"{physical_ram()} bytes" in message
    assert sizes == [] and unchanged_state(m) == before
    assert m.orphaned_bytes() == 0 and m.describe_buffer(held.data_ptr()).live
    held.fill_(7)  # still the caller's live slot
    (again,) = m.get_simultaneous(((100,), U8))
    assert again.data_ptr() == held.data_ptr() and int(again[99]) == 7


def test_the_device_bound_counts_every_slot_the_growth_would_resize():
    # Each slot alone fits in RAM; the lane's two slots together do not.
    per_slot = physical_ram() // 2 + (1 << 20)
    m = WorkspaceManager("cpu", num_ubatches=2)
    with record_allocations(m) as sizes, pytest.raises(ValueError, match="2 slot"):
        m.reserve(((per_slot,), U8))
    assert sizes == [] and m.slot_capacities() == [0, 0]


def test_the_device_bound_is_checked_by_try_get_simultaneous_too():
    m = WorkspaceManager("cpu")
    with pytest.raises(ValueError, match="try_get_simultaneous"):
        m.try_get_simultaneous(((1 << 62,), U8))
    assert m.stats().allocations == 0


def test_a_cuda_growth_is_bounded_by_the_devices_total_memory(monkeypatch):
    # Up to the allocation, the check needs only torch.cuda's report of the device's total.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 30, 4 << 30))
    m = WorkspaceManager("cuda:0", num_ubatches=2)
    with record_allocations(m) as sizes, pytest.raises(ValueError) as info:
        m.get_simultaneous(((3 << 30,), U8))
    assert f"{6 << 30} bytes" in str(info.value) and f"{4 << 30} bytes" in str(info.value)
    assert sizes == [] and m.slot_capacities() == [0, 0]


def test_a_meta_workspace_has_no_memory_bound():
    m = WorkspaceManager("meta", num_ubatches=2)
    (v,) = m.get_simultaneous(((1 << 62,), U8))
    assert v.shape == (1 << 62,) and m.slot_capacities() == [1 << 62] * 2


def test_an_allocation_failure_below_the_bound_orphans_the_callers_held_views_and_counts_them():
    m = WorkspaceManager("cpu", num_ubatches=2)
    (held,) = m.get_simultaneous(((4096,), U8))
    with failing_allocations(m, 2), pytest.raises(WorkspaceAllocationError):
        m.get_simultaneous(((8192,), U8))
    assert m.slot_capacities() == [4096, 4096]  # rolled back
    assert m.orphaned_bytes() == 4096 and m.orphaning_growths == 1
    assert not m.describe_buffer(held.data_ptr()).live
    del held
    assert m.orphaned_bytes() == 0


@pytest.mark.parametrize(
    "shape", [(0, 1 << 62, 4), (1 << 40, 1 << 40, 0)], ids=["zero-first", "zero-last"]
)
def test_a_zero_size_shape_whose_other_dims_overflow_is_refused_in_our_words(shape):
    m = WorkspaceManager("cpu")
    m.get_simultaneous(((64,), U8))
    before = unchanged_state(m)
    with pytest.raises(ValueError, match=r"shapes_and_dtypes\[0\].*beyond int64"):
        m.get_simultaneous((shape, F32))
    assert unchanged_state(m) == before


@pytest.mark.parametrize(
    "dim",
    [
        torch.tensor(True),
        np.array(True),
        np.bool_(True),
        torch.tensor(1.0),
        torch.tensor([1]),
        np.array([1]),
    ],
    ids=["bool-tensor", "bool-array", "numpy-bool", "float-tensor", "1-d-tensor", "1-d-array"],
)
def test_a_dim_that_is_not_an_integer_scalar_is_refused(dim):
    m = WorkspaceManager("cpu")
    m.get_simultaneous(((1, 3), F32))  # cache the int twin: the hot path must not admit it
    with pytest.raises(TypeError, match="dimension 0 .*0-d integer tensor"):
        m.get_simultaneous(((dim, 3), F32))


@pytest.mark.parametrize(
    "dim",
    [3, np.int64(3), np.int32(3), torch.tensor(3), torch.tensor(3, dtype=torch.int32), np.array(3)],
    ids=["int", "np-int64", "np-int32", "tensor", "int32-tensor", "array"],
)
def test_integer_scalars_of_every_kind_are_accepted_as_dims(dim):
    m = WorkspaceManager("cpu")
    (v,) = m.get_simultaneous(((dim, 2), F32))
    assert tuple(v.shape) == (3, 2)
