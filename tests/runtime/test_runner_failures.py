"""Failure safety: every broken step ends promptly with one clear error and empty registries.

No test here relies on pytest-timeout to end a hang; the marks are a backstop only.
"""

from __future__ import annotations

import math
import signal
import sys
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest

import dbo
from dbo import ubatching, workers
from dbo.sim import SimDevice
from dbo.sim.options import SimOptions
from dbo.streams import GraphCapture

pytestmark = pytest.mark.timeout(30)


def _registries_empty() -> bool:
    return not ubatching.ubatch_step_active()


@pytest.mark.parametrize("failing", [0, 1, 2])
def test_exception_in_a_ubatch_releases_peers_and_names_the_ubatch(device, failing):
    reached_end = []

    def fn(i):
        dbo.dbo_yield()
        if i == failing:
            raise KeyError("boom")
        dbo.dbo_yield()
        reached_end.append(i)

    start = time.monotonic()
    with pytest.raises(dbo.UBatchError) as info:
        dbo.run_ubatches(fn, [0, 1, 2], device=device, timeout=20)
    assert time.monotonic() - start < 5  # released promptly, not by the timeout
    assert info.value.ubatch_id == failing
    assert isinstance(info.value.__cause__, KeyError)
    assert f"ubatch {failing}" in str(info.value)
    assert reached_end == []  # peers were unwound, not run on with a dead ring
    assert _registries_empty()


def test_exception_before_the_first_yield_releases_peers_waiting_to_start(device):
    def fn(i):
        if i == 0:
            raise ValueError("early")
        dbo.dbo_yield()

    with pytest.raises(dbo.UBatchError, match="ubatch 0 raised ValueError: early"):
        dbo.run_ubatches(fn, [0, 1, 2, 3], device=device, timeout=20)
    assert _registries_empty()


def test_peer_finally_blocks_run_when_the_step_is_aborted(device):
    cleaned = []

    def fn(i):
        try:
            dbo.dbo_yield()
            if i == 1:
                raise RuntimeError("x")
            dbo.dbo_yield()
        finally:
            cleaned.append(i)

    with pytest.raises(dbo.UBatchError):
        dbo.run_ubatches(fn, [0, 1], device=device, timeout=20)
    assert sorted(cleaned) == [0, 1]


def test_user_except_exception_cannot_swallow_the_abort(device):
    def fn(i):
        try:
            dbo.dbo_yield()
            if i == 1:
                raise RuntimeError("x")
            dbo.dbo_yield()
        except Exception:  # noqa: BLE001 - the point of the test
            return "swallowed"
        return "ok"

    with pytest.raises(dbo.UBatchError, match="ubatch 1"):
        dbo.run_ubatches(fn, [0, 1], device=device, timeout=20)


def test_more_yields_in_one_ubatch_is_a_yield_mismatch(device):
    def fn(i):
        for _ in range(3 if i == 0 else 1):
            dbo.dbo_yield()

    start = time.monotonic()
    with pytest.raises(dbo.YieldMismatchError) as info:
        dbo.run_ubatches(fn, [0, 1], device=device, timeout=20)
    assert time.monotonic() - start < 5
    err = info.value
    assert isinstance(err, dbo.UBatchError)
    message = str(err)
    assert "ubatch 0" in message and "ubatch 1" in message
    assert "parked at test_runner_failures.py" in message  # where the waiting ubatch sits
    assert err.yield_counts[1] == 1 and err.yield_counts[0] >= 2
    assert _registries_empty()


def test_one_extra_yield_that_would_not_hang_is_still_reported(device):
    # 3 against 2 yields ends without a hang in vLLM's ring, silently pairing the wrong phases.
    def fn(i):
        for _ in range(3 if i == 0 else 2):
            dbo.dbo_yield()

    with pytest.raises(dbo.YieldMismatchError) as info:
        dbo.run_ubatches(fn, [0, 1], device=device, timeout=20)
    assert info.value.yield_counts == [3, 2]


