"""The ubatch ring and the dbo_* helpers: order, streams, events, hooks, forward contexts."""

from __future__ import annotations

import threading

import pytest
import torch

import dbo
from dbo import ubatching

pytestmark = pytest.mark.timeout(30)


def _registries_empty() -> bool:
    return not ubatching.ubatch_step_active()


@pytest.mark.parametrize("num", [2, 3, 4])
def test_ring_runs_ubatches_in_turn_between_yields(device, num):
    log: list[tuple[int, int]] = []

    def fn(_):
        ubatch = dbo.dbo_current_ubatch_id()
        for phase in range(3):
            log.append((ubatch, phase))
            dbo.dbo_yield()
        log.append((ubatch, 3))

    dbo.run_ubatches(fn, [None] * num, device=device)
    assert log == [(u, phase) for phase in range(4) for u in range(num)]
    assert _registries_empty()


def test_outputs_come_back_in_ubatch_order(device):
    outs = dbo.run_ubatches(lambda x: x * 10, [1, 2, 3], device=device)
    assert outs == [10, 20, 30]


def test_each_thread_sees_its_own_ubatch_id_and_dbo_enabled(device):
    seen = {}

    def fn(i):
        seen[i] = (dbo.dbo_current_ubatch_id(), dbo.dbo_enabled())
        dbo.dbo_yield()

    dbo.run_ubatches(fn, [0, 1, 2], device=device)
    assert seen == {0: (0, True), 1: (1, True), 2: (2, True)}


def test_ubatches_start_on_the_compute_stream(device):
    compute, comm = device.Stream("compute"), device.Stream("comm")
    seen = []
    dbo.run_ubatches(
        lambda _: seen.append(dbo.current_stream()),
        [None, None],
        device=device,
        compute_stream=compute,
        comm_stream=comm,
    )
    assert seen == [compute, compute]


def test_current_stream_after_each_helper(device):
    compute, comm = device.Stream("compute"), device.Stream("comm")
    trail: dict[int, list[str]] = {0: [], 1: []}

    def fn(i):
        def note():
            trail[i].append(dbo.current_stream().name)

        note()
        dbo.dbo_switch_to_comm()
        note()
        dbo.dbo_switch_to_compute()
        note()
        dbo.dbo_switch_to_comm_sync()
        note()
        dbo.dbo_switch_to_compute_sync()
        note()
        dbo.dbo_yield_and_switch_from_compute_to_comm()
        note()
        dbo.dbo_yield()  # keeps the stream it was on
        note()
        dbo.dbo_yield_and_switch_from_comm_to_compute()
        note()

    dbo.run_ubatches(fn, [0, 1], device=device, compute_stream=compute, comm_stream=comm)
    expected = ["compute", "comm", "compute", "comm", "compute", "comm", "comm", "compute"]
    assert trail == {0: expected, 1: expected}


def test_yield_restores_the_stream_each_ubatch_was_on(device):
    compute, comm = device.Stream("compute"), device.Stream("comm")
    after: dict[int, str] = {}

    def fn(i):
        if i == 0:
            dbo.dbo_switch_to_comm()
        dbo.dbo_yield()
        after[i] = dbo.current_stream().name

    dbo.run_ubatches(fn, [0, 1], device=device, compute_stream=compute, comm_stream=comm)
    assert after == {0: "comm", 1: "compute"}


def test_yield_and_switch_from_compute_to_comm_rejects_the_wrong_stream(device):
    def fn(i):
        dbo.dbo_switch_to_comm()
        dbo.dbo_yield_and_switch_from_compute_to_comm()

    with pytest.raises(dbo.UBatchError, match="must be called on 'compute'") as info:
        dbo.run_ubatches(fn, [0, 1], device=device)
    assert info.value.ubatch_id == 0
    assert _registries_empty()


def test_switch_to_comm_sync_orders_comm_after_compute_on_the_timeline(device):
    # The comm-done/compute-done events carry virtual time: a comm event recorded after
    # switch_to_comm_sync cannot complete before the compute work issued before it.
    compute, comm = device.Stream("compute"), device.Stream("comm")
    times = {}

    def fn(i):
        x = torch.ones(256, 256)
        y = x @ x  # compute stream
        done_compute = compute.record_event()
        dbo.dbo_switch_to_comm_sync()
        z = y + 1  # comm stream, after the wait
        done_comm = comm.record_event()
        dbo.dbo_switch_to_compute_sync()
        times[i] = (done_compute.time_us, done_comm.time_us)
        return z

    dbo.run_ubatches(fn, [0, 1], device=device, compute_stream=compute, comm_stream=comm)
    for compute_done, comm_done in times.values():
        assert comm_done > compute_done


