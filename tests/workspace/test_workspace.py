"""WorkspaceManager behaviour, one behaviour per test: layout, slots, growth, lock, errors,
diagnostics, orphans, the module-level registry, and the hot path."""

from __future__ import annotations

import gc
import inspect
import logging
import math
import threading
import types
import warnings
import weakref
from dataclasses import FrozenInstanceError
from itertools import accumulate

import numpy as np
import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import dbo.ubatching
import workspace
from dbo.ubatching import bind_thread_to_ubatch
from workspace import (
    ALIGNMENT,
    BufferInfo,
    GrowthRecord,
    WorkspaceAllocationError,
    WorkspaceLockedError,
    WorkspaceManager,
    WorkspaceNotInitializedError,
    WorkspaceSlotError,
    WorkspaceStats,
    current_workspace_manager,
    init_workspace_manager,
    is_workspace_manager_initialized,
    lock_workspace,
    reset_workspace_manager,
    unlock_workspace,
    use_workspace_lane,
)
from workspace.testing import InjectedAllocationError, failing_allocations, record_allocations

# Tests here start threads: each gets this bound unless it carries its own, so a hang fails
# the test, never the whole run.
pytestmark = pytest.mark.timeout(30)

F32 = torch.float32
U8 = torch.uint8


as_ubatch = bind_thread_to_ubatch  # the calling thread counts as ubatch k in the block


def run_as_ubatch(k: int, fn, *args):
    """Run fn in a fresh thread registered as ubatch k; return its result or raise its error."""
    box: dict = {}

    def body():
        with as_ubatch(k):
            try:
                box["result"] = fn(*args)
            except BaseException as exc:  # handed to the test thread below
                box["error"] = exc

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "ubatch thread did not finish"
    if "error" in box:
        raise box["error"]
    return box["result"]


@pytest.fixture(autouse=True)
def fresh_registry():
    reset_workspace_manager()
    yield
    reset_workspace_manager()


def storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


# ------------------------------------------------------------------ layout


def test_views_have_exactly_the_requested_shape_and_dtype_and_are_contiguous():
    m = WorkspaceManager("cpu")
    views = m.get_simultaneous(((2, 3), torch.float16), ((5,), torch.int64), ((), torch.bfloat16))
    assert [(tuple(v.shape), v.dtype) for v in views] == [
        ((2, 3), torch.float16),
        ((5,), torch.int64),
        ((), torch.bfloat16),
    ]
    assert all(v.is_contiguous() for v in views)