def test_yield_mismatch_with_three_ubatches_lists_every_count(device):
    counts = {0: 2, 1: 2, 2: 1}

    def fn(i):
        for _ in range(counts[i]):
            dbo.dbo_yield()

    with pytest.raises(dbo.YieldMismatchError) as info:
        dbo.run_ubatches(fn, [0, 1, 2], device=device, timeout=20)
    message = str(info.value)
    for i in range(3):
        assert f"ubatch {i}:" in message


def test_stuck_ubatch_times_out_with_every_threads_stack(device):
    stop = threading.Event()

    def fn(i):
        if i == 1:
            stop.wait(30)  # stuck outside the dbo primitives
        dbo.dbo_yield()

    start = time.monotonic()
    try:
        with pytest.raises(dbo.UBatchTimeoutError) as info:
            dbo.run_ubatches(fn, [0, 1], device=device, timeout=0.5)
    finally:
        stop.set()
    assert time.monotonic() - start < 5
    err = info.value
    assert set(err.stacks) == {0, 1}
    assert "stop.wait(30)" in err.stacks[1]
    assert "parked" in str(err)
    assert _registries_empty()


def test_registries_are_empty_after_a_successful_step(device):
    dbo.run_ubatches(lambda i: dbo.dbo_yield(), [0, 1, 2], device=device)
    assert _registries_empty()


def test_a_new_step_runs_after_a_failed_one(device):
    def bad(i):
        raise RuntimeError("first step fails")

    with pytest.raises(dbo.UBatchError):
        dbo.run_ubatches(bad, [0, 1], device=device)
    assert dbo.run_ubatches(lambda i: i + 1, [0, 1], device=device) == [1, 2]


def test_bad_arguments_are_reported_before_any_thread_starts(device):
    with pytest.raises(TypeError, match="fn must be callable"):
        dbo.run_ubatches(None, [0, 1], device=device)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout"):
        dbo.run_ubatches(lambda i: i, [0, 1], device=device, timeout=0)
    with pytest.raises(ValueError, match="device must be"):
        dbo.run_ubatches(lambda i: i, [0, 1], device="tpu")
    assert threading.active_count() >= 1 and _registries_empty()


def test_ubatch_threads_are_reused_across_steps(device):
    # A fresh thread per ubatch per step pays torch's per-thread CUDA set-up every step.
    seen: list[set[int]] = []
    for _ in range(3):
        idents: set[int] = set()
        dbo.run_ubatches(
            lambda i, idents=idents: idents.add(threading.get_ident()), [0, 1], device=device
        )
        seen.append(idents)
    assert len(seen[0]) == 2 and seen[0] == seen[1] == seen[2]


def test_a_thread_stuck_past_the_timeout_is_never_reused(device):
    stop = threading.Event()
    stuck_ident: list[int] = []

    def fn(i):
        if i == 1:
            stuck_ident.append(threading.get_ident())
            stop.wait(30)

    try:
        with pytest.raises(dbo.UBatchTimeoutError):
            dbo.run_ubatches(fn, [0, 1], device=device, timeout=0.3)
        idents: set[int] = set()
        dbo.run_ubatches(lambda i: idents.add(threading.get_ident()), [0, 1], device=device)
        assert stuck_ident[0] not in idents
    finally:
        stop.set()
    # Once its user code returns, the abandoned thread ends instead of idling forever.
    stuck = next((t for t in threading.enumerate() if t.ident == stuck_ident[0]), None)
    if stuck is not None:  # None: it has ended already
        stuck.join(5)
        assert not stuck.is_alive()


def test_threads_of_a_step_that_raised_are_reused_by_the_next(device):
    # A raising ubatch unwinds every peer, so no thread is stuck and none is abandoned.
    first: set[int] = set()

    def bad(i):
        first.add(threading.get_ident())
        dbo.dbo_yield()
        if i == 1:
            raise RuntimeError("x")
        dbo.dbo_yield()

    with pytest.raises(dbo.UBatchError):
        dbo.run_ubatches(bad, [0, 1], device=device)
    assert _step_thread_idents(device) == first