def test_yield_and_switch_waits_on_own_compute_done_event(device):
    compute, comm = device.Stream("compute"), device.Stream("comm")
    times = {}

    def fn(i):
        x = torch.ones(128, 128)
        x = x @ x
        compute_done = compute.record_event()
        dbo.dbo_yield_and_switch_from_compute_to_comm()
        x = x * 2  # comm stream: must start after this ubatch's compute
        comm_done = comm.record_event()
        dbo.dbo_yield_and_switch_from_comm_to_compute()
        times[i] = (compute_done.time_us, comm_done.time_us)
        return x

    outs = dbo.run_ubatches(fn, [0, 1], device=device, compute_stream=compute, comm_stream=comm)
    for compute_done, comm_done in times.values():
        assert comm_done > compute_done
    expected = (torch.ones(128, 128) @ torch.ones(128, 128)) * 2
    assert all(torch.equal(o, expected) for o in outs)


def test_recv_hook_runs_in_the_next_ubatch(device):
    ran_in: list[tuple[str, int]] = []

    def fn(i):
        dbo.dbo_register_recv_hook(
            lambda: ran_in.append((f"hook of {i}", dbo.dbo_current_ubatch_id()))
        )
        dbo.dbo_yield()
        dbo.dbo_maybe_run_recv_hook()

    dbo.run_ubatches(fn, [0, 1, 2], device=device)
    assert sorted(ran_in) == [("hook of 0", 1), ("hook of 1", 2), ("hook of 2", 0)]


def test_pending_recv_hook_runs_when_the_ubatch_exits(device):
    ran = []

    def fn(i):
        if i == 0:
            dbo.dbo_register_recv_hook(lambda: ran.append(dbo.dbo_current_ubatch_id()))

    dbo.run_ubatches(fn, [0, 1], device=device)
    assert ran == [1]


def test_registering_a_second_unrun_recv_hook_is_an_error(device):
    def fn(i):
        if i == 0:
            dbo.dbo_register_recv_hook(lambda: None)
            dbo.dbo_register_recv_hook(lambda: None)

    with pytest.raises(dbo.UBatchError, match="still has an unrun one"):
        dbo.run_ubatches(fn, [0, 1], device=device)
    assert _registries_empty()


def test_registering_a_recv_hook_on_a_finished_ubatch_is_an_error(device):
    def fn(i):
        if i == 1:  # ubatch 0 ran first and has finished: its hook would never run
            dbo.dbo_register_recv_hook(lambda: None)

    with pytest.raises(dbo.UBatchError, match="already finished") as info:
        dbo.run_ubatches(fn, [0, 1], device=device)
    assert info.value.ubatch_id == 1
    assert _registries_empty()


def test_registering_a_non_callable_recv_hook_is_a_type_error(device):
    with pytest.raises(dbo.UBatchError) as info:
        dbo.run_ubatches(lambda i: dbo.dbo_register_recv_hook("not a hook"), [0, 1], device=device)
    assert isinstance(info.value.__cause__, TypeError)
    assert "recv_hook must be callable" in str(info.value.__cause__)


def test_forward_context_is_restored_on_every_resume(device):
    seen: list[tuple[int, str]] = []

    def fn(i):
        for _ in range(3):
            seen.append((i, dbo.current_forward_context()))
            dbo.dbo_yield()
        seen.append((i, dbo.current_forward_context()))

    dbo.run_ubatches(fn, [0, 1], device=device, forward_contexts=["ctx-a", "ctx-b"])
    assert all(ctx == ("ctx-a" if i == 0 else "ctx-b") for i, ctx in seen)
    assert len(seen) == 8


def test_a_step_leaves_the_launchers_forward_context_as_it_was(device):
    with dbo.set_forward_context("launcher"):
        dbo.run_ubatches(
            lambda i: dbo.dbo_yield(), [0, 1], device=device, forward_contexts=["ctx-a", "ctx-b"]
        )
        assert dbo.current_forward_context() == "launcher"
    assert dbo.current_forward_context() is None


def test_a_thread_outside_the_step_never_sees_a_ubatchs_forward_context(device):
    seen = []
    ubatch_running, looked = threading.Event(), threading.Event()

    def fn(i):
        if i == 0:
            ubatch_running.set()
            looked.wait(5)

    def outsider():
        ubatch_running.wait(5)
        seen.append(dbo.current_forward_context())
        looked.set()

    t = threading.Thread(target=outsider)
    t.start()
    dbo.run_ubatches(fn, [0, 1], device=device, forward_contexts=["ctx-a", "ctx-b"])
    t.join(5)
    assert seen == [None]


def test_set_forward_context_inside_a_ubatch_changes_only_that_ubatch_until_the_block_ends(device):
    seen: list[tuple[int, str]] = []

    def fn(i):
        if i == 0:
            with dbo.set_forward_context("override"):
                dbo.dbo_yield()
                seen.append((i, dbo.current_forward_context()))
            seen.append((i, dbo.current_forward_context()))
        else:
            dbo.dbo_yield()
            seen.append((i, dbo.current_forward_context()))

    dbo.run_ubatches(fn, [0, 1], device=device, forward_contexts=["ctx-a", "ctx-b"])
    assert seen == [(0, "override"), (0, "ctx-a"), (1, "ctx-b")]