def test_regions_start_on_256_byte_boundaries_at_running_sum_offsets():
    m = WorkspaceManager("cpu")
    request = (((3,), F32), ((300,), U8), ((64,), F32), ((1,), torch.int64))
    views = m.get_simultaneous(*request)
    sizes = [math.prod(s) * d.itemsize for s, d in request]  # 12, 300, 256, 8
    expected = list(accumulate([0] + [-(-n // 256) * 256 for n in sizes[:-1]]))
    assert [v.data_ptr() - views[0].data_ptr() for v in views] == expected == [0, 256, 768, 1024]
    assert ALIGNMENT == 256


def test_slot_capacity_is_the_sum_of_rounded_regions():
    m = WorkspaceManager("cpu")
    m.get_simultaneous(((3,), F32), ((300,), U8))
    assert m.capacity == 256 + 512


def test_views_share_the_slot_storage():
    m = WorkspaceManager("cpu")
    a, b = m.get_simultaneous(((4,), F32), ((8,), U8))
    slot = m.slot_buffers()[0]
    assert storage_ptr(a) == storage_ptr(b) == slot.data_ptr
    assert a.data_ptr() == slot.data_ptr


def test_every_call_starts_at_offset_zero_so_later_calls_alias_earlier_views():
    m = WorkspaceManager("cpu")
    (first,) = m.get_simultaneous(((16,), F32))
    first.fill_(1.0)
    (second,) = m.get_simultaneous(((4, 4), F32))
    assert second.data_ptr() == first.data_ptr()
    second.fill_(7.0)
    assert torch.equal(first, torch.full((16,), 7.0))


def test_repeated_signature_returns_fresh_tensor_objects():
    m = WorkspaceManager("cpu")
    (a,) = m.get_simultaneous(((2, 3), F32))
    a.unsqueeze_(0)  # metadata change on one result must not leak into the next
    (b,) = m.get_simultaneous(((2, 3), F32))
    assert b is not a and tuple(b.shape) == (2, 3) and b.data_ptr() == a.data_ptr()


def test_shapes_as_tuple_list_and_torch_size_give_the_same_views():
    m = WorkspaceManager("cpu")
    got = [
        m.get_simultaneous((shape, F32), ([5], U8))
        for shape in [(2, 3), [2, 3], torch.Size([2, 3])]
    ]
    for views in got:
        assert tuple(views[0].shape) == (2, 3) and tuple(views[1].shape) == (5,)
        assert [v.data_ptr() for v in views] == [v.data_ptr() for v in got[0]]


def test_numpy_integer_dims_are_accepted():
    m = WorkspaceManager("cpu")
    for _ in range(2):  # second time through the cached-signature path
        (v,) = m.get_simultaneous(((np.int64(3), np.int32(2)), F32))
        assert tuple(v.shape) == (3, 2)


def test_zero_element_shapes_are_allowed_and_need_no_allocation():
    m = WorkspaceManager("cpu")
    with record_allocations(m) as allocs:
        a, b = m.get_simultaneous(((0, 7), F32), ((0,), U8))
    assert tuple(a.shape) == (0, 7) and tuple(b.shape) == (0,) and allocs == []


def test_zero_element_region_between_others_takes_no_space():
    m = WorkspaceManager("cpu")
    a, empty, c = m.get_simultaneous(((4,), F32), ((0,), F32), ((4,), F32))
    assert empty.numel() == 0 and c.data_ptr() - a.data_ptr() == 256 and m.capacity == 512


def test_no_pairs_at_all_returns_an_empty_list():
    m = WorkspaceManager("cpu")
    assert m.get_simultaneous() == [] and m.get_simultaneous() == []


def test_views_made_in_inference_mode_are_usable_in_place_outside_it():
    m = WorkspaceManager("cpu")
    with torch.inference_mode():
        (a,) = m.get_simultaneous(((4,), F32))
    a.add_(1.0)  # an inference tensor would refuse this outside inference mode
    (b,) = m.get_simultaneous(((4,), F32))
    b.zero_()
    assert not a.is_inference() and not b.is_inference()


# ------------------------------------------------------------------ slots per ubatch


def test_each_ubatch_id_gets_its_own_slot():
    m = WorkspaceManager("cpu", num_ubatches=2)
    (mine,) = m.get_simultaneous(((64,), F32))
    mine.fill_(3.0)
    (theirs,) = run_as_ubatch(1, m.get_simultaneous, ((64,), F32))
    theirs.fill_(-1.0)
    assert storage_ptr(mine) != storage_ptr(theirs)
    assert torch.equal(mine, torch.full((64,), 3.0))
    assert m.describe_buffer(theirs.data_ptr()).slot == 1
    assert m.describe_buffer(mine.data_ptr()).slot == 0


def test_unregistered_thread_uses_slot_zero():
    m = WorkspaceManager("cpu", num_ubatches=2)
    (v,) = m.get_simultaneous(((8,), F32))
    assert m.describe_buffer(v.data_ptr()).slot == 0


def test_ubatch_id_beyond_num_ubatches_says_to_init_with_more_ubatches():
    m = WorkspaceManager("cpu", num_ubatches=2)
    with pytest.raises(WorkspaceSlotError, match=r"ubatch id 2 .*num_ubatches=2.*more ubatches"):
        run_as_ubatch(2, m.get_simultaneous, ((8,), F32))


def test_ubatch_id_beyond_num_ubatches_fails_even_for_a_cached_signature():
    m = WorkspaceManager("cpu", num_ubatches=1)
    m.get_simultaneous(((8,), F32))
    with pytest.raises(WorkspaceSlotError):
        run_as_ubatch(1, m.get_simultaneous, ((8,), F32))


# ------------------------------------------------------------------ growth


def test_growth_is_synchronous_across_all_slots():
    m = WorkspaceManager("cpu", num_ubatches=3)
    run_as_ubatch(2, m.get_simultaneous, ((1000,), U8))
    assert m.slot_capacities() == [1024, 1024, 1024]
    assert [m.slot_generation(k) for k in range(3)] == [1, 1, 1]
    m.get_simultaneous(((5000,), U8))
    assert m.slot_capacities() == [5120] * 3
    assert [m.slot_generation(k) for k in range(3)] == [2, 2, 2]


def test_growth_is_to_the_requested_total():
    m = WorkspaceManager("cpu", num_ubatches=2)
    m.get_simultaneous(((100,), U8), ((300,), U8))
    assert m.slot_capacities() == [256 + 512] * 2


def test_a_fitting_request_allocates_nothing():
    m = WorkspaceManager("cpu", num_ubatches=2)
    m.get_simultaneous(((4096,), U8))
    with record_allocations(m) as allocs:
        m.get_simultaneous(((10,), F32), ((20,), torch.int16))
        m.get_simultaneous(((4096,), U8))
        run_as_ubatch(1, m.get_simultaneous, ((1024,), F32))
    assert allocs == []


def test_growth_releases_each_old_buffer_before_allocating_its_replacement():
    m = WorkspaceManager("cpu", num_ubatches=2)
    events: list[tuple[str, int]] = []
    refs: list[StorageWeakRef] = []

    def traced(nbytes, allocate):
        # Which earlier buffers are really gone (memory, not just the Python object)?
        events.append(("alloc", nbytes, tuple(r.expired() for r in refs)))
        buffer = allocate(nbytes)
        refs.append(StorageWeakRef(buffer.untyped_storage()))
        weakref.finalize(buffer, events.append, ("free", nbytes))
        return buffer

    with m.allocation_hook(traced):
        m.get_simultaneous(((1024,), U8))
        m.get_simultaneous(((4096,), U8))
    assert events == [
        ("alloc", 1024, ()),
        ("alloc", 1024, (False,)),
        ("free", 1024),
        ("alloc", 4096, (True, False)),  # slot 0's old buffer is gone before its new one
        ("free", 1024),
        ("alloc", 4096, (True, True, False)),
    ]


def test_growth_history_records_caller_sizes_and_slot_count():
    m = WorkspaceManager("cpu", num_ubatches=2)
    m.get_simultaneous(((1024,), U8))
    line = inspect.currentframe().f_lineno + 1
    m.get_simultaneous(((2048,), U8))
    history = m.growth_history()
    assert history == [
        GrowthRecord(history[0].caller, 0, 1024, 2, 0, step="an unlabelled serial run"),
        GrowthRecord(
            f"test_workspace.py:{line}:test_growth_history_records_caller_sizes_and_slot_count",
            1024,
            2048,
            2,
            0,
            step="an unlabelled serial run",
        ),
    ]
    with pytest.raises(FrozenInstanceError):
        history[0].new_bytes = 1


def test_synchronous_growth_serves_a_slot_that_only_another_ubatch_warmed():
    """The measurement behind the design choice: warm up with the big shape on ubatch 0 only,
    lock, then ubatch 1 gets that shape (the next step splits tokens the other way)."""
    m = WorkspaceManager("cpu", num_ubatches=2)
    big = ((4096, 64), torch.bfloat16)
    m.get_simultaneous(big)
    run_as_ubatch(1, m.get_simultaneous, ((64, 64), torch.bfloat16))
    m.lock()
    (v,) = run_as_ubatch(1, m.get_simultaneous, big)
    assert tuple(v.shape) == (4096, 64)


def test_synchronous_growth_per_slot_growth_would_fail_the_same_locked_request():
    """The alternative (grow only the caller's slot) measured on the same warmup: it leaves
    slot 1 undersized at lock time, so the same locked request fails."""

    class PerSlotGrowth(WorkspaceManager):
        def _grow(self, lane, new_bytes, caller):
            k = dbo.ubatching.dbo_current_ubatch_id()
            self._views[lane] = {j: {} for j in range(self.num_ubatches)}
            self._store.release(k)
            self._store.install(k, new_bytes)

    m = PerSlotGrowth("cpu", num_ubatches=2)
    big = ((4096, 64), torch.bfloat16)
    m.get_simultaneous(big)
    run_as_ubatch(1, m.get_simultaneous, ((64, 64), torch.bfloat16))
    m.lock()
    assert m.slot_capacities() == [4096 * 64 * 2, 64 * 64 * 2]
    with pytest.raises(WorkspaceLockedError):
        run_as_ubatch(1, m.get_simultaneous, big)


# ------------------------------------------------------------------ orphans and peak


def test_a_view_held_across_growth_is_counted_as_orphaned_until_dropped():
    m = WorkspaceManager("cpu", num_ubatches=2)
    (held,) = m.get_simultaneous(((1024,), U8))
    m.get_simultaneous(((8192,), U8))
    assert m.orphaned_bytes() == 1024  # slot 0's old buffer only; slot 1's had no views
    assert m.orphaning_growths == 1
    assert m.growth_history()[-1].orphaned_bytes == 1024
    del held
    gc.collect()
    assert m.orphaned_bytes() == 0
    assert m.stats().orphaned_buffers == 0
    assert m.orphaning_growths == 1  # cumulative: it did happen


def test_growth_without_outstanding_views_orphans_nothing():
    m = WorkspaceManager("cpu", num_ubatches=2)
    m.get_simultaneous(((1024,), U8))
    m.get_simultaneous(((8192,), U8))
    assert m.orphaned_bytes() == 0 and m.orphaning_growths == 0


def test_an_alias_of_a_view_still_pins_the_old_buffer():
    m = WorkspaceManager("cpu")
    (v,) = m.get_simultaneous(((256,), F32))
    alias = v[10:20].view(torch.int32).detach()
    del v
    m.get_simultaneous(((8192,), U8))
    assert m.orphaned_bytes() == 1024
    del alias
    gc.collect()
    assert m.orphaned_bytes() == 0


def test_peak_bytes_counts_every_slot_and_orphans():
    m = WorkspaceManager("cpu", num_ubatches=2)
    (held,) = m.get_simultaneous(((1024,), U8))
    assert m.peak_bytes == 2 * 1024
    m.get_simultaneous(((4096,), U8))
    assert m.peak_bytes == 2 * 4096 + 1024  # new slots + the orphan `held` pins
    del held


def test_peak_bytes_without_orphans_is_the_new_total():
    m = WorkspaceManager("cpu", num_ubatches=2)
    m.get_simultaneous(((1024,), U8))
    m.get_simultaneous(((4096,), U8))
    assert m.peak_bytes == 2 * 4096


def test_orphans_are_reported_in_the_resize_log(monkeypatch, caplog):
    monkeypatch.setenv("DBO_DEBUG_WORKSPACE", "1")
    caplog.set_level(logging.INFO, logger="workspace")
    m = WorkspaceManager("cpu")
    (held,) = m.get_simultaneous(((2 << 20,), U8))
    m.get_simultaneous(((4 << 20,), U8))
    assert "orphaned now 2.00 MB" in caplog.records[-1].getMessage()
    del held


# ------------------------------------------------------------------ describe_buffer


def test_describe_buffer_names_the_current_slot_buffer_and_offset():
    m = WorkspaceManager("cpu", num_ubatches=2)
    a, b = run_as_ubatch(1, m.get_simultaneous, ((4,), F32), ((4,), F32))
    info = m.describe_buffer(b.data_ptr() + 3)
    assert info == BufferInfo("workspace slot 1", 1, 1, a.data_ptr(), 512, True, 256 + 3, True)


def test_describe_buffer_marks_a_replaced_buffer_not_live():
    m = WorkspaceManager("cpu")
    (held,) = m.get_simultaneous(((64,), F32))
    m.get_simultaneous(((4096,), F32))
    info = m.describe_buffer(held.data_ptr())
    assert (info.slot, info.generation, info.live, info.still_allocated) == (0, 1, False, True)
    assert m.slot_generation(0) == 2
    (fresh,) = m.get_simultaneous(((64,), F32))
    assert (
        m.describe_buffer(fresh.data_ptr()).live
        and m.describe_buffer(fresh.data_ptr()).generation == 2
    )


def test_describe_buffer_returns_none_for_a_foreign_pointer():
    m = WorkspaceManager("cpu")
    m.get_simultaneous(((64,), F32))
    other = torch.empty(64)
    assert m.describe_buffer(other.data_ptr()) is None


def test_describe_buffer_rejects_a_non_integer_pointer():
    m = WorkspaceManager("cpu")
    with pytest.raises(TypeError, match="data_ptr"):
        m.describe_buffer(1.5)


def test_slot_generation_counts_replacements_and_checks_its_argument():
    m = WorkspaceManager("cpu", num_ubatches=2)
    assert m.slot_generation(1) == 0
    m.get_simultaneous(((64,), F32))
    assert m.slot_generation(1) == 1
    with pytest.raises(ValueError, match="slot"):
        m.slot_generation(2)


# ------------------------------------------------------------------ lock


def test_lock_refuses_growth_naming_the_caller_file_line_and_function_and_sizes():
    m = WorkspaceManager("cpu")
    m.get_simultaneous(((int(12.5 * 2**20),), U8))
    m.lock()
    line = inspect.currentframe().f_lineno + 2
    with pytest.raises(WorkspaceLockedError) as info:
        m.get_simultaneous(((25 * 2**20,), U8))
    message = str(info.value)
    assert (
        f"'test_workspace.py:{line}:"
        f"test_lock_refuses_growth_naming_the_caller_file_line_and_function_and_sizes'" in message
    )
    assert "requires 25.00 MB, current size is 12.50 MB" in message
    assert "unlock_workspace()" in message


def test_locked_error_is_an_assertion_error():
    m = WorkspaceManager("cpu")
    m.lock()
    with pytest.raises(AssertionError):
        m.get_simultaneous(((8,), U8))


def test_locked_refusal_leaves_the_manager_unchanged():
    m = WorkspaceManager("cpu", num_ubatches=2)
    m.get_simultaneous(((512,), U8))
    before = m.stats()
    m.lock()
    with pytest.raises(WorkspaceLockedError):
        m.get_simultaneous(((4096,), U8))
    after = m.stats()
    assert (after.capacities, after.generations, after.growths) == (
        before.capacities,
        before.generations,
        before.growths,
    )


def test_lock_still_serves_fitting_requests_without_allocating():
    m = WorkspaceManager("cpu", num_ubatches=2)
    m.get_simultaneous(((4096,), U8))
    m.lock()
    with record_allocations(m) as allocs:
        (a,) = m.get_simultaneous(((1000,), F32))  # new signature, fits
        (b,) = run_as_ubatch(1, m.get_simultaneous, ((16, 16), torch.float16))
    assert allocs == [] and tuple(a.shape) == (1000,) and tuple(b.shape) == (16, 16)


def test_unlock_allows_growth_again():
    m = WorkspaceManager("cpu")
    m.get_simultaneous(((256,), U8))
    m.lock()
    m.unlock()
    m.get_simultaneous(((4096,), U8))
    assert m.capacity == 4096 and not m.is_locked()


def test_lock_waits_for_a_growth_in_flight():
    m = WorkspaceManager("cpu")
    entered, release = threading.Event(), threading.Event()

    def slow_allocate(nbytes, allocate):
        entered.set()
        release.wait(5)
        return allocate(nbytes)

    with m.allocation_hook(slow_allocate):
        grower = threading.Thread(target=m.get_simultaneous, args=(((4096,), U8),))
        grower.start()
        assert entered.wait(5)
        locker = threading.Thread(target=m.lock)
        locker.start()
        locker.join(0.2)
        assert locker.is_alive() and not m.is_locked()  # lock() waits for the growth
        release.set()
        grower.join(5)
        locker.join(5)
    assert m.is_locked() and m.capacity == 4096


@pytest.mark.timeout(20)
def _grow_lane_1(m: WorkspaceManager) -> None:
    with use_workspace_lane(1):
        m.get_simultaneous(((1 << 16,), U8))


def test_hot_path_takes_no_lock():
    m = WorkspaceManager("cpu", num_lanes=2)
    m.get_simultaneous(((64,), F32))
    got = []
    stuck, release = threading.Event(), threading.Event()

    def stuck_allocate(nbytes, allocate):
        stuck.set()
        release.wait(10)
        return allocate(nbytes)

    with m.allocation_hook(stuck_allocate):
        # another thread stuck growing lane 1 holds the manager's lock all along
        grower = threading.Thread(target=_grow_lane_1, args=(m,), daemon=True)
        grower.start()
        assert stuck.wait(5)
        t = threading.Thread(target=lambda: got.append(m.get_simultaneous(((64,), F32))))
        t.start()
        t.join(5)
        served = not t.is_alive() and len(got) == 1
        release.set()
        grower.join(5)
    assert served


# ------------------------------------------------------------------ debug log


def test_debug_env_logs_resize_lock_and_unlock(monkeypatch, caplog):
    monkeypatch.setenv("DBO_DEBUG_WORKSPACE", "1")
    caplog.set_level(logging.INFO, logger="workspace")
    m = WorkspaceManager("cpu", num_ubatches=2)
    line = inspect.currentframe().f_lineno + 1
    m.get_simultaneous(((int(12.5 * 2**20),), U8))
    m.lock()
    m.unlock()
    messages = [r.getMessage() for r in caplog.records if r.name == "workspace"]
    assert len(messages) == 3
    assert f"'test_workspace.py:{line}:test_debug_env_logs_resize_lock_and_unlock'" in messages[0]
    assert "0.00 MB -> 12.50 MB" in messages[0] and "2 slots" in messages[0]
    assert "total 25.00 MB" in messages[0]
    assert "locked" in messages[1] and "[12.50, 12.50] MB" in messages[1]
    assert "unlocked" in messages[2] and "[12.50, 12.50] MB" in messages[2]


def test_debug_env_logs_a_failed_growth_and_its_rollback(monkeypatch, caplog):
    monkeypatch.setenv("DBO_DEBUG_WORKSPACE", "1")
    caplog.set_level(logging.INFO, logger="workspace")
    m = WorkspaceManager("cpu", num_ubatches=2)
    m.get_simultaneous(((1 << 20,), U8))
    with failing_allocations(m, 2):
        with pytest.raises(WorkspaceAllocationError):
            m.get_simultaneous(((4 << 20,), U8))
    message = [r.getMessage() for r in caplog.records if r.name == "workspace"][-1]
    assert "to 4.00 MB per slot failed (InjectedAllocationError)" in message
    assert "rolled back to 1.00 MB (2 slots, total 2.00 MB)" in message


def test_no_debug_log_without_the_env_variable(monkeypatch, caplog):
    monkeypatch.delenv("DBO_DEBUG_WORKSPACE", raising=False)
    caplog.set_level(logging.DEBUG, logger="workspace")
    m = WorkspaceManager("cpu")
    m.get_simultaneous(((4096,), U8))
    m.lock()
    m.unlock()
    assert [r for r in caplog.records if r.name == "workspace"] == []


# ------------------------------------------------------------------ bad input

BAD_REQUESTS = [
    pytest.param(
        (((-1, 2), F32),),
        ValueError,
        r"dimension 0 .*shapes_and_dtypes\[0\].*>= 0",
        id="negative-dim",
    ),
    pytest.param(
        (((2, 2.0), F32),),
        TypeError,
        r"dimension 1 .*shapes_and_dtypes\[0\].*float",
        id="float-dim",
    ),
    pytest.param(
        (((True, 2), F32),), TypeError, r"dimension 0 .*shapes_and_dtypes\[0\].*bool", id="bool-dim"
    ),
    pytest.param(
        (((2,), F32), (("2",), F32)), TypeError, r"shapes_and_dtypes\[1\].*str", id="str-dim"
    ),
    pytest.param(
        (((2,), "float32"),),
        TypeError,
        r"dtype of shapes_and_dtypes\[0\].*torch.dtype",
        id="non-dtype",
    ),
    pytest.param(
        (((2,), np.float32),), TypeError, r"dtype of shapes_and_dtypes\[0\]", id="numpy-dtype"
    ),
    pytest.param(
        ((2, F32),), TypeError, r"shape of shapes_and_dtypes\[0\].*\(2,\)", id="int-shape"
    ),
    pytest.param(
        ((((2,), F32, 1)),),
        TypeError,
        r"shapes_and_dtypes\[0\] must be a \(shape, "
        r"dtype\) pair",
        id="three-tuple",
    ),
    pytest.param((((2,),),), TypeError, r"shapes_and_dtypes\[0\] must be a \(shape", id="1-tuple"),
    pytest.param(("ab",), TypeError, r"shapes_and_dtypes\[0\] must be a \(shape", id="string"),
    pytest.param((F32,), TypeError, r"shapes_and_dtypes\[0\] must be a \(shape", id="bare-dtype"),
    pytest.param(
        (((2,), F32), None), TypeError, r"shapes_and_dtypes\[1\] must be a \(shape", id="none-pair"
    ),
    pytest.param((((1 << 64,), U8),), ValueError, r"int64", id="dim-overflow"),
]


@pytest.mark.parametrize("request_args, error, pattern", BAD_REQUESTS)
def test_bad_request_raises_naming_the_argument_and_leaves_the_manager_intact(
    request_args, error, pattern
):
    m = WorkspaceManager("cpu", num_ubatches=2)
    (v,) = m.get_simultaneous(((64,), F32))
    before = m.stats()
    with pytest.raises(error, match=pattern):
        m.get_simultaneous(*request_args)
    after = m.stats()
    assert (after.capacities, after.generations, after.allocations) == (
        before.capacities,
        before.generations,
        before.allocations,
    )
    (again,) = m.get_simultaneous(((64,), F32))
    assert again.data_ptr() == v.data_ptr()


@pytest.mark.parametrize("dim", [2.0, True, np.float64(2.0)], ids=["float", "bool", "np-float"])
def test_a_cached_signature_does_not_admit_an_equal_non_int_dim(dim):
    m = WorkspaceManager("cpu")
    m.get_simultaneous(((2 if dim != 1 else 1, 3), F32))  # cache the int twin of the bad one
    with pytest.raises(TypeError, match="dimension 0"):
        m.get_simultaneous(((dim, 3), F32))


def test_an_allocation_torch_refuses_raises_allocation_error_chaining_torch():
    # A refusal the device bound cannot foresee (a real OOM): torch's own error, chained.
    m = WorkspaceManager("cpu", num_ubatches=2)
    m.get_simultaneous(((1024,), U8))

    def huge_above_1024(n, allocate):  # torch refuses every size above the old one
        return allocate(2**62 if n > 1024 else n)

    with m.allocation_hook(huge_above_1024):
        with pytest.raises(WorkspaceAllocationError) as info:
            m.get_simultaneous(((4096,), U8))
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, MemoryError)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "(4096 bytes)" in str(info.value)
    assert m.slot_capacities() == [1024, 1024]
    assert m.stats().failed_growths == 1
    (v,) = m.get_simultaneous(((1024,), U8))
    assert v.numel() == 1024


def test_allocation_failure_on_the_second_slot_rolls_every_slot_back():
    m = WorkspaceManager("cpu", num_ubatches=3)
    m.get_simultaneous(((1024,), U8))
    with failing_allocations(m, 2) as attempts:
        with pytest.raises(WorkspaceAllocationError) as info:
            m.get_simultaneous(((8192,), U8))
    assert isinstance(info.value.__cause__, InjectedAllocationError)
    # slot 0 grew, slot 1 failed; both re-made at the old size, slot 2 never touched
    assert attempts == [8192, 8192, 1024, 1024]
    assert m.slot_capacities() == [1024, 1024, 1024]
    assert m.growth_history()[-1].new_bytes == 1024
    views = [run_as_ubatch(k, m.get_simultaneous, ((1024,), U8))[0] for k in (1, 2)]
    assert all(v.numel() == 1024 for v in views)
    m.get_simultaneous(((8192,), U8))  # and it can still grow
    assert m.slot_capacities() == [8192] * 3


def test_a_failed_rollback_leaves_every_slot_empty_and_the_manager_usable():
    m = WorkspaceManager("cpu", num_ubatches=2)
    m.get_simultaneous(((1024,), U8))
    with failing_allocations(m, 2, 3):  # the growth's 2nd and the rollback's 1st fail
        with pytest.raises(WorkspaceAllocationError):
            m.get_simultaneous(((8192,), U8))
    assert m.slot_capacities() == [0, 0]
    (v,) = m.get_simultaneous(((512,), U8))
    assert m.slot_capacities() == [512, 512] and v.numel() == 512


def test_first_growth_failure_rolls_back_to_empty_slots():
    m = WorkspaceManager("cpu", num_ubatches=2)
    with failing_allocations(m, 2):
        with pytest.raises(WorkspaceAllocationError):
            m.get_simultaneous(((4096,), U8))
    assert m.slot_capacities() == [0, 0]


# ------------------------------------------------------------------ construction


@pytest.mark.parametrize(
    "value, error",
    [(0, ValueError), (-2, ValueError), (1.5, TypeError), (True, TypeError), ("2", TypeError)],
)
def test_bad_num_ubatches_is_refused_naming_it(value, error):
    with pytest.raises(error, match="num_ubatches"):
        WorkspaceManager("cpu", num_ubatches=value)


def test_num_ubatches_none_means_one_slot():
    assert WorkspaceManager("cpu").slot_capacities() == [0]
    assert WorkspaceManager("cpu", np.int64(3)).num_ubatches == 3


@pytest.mark.parametrize(
    "device, error",
    [
        ("not-a-device", ValueError),
        (3, TypeError),
        (None, TypeError),
        (types.SimpleNamespace(torch_device=5), TypeError),
    ],
)
def test_bad_device_is_refused_naming_it(device, error):
    with pytest.raises(error, match="device"):
        WorkspaceManager(device)


def test_device_accepts_torch_device_string_and_an_object_with_torch_device():
    assert WorkspaceManager(torch.device("cpu")).device == torch.device("cpu")
    assert WorkspaceManager("meta").device == torch.device("meta")
    fake_dbo_device = types.SimpleNamespace(torch_device=torch.device("meta"))
    assert WorkspaceManager(fake_dbo_device).device == torch.device("meta")
    assert WorkspaceManager("cuda:0").device == torch.device("cuda", 0)  # lazy: no allocation


def test_meta_device_serves_shapes_and_grows_without_memory():
    m = WorkspaceManager("meta", num_ubatches=2)
    a, b = m.get_simultaneous(((1 << 20, 1024), torch.bfloat16), ((7,), torch.int64))
    assert a.is_meta and tuple(a.shape) == (1 << 20, 1024) and b.dtype == torch.int64
    assert m.slot_capacities() == [(2 << 30) + 256] * 2
    m.lock()
    with pytest.raises(WorkspaceLockedError):
        m.get_simultaneous(((1 << 40,), U8))


def test_meta_device_describe_buffer_returns_none():
    m = WorkspaceManager("meta")
    (a,) = m.get_simultaneous(((16,), F32))
    assert a.data_ptr() == 0 and m.describe_buffer(a.data_ptr()) is None


# ------------------------------------------------------------------ stats


def test_stats_is_a_frozen_consistent_snapshot():
    m = WorkspaceManager("cpu", num_ubatches=2)
    (held,) = m.get_simultaneous(((1024,), U8))
    m.get_simultaneous(((2048,), U8))
    m.lock()
    s = m.stats()
    assert isinstance(s, WorkspaceStats)
    assert (s.device, s.num_ubatches, s.capacities, s.generations, s.locked) == (
        torch.device("cpu"),
        2,
        (2048, 2048),
        (2, 2),
        True,
    )
    assert (len(s.growths), s.failed_growths, s.allocations) == (2, 0, 4)
    assert (s.peak_bytes, s.orphaned_bytes, s.orphaned_buffers, s.orphaning_growths) == (
        4096 + 1024,
        1024,
        1,
        1,
    )
    assert s.total_bytes == 4096 and "orphaned 0.00 MB in 1 buffer(s)" in s.summary()
    with pytest.raises(FrozenInstanceError):
        s.locked = False
    del held


# ------------------------------------------------------------------ module-level registry


def test_current_manager_before_init_says_what_to_call():
    assert not is_workspace_manager_initialized()
    with pytest.raises(
        WorkspaceNotInitializedError, match=r"init_workspace_manager\(device, num_ubatches\)"
    ):
        current_workspace_manager()
    assert issubclass(WorkspaceNotInitializedError, RuntimeError)


def test_lock_workspace_before_init_raises_the_same_error():
    with pytest.raises(WorkspaceNotInitializedError):
        lock_workspace()


def test_init_then_current_returns_the_singleton():
    m = init_workspace_manager("cpu", 2)
    assert current_workspace_manager() is m and is_workspace_manager_initialized()
    assert m.num_ubatches == 2


def test_reinit_warns_and_replaces():
    first = init_workspace_manager("cpu")
    with pytest.warns(RuntimeWarning, match="init_workspace_manager called again"):
        second = init_workspace_manager("cpu", 2)
    assert current_workspace_manager() is second is not first


def test_bad_reinit_keeps_the_existing_manager():
    first = init_workspace_manager("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError):
            init_workspace_manager("cpu", 0)
    assert current_workspace_manager() is first


def test_lock_and_unlock_workspace_act_on_the_singleton():
    m = init_workspace_manager("cpu")
    lock_workspace()
    assert m.is_locked()
    unlock_workspace()
    assert not m.is_locked()


def test_reset_forgets_the_singleton():
    init_workspace_manager("cpu")
    reset_workspace_manager()
    assert not is_workspace_manager_initialized()


def test_every_public_name_is_exported():
    for name in [
        "WorkspaceManager",
        "WorkspaceLockedError",
        "WorkspaceNotInitializedError",
        "WorkspaceAllocationError",
        "init_workspace_manager",
        "current_workspace_manager",
        "lock_workspace",
        "unlock_workspace",
        "reset_workspace_manager",
        "is_workspace_manager_initialized",
    ]:
        assert name in workspace.__all__ and hasattr(workspace, name)


# ------------------------------------------------------------------ hot path


def test_hot_path_allocates_nothing():
    # Its speed against the plain per-call algorithm is a benchmark (`python -m scenarios bench`,
    # workspace.get_simultaneous.*), not a test: timings on a shared machine are noise.
    m = WorkspaceManager("cpu")
    request = (((64, 128), torch.float16), ((32,), F32), ((4, 4, 4), torch.bfloat16))
    m.get_simultaneous(*request)
    m.lock()
    with record_allocations(m) as allocs:
        for _ in range(2000):
            m.get_simultaneous(*request)
    assert allocs == []
