"""Token offsets (vLLM 0.33): each ubatch knows the row where it starts in the parent batch."""

from __future__ import annotations

import threading

import pytest

import dbo

pytestmark = pytest.mark.timeout(30)


def test_each_ubatch_reads_its_own_token_offset(device):
    seen = {}

    def fn(i):
        dbo.dbo_yield()  # read after a hand-off too: the offset is the caller's, not the last
        seen[i] = dbo.dbo_current_ubatch_token_offset()

    dbo.run_ubatches(fn, [0, 1, 2], device=device, token_offsets=[0, 5, 11])
    assert seen == {0: 0, 1: 5, 2: 11}


def test_token_offset_is_zero_outside_a_ubatch():
    assert dbo.dbo_current_ubatch_token_offset() == 0


def test_token_offsets_default_to_zero_for_every_ubatch(device):
    seen = dbo.run_ubatches(lambda _: dbo.dbo_current_ubatch_token_offset(), [0, 1], device=device)
    assert seen == [0, 0]


def test_make_ubatch_contexts_sets_each_contexts_token_offset(device):
    compute, comm = device.Stream("compute"), device.Stream("comm")
    contexts = dbo.make_ubatch_contexts(
        2, compute, comm, [None, None], threading.Barrier(3), token_offsets=[0, 7]
    )
    try:
        assert [c.token_offset for c in contexts] == [0, 7]
    finally:
        contexts[0].step.close()


def test_token_offsets_of_the_wrong_length_are_refused_before_any_thread_starts(device):
    with pytest.raises(ValueError, match="token_offsets has 1 entries, expected one per ubatch"):
        dbo.run_ubatches(lambda _: None, [0, 1], device=device, token_offsets=[3])


def test_a_negative_token_offset_is_refused(device):
    with pytest.raises(ValueError, match=r"token_offsets\[1\] must be >= 0"):
        dbo.run_ubatches(lambda _: None, [0, 1], device=device, token_offsets=[0, -2])


def test_token_offsets_agree_with_vllms_contexts(device):
    ubatching = pytest.importorskip("vllm.v1.worker.ubatching", reason="vLLM 0.33 not installed")
    # vLLM's make_ubatch_contexts only stores the streams: any object does on a CPU machine.
    theirs = ubatching.make_ubatch_contexts(
        2, None, None, [None, None], threading.Barrier(3), token_offsets=[0, 9]
    )
    compute, comm = device.Stream("compute"), device.Stream("comm")
    ours = dbo.make_ubatch_contexts(
        2, compute, comm, [None, None], threading.Barrier(3), token_offsets=[0, 9]
    )
    ours[0].step.close()
    assert [c.token_offset for c in ours] == [c.token_offset for c in theirs] == [0, 9]