def test_get_previous_event_runs_on_the_compute_stream(device):
    seen = []

    def fn(i):
        dbo.dbo_switch_to_comm()
        seen.append(dbo.dbo_get_previous_event(lambda: dbo.current_stream().name))
        seen.append(dbo.current_stream().name)

    dbo.run_ubatches(fn, [0, 1], device=device)
    assert seen == ["compute", "comm", "compute", "comm"]


def test_helpers_are_no_ops_outside_a_ubatch_thread(device):
    with dbo.use_device(device):
        before = dbo.current_stream()
        dbo.dbo_yield()
        dbo.dbo_switch_to_comm()
        dbo.dbo_switch_to_comm_sync()
        dbo.dbo_yield_and_switch_from_compute_to_comm()
        dbo.dbo_yield_and_switch_from_comm_to_compute()
        dbo.dbo_switch_to_compute_sync()
        dbo.dbo_register_recv_hook(lambda: pytest.fail("hook must not be stored"))
        dbo.dbo_maybe_run_recv_hook()
        assert dbo.dbo_get_previous_event(lambda: 1) is None
        assert dbo.current_stream() is before
    assert dbo.dbo_enabled() is False
    assert dbo.dbo_current_ubatch_id() == 0


def test_unregistered_thread_sees_ubatch_zero_while_a_step_runs(device):
    answers = []
    started = threading.Event()
    release = threading.Event()

    def fn(i):
        if i == 0:
            started.set()
            release.wait(5)

    def outsider():
        started.wait(5)
        answers.append((dbo.dbo_current_ubatch_id(), dbo.dbo_enabled()))
        release.set()

    t = threading.Thread(target=outsider)
    t.start()
    dbo.run_ubatches(fn, [0, 1], device=device)
    t.join(5)
    assert answers == [(0, False)]


def test_make_ubatch_contexts_needs_two_ubatches(device):
    s = device.Stream("s")
    with pytest.raises(ValueError, match=">= 2"):
        dbo.make_ubatch_contexts(1, s, s, [None], threading.Barrier(2))


def test_make_ubatch_contexts_checks_forward_contexts_and_barrier(device):
    s = device.Stream("s")
    with pytest.raises(ValueError, match="forward_contexts"):
        dbo.make_ubatch_contexts(2, s, s, [None], threading.Barrier(3))
    with pytest.raises(ValueError, match="parties"):
        dbo.make_ubatch_contexts(2, s, s, [None, None], threading.Barrier(2))


def test_make_ubatch_contexts_builds_a_ring(device):
    s, c = device.Stream("compute"), device.Stream("comm")
    ctxs = dbo.make_ubatch_contexts(3, s, c, [None] * 3, threading.Barrier(4))
    for i, ctx in enumerate(ctxs):
        assert ctx.cpu_signal_event is ctxs[(i + 1) % 3].cpu_wait_event
        assert ctx.compute_stream is s and ctx.comm_stream is c
    events = [e for ctx in ctxs for e in (ctx.gpu_compute_done_event, ctx.gpu_comm_done_event)]
    assert len({id(e) for e in events}) == 6  # a compute-done and a comm-done per context


def test_run_ubatches_needs_two_inputs(device):
    with pytest.raises(ValueError, match=">= 2 ubatch inputs"):
        dbo.run_ubatches(lambda x: x, [1], device=device)


def test_every_runtime_name_of_the_contract_is_importable_from_dbo():
    names = [
        "dbo_enabled",
        "dbo_current_ubatch_id",
        "dbo_yield",
        "dbo_yield_and_switch_from_compute_to_comm",
        "dbo_yield_and_switch_from_comm_to_compute",
        "dbo_switch_to_comm",
        "dbo_switch_to_compute",
        "dbo_switch_to_comm_sync",
        "dbo_switch_to_compute_sync",
        "dbo_register_recv_hook",
        "dbo_maybe_run_recv_hook",
        "dbo_get_previous_event",
        "make_ubatch_contexts",
        "UBatchContext",
        "current_stream",
        "current_forward_context",
        "run_ubatches",
        "merge_outputs",
        "UBatchError",
        "YieldMismatchError",
        "UBatchTimeoutError",
    ]
    missing = [n for n in names if n not in dbo.__all__ or not hasattr(dbo, n)]
    assert missing == []
    assert issubclass(dbo.YieldMismatchError, dbo.UBatchError)
    assert issubclass(dbo.UBatchTimeoutError, dbo.UBatchError)


def test_merge_outputs_concatenates_tensors_and_tuples():
    a, b = torch.arange(3), torch.arange(3, 5)
    assert torch.equal(dbo.merge_outputs([a, b]), torch.arange(5))
    merged = dbo.merge_outputs([(a, a * 2), (b, b * 2)])
    assert isinstance(merged, tuple)
    assert torch.equal(merged[1], torch.arange(5) * 2)


def test_merge_outputs_rejects_mismatched_structures():
    with pytest.raises(TypeError, match="same length"):
        dbo.merge_outputs([(torch.ones(1),), (torch.ones(1), torch.ones(1))])
    with pytest.raises(TypeError, match="tensors"):
        dbo.merge_outputs(["a", "b"])