def test_a_failing_recv_hook_at_exit_is_reported_for_the_ubatch_that_ran_it(device):
    def hook():
        raise ValueError("recv failed")

    def fn(i):
        if i == 0:
            dbo.dbo_register_recv_hook(hook)  # stored on ubatch 1, run when it exits

    with pytest.raises(dbo.UBatchError) as info:
        dbo.run_ubatches(fn, [0, 1], device=device, timeout=20)
    assert info.value.ubatch_id == 1
    assert isinstance(info.value.__cause__, ValueError)
    assert _registries_empty()


def test_run_ubatches_called_from_inside_a_ubatch_is_refused_clearly(device):
    def fn(i):
        if i == 0:
            dbo.run_ubatches(lambda x: x, [0, 1], device=device)

    with pytest.raises(dbo.UBatchError) as info:
        dbo.run_ubatches(fn, [0, 1], device=device, timeout=20)
    assert info.value.ubatch_id == 0
    assert "another ubatched step" in str(info.value.__cause__)
    assert _registries_empty()


# ------------------------------------------------------------------ the launcher's own failures


def _worker_threads() -> set[int]:
    return {t.ident for t in threading.enumerate() if t.name.startswith("dbo-ubatch-worker")}


def _step_thread_idents(device) -> set[int]:
    idents: set[int] = set()
    dbo.run_ubatches(lambda i: idents.add(threading.get_ident()), [0, 1], device=device)
    return idents


class _FailingGraph(GraphCapture):
    """A capture whose enter or exit raises `error`, standing in for a CUDA capture error."""

    def __init__(self, error: BaseException, on: str) -> None:
        self.error, self.on = error, on

    def __enter__(self):
        if self.on == "enter":
            raise self.error
        return self

    def __exit__(self, *exc):
        if self.on == "exit":
            raise self.error

    def replay(self) -> None:
        pass


def test_a_graph_that_cannot_be_entered_releases_every_ubatch_thread(device):
    def fn(i):
        dbo.dbo_yield()

    graph = device.graph()
    dbo.run_ubatches(fn, [0, 1], device=device, graph=graph)
    before = _step_thread_idents(device)
    with pytest.raises(RuntimeError, match="captured already"):
        dbo.run_ubatches(fn, [0, 1], device=device, graph=graph)  # a graph captures once
    assert _registries_empty()
    # The threads parked for that step were released and reused, not left waiting forever.
    assert _step_thread_idents(device) == before
    assert _worker_threads() == before


def test_an_interrupted_launcher_releases_every_ubatch_and_re_raises_the_interrupt(device):
    before = _step_thread_idents(device)
    with pytest.raises(KeyboardInterrupt):
        dbo.run_ubatches(
            lambda i: dbo.dbo_yield(),
            [0, 1],
            device=device,
            graph=_FailingGraph(KeyboardInterrupt(), "enter"),
        )
    assert _registries_empty()
    assert _step_thread_idents(device) == before


def test_a_graph_exit_failure_after_the_ubatches_finished_is_raised_as_is(device):
    before = _step_thread_idents(device)
    with pytest.raises(RuntimeError, match="capture invalidated"):
        dbo.run_ubatches(
            lambda i: dbo.dbo_yield(),
            [0, 1],
            device=device,
            graph=_FailingGraph(RuntimeError("capture invalidated"), "exit"),
        )
    assert _registries_empty()
    assert _step_thread_idents(device) == before


# ------------------------------------------------------------------ one step at a time


