"""Failure safety: every broken step ends promptly with one clear error and empty registries.

No test here relies on pytest-timeout to end a hang; the marks are a backstop only.
"""

from __future__ import annotations

import threading
import time

import pytest

import dbo
from dbo import ubatching

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
        dbo.run_ubatches(lambda i: idents.add(threading.get_ident()), [0, 1], device=device)
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