@pytest.mark.timeout(60)
def test_concurrent_launchers_each_get_a_whole_step_or_a_clear_refusal():
    # Two threads launching at once used to slip both past make_ubatch_contexts' check and
    # take over each other's slots: wrong outputs, mismatches, timeouts.
    device = SimDevice(SimOptions(check_races=False))

    def fn(i):
        for _ in range(3):
            dbo.dbo_yield()
        return dbo.dbo_current_ubatch_id()

    outcomes: list[str] = []
    for _ in range(30):
        start = threading.Barrier(2)

        def launch(start=start):
            start.wait(10)
            try:
                outcomes.append(repr(dbo.run_ubatches(fn, [0, 1], device=device, timeout=10)))
            except RuntimeError as exc:
                outcomes.append("refused" if "another ubatched step" in str(exc) else repr(exc))

        launchers = [threading.Thread(target=launch, daemon=True) for _ in range(2)]
        for t in launchers:
            t.start()
        for t in launchers:
            t.join(20)
        assert not any(t.is_alive() for t in launchers)
    assert set(outcomes) <= {"[0, 1]", "refused"}
    assert outcomes.count("[0, 1]") >= 30  # at least one launcher of each pair ran its step
    assert _registries_empty()


def _run_by_hand(device, contexts, fns):
    """vLLM's launcher protocol without run_ubatches: one thread per context, the launcher
    at the barrier, then ubatch 0 released. Returns each thread's exception, if any."""
    errors: dict[int, BaseException] = {}

    def body(i):
        try:
            with contexts[i]:
                fns[i]()
        except BaseException as exc:  # handed to the test below
            errors[i] = exc

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(len(contexts))]
    for t in threads:
        t.start()
    try:
        contexts[0].ready_barrier.wait(timeout=10)
        contexts[0].step.release_first()
    except threading.BrokenBarrierError:
        pass  # a ubatch failed before the step began
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    return errors


def test_contexts_used_by_hand_leave_empty_registries_after_an_abort(device):
    compute, comm = device.Stream("compute"), device.Stream("comm")
    contexts = dbo.make_ubatch_contexts(3, compute, comm, [None] * 3, threading.Barrier(4))

    def fail():
        raise ValueError("boom")

    errors = _run_by_hand(device, contexts, [fail, dbo.dbo_yield, dbo.dbo_yield])
    assert isinstance(errors[0], ValueError)
    # the peers, still waiting for their first turn, unwound out of __enter__
    assert contexts[0].step.error.ubatch_id == 0
    assert _registries_empty()


def test_a_failed_step_says_which_microbatch_failed_in_vllms_words_too(device):
    def fn(i):
        if i == 0:
            raise ValueError("boom")
        dbo.dbo_yield()

    with pytest.raises(RuntimeError, match=r"^Microbatch 0 of 2 failed: ubatch 0 raised") as info:
        dbo.run_ubatches(fn, [0, 1], device=device, timeout=20)
    assert isinstance(info.value.__cause__, ValueError)


def test_a_peer_waiting_at_the_ready_barrier_when_a_ubatch_fails_sees_broken_barrier(device):
    # vLLM's launcher protocol: a thread of one's own per context. Ubatch 0 fails before its
    # context (here: reported the way run_ubatches reports a failing device scope) while its
    # peers wait at the ready barrier.
    compute, comm = device.Stream("compute"), device.Stream("comm")
    contexts = dbo.make_ubatch_contexts(3, compute, comm, [None] * 3, threading.Barrier(4))
    errors: dict[int, BaseException] = {}

    def peer(i):
        try:
            with contexts[i]:
                dbo.dbo_yield()
        except BaseException as exc:  # handed to the test below
            errors[i] = exc

    threads = [threading.Thread(target=peer, args=(i,), daemon=True) for i in (1, 2)]
    for t in threads:
        t.start()
    while contexts[0].ready_barrier.n_waiting < 2:
        time.sleep(0.001)
    contexts[0].step.fail(0, ValueError("device scope failed"))
    for t in threads:
        t.join(10)
    assert sorted(errors) == [1, 2]
    assert all(isinstance(e, threading.BrokenBarrierError) for e in errors.values())
    assert all(isinstance(e, dbo.StepAborted) for e in errors.values())  # still an unwind
    assert contexts[0].step.error.ubatch_id == 0
    assert _registries_empty()


def test_a_step_started_while_another_runs_cannot_take_over_its_slots(device):
    compute, comm = device.Stream("compute"), device.Stream("comm")
    # Made before the first step runs, so make_ubatch_contexts' own check cannot see it.
    intruder = dbo.make_ubatch_contexts(2, compute, comm, [None] * 2, threading.Barrier(3))
    intruder_errors: dict[int, BaseException] = {}

    def fn(i):
        if i == 0:
            intruder_errors.update(_run_by_hand(device, intruder, [dbo.dbo_yield] * 2))
        dbo.dbo_yield()
        return dbo.dbo_current_ubatch_id()

    assert dbo.run_ubatches(fn, [0, 1], device=device, timeout=20) == [0, 1]
    error = intruder[0].step.error
    assert isinstance(error, dbo.UBatchError)
    assert "another step is still running" in str(error.__cause__)
    assert _registries_empty()


@pytest.mark.timeout(60)
def test_a_thread_reaching_a_step_that_timed_out_cannot_register_into_the_next():
    gate, late_thread_done = threading.Event(), threading.Event()

    class SlowStart(SimDevice):
        """Ubatch 1's thread of the first step is held before it reaches its context."""

        hold = True

        @contextmanager
        def thread_scope(self, ubatch_id=None):
            if ubatch_id == 1 and SlowStart.hold:
                SlowStart.hold = False
                gate.wait(20)
                try:
                    with super().thread_scope(ubatch_id):
                        yield
                finally:
                    late_thread_done.set()
                return
            with super().thread_scope(ubatch_id):
                yield

    device = SlowStart(SimOptions(check_races=False))
    with pytest.raises(dbo.UBatchTimeoutError, match="at the ready barrier"):
        dbo.run_ubatches(lambda i: dbo.dbo_yield(), [0, 1], device=device, timeout=0.3)

    def fn(i):
        if i == 0:
            gate.set()  # the held thread now enters the timed-out step's context
            assert late_thread_done.wait(20)
        dbo.dbo_yield()
        return dbo.dbo_current_ubatch_id()

    assert dbo.run_ubatches(fn, [0, 1], device=device, timeout=20) == [0, 1]
    assert _registries_empty()


def test_an_abandoned_worker_ends_even_if_it_was_already_back_waiting_for_jobs():
    pool = workers.WorkerPool()
    worker = workers.UBatchWorker(-1)
    # As if the pool saw it busy just before the thread finished and went back to waiting.
    worker.busy = True
    pool.release([worker])
    worker.thread.join(5)
    assert not worker.thread.is_alive()
    assert pool.idle_count() == 0


# ------------------------------------------------------------------ no failure is ever lost


class _UnprintableError(Exception):
    """Its __str__ raises another of its kind: formatting it fails, and so does formatting
    that failure."""

    def __str__(self):
        raise _UnprintableError()


class _NoStrNoRepr(Exception):
    def __str__(self):
        raise AttributeError("missing field")

    def __repr__(self):
        raise AttributeError("missing field")


def _raise_in(failing: int, error: BaseException):
    """A step body where ubatch `failing` raises `error` after one yield (ubatch 1, the last
    to run, raises after ubatch 0 has already returned)."""

    def fn(i):
        dbo.dbo_yield()
        if i == failing:
            raise error
        return i

    return fn


@pytest.mark.parametrize("failing", [0, 1], ids=["before-the-peer-finished", "after-it"])
def test_an_exception_whose_str_raises_ends_the_step_at_once_as_the_cause(device, failing):
    error = _UnprintableError()
    before = _step_thread_idents(device)
    start = time.monotonic()
    with pytest.raises(dbo.UBatchError) as info:
        dbo.run_ubatches(_raise_in(failing, error), [0, 1], device=device, timeout=20)
    assert time.monotonic() - start < 5  # not the timeout
    assert info.value.__cause__ is error
    assert info.value.ubatch_id == failing
    assert f"ubatch {failing} raised _UnprintableError" in str(info.value)
    assert _registries_empty()
    assert _step_thread_idents(device) == before  # no worker thread died


def test_an_exception_whose_str_and_repr_raise_is_still_named_by_its_type(device):
    error = _NoStrNoRepr()
    with pytest.raises(dbo.UBatchError, match="ubatch 0 raised _NoStrNoRepr") as info:
        dbo.run_ubatches(_raise_in(0, error), [0, 1], device=device, timeout=20)
    assert info.value.__cause__ is error


@pytest.mark.parametrize(
    "error",
    [SystemExit(3), KeyboardInterrupt(), GeneratorExit(), type("Custom", (BaseException,), {})()],
    ids=lambda e: type(e).__name__,
)
def test_any_base_exception_from_a_ubatch_is_one_ubatch_error_naming_it(device, error):
    with pytest.raises(dbo.UBatchError) as info:
        dbo.run_ubatches(_raise_in(1, error), [0, 1, 2], device=device, timeout=20)
    assert info.value.ubatch_id == 1 and info.value.__cause__ is error
    assert _registries_empty()


def test_a_ubatch_error_raised_by_user_code_is_wrapped_to_name_the_ubatch(device):
    mine = dbo.UBatchError("raised by the model itself")
    with pytest.raises(dbo.UBatchError) as info:
        dbo.run_ubatches(_raise_in(1, mine), [0, 1], device=device, timeout=20)
    assert info.value is not mine and info.value.ubatch_id == 1 and info.value.__cause__ is mine


def test_a_step_abort_raised_outside_an_abort_fails_the_step_instead_of_returning_none(device):
    # The runtime's private unwind, raised by user code while the step is live: once a None
    # output (ubatch 0 had returned), or a timeout (a peer left parked).
    from dbo.errors import StepAborted

    def fn(i):
        if i == 1:
            raise StepAborted()
        return i

    with pytest.raises(dbo.UBatchError) as info:
        dbo.run_ubatches(fn, [0, 1], device=device, timeout=20)
    assert info.value.ubatch_id == 1 and isinstance(info.value.__cause__, StepAborted)


# ------------------------------------------------------------------ input checked up front


@pytest.mark.parametrize(
    "inputs",
    [{1, 2}, {"a": 1, "b": 2}.values(), {"a": 1, "b": 2}, {0: 1, 1: 2}, (x for x in (1, 2))],
    ids=["set", "dict-values", "str-keyed-dict", "int-keyed-dict", "generator"],
)
def test_inputs_that_cannot_be_indexed_in_ubatch_order_are_refused_at_once(device, inputs):
    workers = _worker_threads()
    with pytest.raises(TypeError, match="ubatch_inputs must be a sequence"):
        dbo.run_ubatches(lambda x: x, inputs, device=device, timeout=20)
    assert _worker_threads() == workers and _registries_empty()


def test_forward_contexts_that_cannot_be_indexed_are_refused_at_once(device):
    with pytest.raises(TypeError, match="forward_contexts must be a sequence"):
        dbo.run_ubatches(lambda x: x, [0, 1], device=device, forward_contexts={"a", "b"})


@pytest.mark.parametrize("timeout", [math.inf, 1e10, 10**400], ids=["inf", "1e10", "10**400"])
def test_an_unbounded_or_huge_timeout_runs_the_step(device, timeout):
    assert dbo.run_ubatches(
        lambda i: dbo.dbo_yield() or i, [0, 1], device=device, timeout=timeout
    ) == [0, 1]


@pytest.mark.parametrize(
    "timeout",
    [np.int64(5), np.float32(2.0), np.float64(2.0), 2],
    ids=["np-int64", "np-float32", "np-float64", "int"],
)
def test_a_timeout_of_any_real_number_type_runs_the_step(device, timeout):
    assert dbo.run_ubatches(
        lambda i: dbo.dbo_yield() or i, [0, 1], device=device, timeout=timeout
    ) == [0, 1]


@pytest.mark.parametrize(
    "timeout",
    [
        math.nan,
        -1,
        0,
        True,
        "5",
        None,
        np.bool_(True),
        np.float32("nan"),
        np.int64(0),
        np.float32(-1.0),
    ],
)
def test_a_timeout_that_is_not_a_positive_number_is_refused(device, timeout):
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
        dbo.run_ubatches(lambda i: i, [0, 1], device=device, timeout=timeout)


# ------------------------------------------------------------------ the launcher gives up promptly


def test_the_timeout_error_arrives_right_after_the_timeout(device):
    # There was a one-second grace after the timeout; now only a short unwind.
    stop = threading.Event()

    def fn(i):
        if i == 0:
            stop.wait(30)

    start = time.monotonic()
    try:
        with pytest.raises(dbo.UBatchTimeoutError):
            dbo.run_ubatches(fn, [0, 1], device=device, timeout=0.3)
        elapsed = time.monotonic() - start
    finally:
        stop.set()
    assert elapsed < 0.3 + 0.9


def test_ctrl_c_reaches_the_caller_at_once_while_a_ubatch_runs_long_user_code(device):
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are delivered to the main thread only")
    stop, running = threading.Event(), threading.Event()

    def fn(i):
        if i == 0:
            running.set()
            stop.wait(30)  # long user code, outside the dbo primitives
        dbo.dbo_yield()

    def press_ctrl_c():
        if running.wait(10):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    presser = threading.Thread(target=press_ctrl_c, daemon=True)
    presser.start()
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            dbo.run_ubatches(fn, [0, 1], device=device, timeout=30)
        elapsed = time.monotonic() - start
    finally:
        stop.set()
        presser.join(10)
    assert elapsed < 5  # not the 30 s timeout
    assert _registries_empty()
    # The abandoned thread ends once its user code returns; the next step runs.
    assert dbo.run_ubatches(lambda i: i, [0, 1], device=device) == [0, 1]


# ------------------------------------------------------------------ graphs of failed steps


def test_a_step_that_fails_under_capture_leaves_a_graph_that_refuses_to_replay(device):
    graph = device.graph()
    with pytest.raises(dbo.UBatchError):
        dbo.run_ubatches(_raise_in(1, ValueError("mid-step")), [0, 1], device=device, graph=graph)
    with pytest.raises(RuntimeError, match="captured a ubatched step that failed"):
        graph.replay()


def test_a_step_that_times_out_under_capture_leaves_a_graph_that_refuses_to_replay(device):
    graph, stop = device.graph(), threading.Event()

    def fn(i):
        dbo.dbo_yield()
        if i == 1:
            stop.wait(30)

    try:
        with pytest.raises(dbo.UBatchTimeoutError):
            dbo.run_ubatches(fn, [0, 1], device=device, graph=graph, timeout=0.3)
    finally:
        stop.set()
    with pytest.raises(RuntimeError, match="cannot be replayed"):
        graph.replay()


def test_a_graph_of_a_step_that_succeeded_still_replays(device):
    graph = device.graph()
    dbo.run_ubatches(lambda i: dbo.dbo_yield(), [0, 1], device=device, graph=graph)
    graph.replay()
    assert graph.replays == 1


def test_a_yield_mismatch_names_the_extra_yield_not_where_it_was_noticed(device):
    extra: list[int] = []

    def fn(i):
        dbo.dbo_yield()
        if i == 1:
            extra.append(sys._getframe().f_lineno + 1)
            dbo.dbo_yield()  # the extra one; the ring notices only at the next yield
        dbo.dbo_yield()

    with pytest.raises(dbo.YieldMismatchError) as info:
        dbo.run_ubatches(fn, [0, 1], device=device, timeout=20)
    head = str(info.value).splitlines()[0]
    origin = f"the extra yield is ubatch 1's yield 2 at test_runner_failures.py:{extra[0]}:fn"
    assert origin in head and head.index(origin) < head.index("noticed when"), head
