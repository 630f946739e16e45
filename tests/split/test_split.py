"""Tests of dbo.split: vLLM's slicing (ported behaviours of vLLM's ubatch-slicing and
attention-splitting tests, in our words), thresholds, bad input, and DP agreement.

The agreement tests start real gloo process groups (2 and 4 ranks on 127.0.0.1). Starting a
torch process costs seconds, so each group is started once per module and runs every
scenario in turn; each test then checks one behaviour from the recorded outcomes. The workers
are this file run as a script, so they do not depend on how pytest imports test modules.
"""

from __future__ import annotations

import os
import pickle
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import dbo
from dbo.split import (
    CommonAttentionMetadata,
    DBOConfig,
    UBatchAgreementError,
    UBatchDecision,
    UBatchProposal,
    UBatchSlice,
    UBatchThresholds,
    check_ubatch_thresholds,
    coordinate_batch_across_dp,
    coordinate_ubatching,
    decide_ubatching,
    is_last_ubatch_empty,
    maybe_create_ubatch_slices,
    should_ubatch,
    slice_query_start_locs,
    slices_at_split_points,
    split_attn_metadata,
    split_batch,
)
from dbo.split import agreement as agreement_module

NO_THRESHOLDS = UBatchThresholds(decode_min_tokens=0, prefill_min_tokens=0)


def _token_slices(slices: list[UBatchSlice]) -> list[tuple[int, int]]:
    return [(s.token_slice.start, s.token_slice.stop) for s in slices]


def _request_slices(slices: list[UBatchSlice]) -> list[tuple[int, int]]:
    return [(s.request_slice.start, s.request_slice.stop) for s in slices]


def _qsl(meta: CommonAttentionMetadata) -> list[int]:
    return meta.query_start_loc_cpu.tolist()


# --------------------------------------------------------------------------------------------
# Records


def test_ubatch_slice_counts_and_emptiness() -> None:
    s = UBatchSlice(request_slice=slice(1, 3), token_slice=slice(8, 12))
    assert (s.num_tokens, s.num_requests, s.is_empty()) == (4, 2, False)
    assert UBatchSlice(slice(2, 2), slice(5, 5)).is_empty()
    assert UBatchSlice(slice(0, 1), slice(5, 5)).is_empty()


# --------------------------------------------------------------------------------------------
# Too few tokens


def test_one_token_is_never_split() -> None:
    assert not should_ubatch(1, True, 2, NO_THRESHOLDS)


def test_split_batch_refuses_one_token() -> None:
    with pytest.raises(ValueError, match="no real tokens"):
        split_batch([0, 1], num_tokens_padded=1, num_ubatches=2)


def test_fewer_tokens_than_ubatches_is_never_split() -> None:
    assert not should_ubatch(3, True, 4, NO_THRESHOLDS)
    # Padding does not help: the cut width grows but the real tokens still miss ubatch 3.
    assert not should_ubatch(3, True, 4, NO_THRESHOLDS, num_tokens_padded=8)


def test_a_zero_split_point_counts_as_an_empty_ubatch() -> None:
    # vLLM's formula answers False here (0 >= 1 is false) although ubatch 0 would be empty.
    assert is_last_ubatch_empty(1, 1, 2)


def test_exactly_num_ubatches_tokens_split_one_each() -> None:
    slices = split_batch([0, 4], num_tokens_padded=4, num_ubatches=4)
    assert _token_slices(slices) == [(0, 1), (1, 2), (2, 3), (3, 4)]


# --------------------------------------------------------------------------------------------
# Where the cuts fall


def test_uneven_split_gives_the_remainder_to_the_last_ubatch() -> None:
    slices = split_batch([0, 10], num_tokens_padded=10, num_ubatches=3)
    assert _token_slices(slices) == [(0, 3), (3, 6), (6, 10)]


@pytest.mark.parametrize(
    "num_ubatches, expected",
    [
        (2, [(0, 50), (50, 100)]),
        (3, [(0, 33), (33, 66), (66, 100)]),
        (4, [(0, 25), (25, 50), (50, 75), (75, 100)]),
    ],
)
def test_split_into_n_ubatches_cuts_at_multiples_of_padded_over_n(
    num_ubatches: int, expected: list[tuple[int, int]]
) -> None:
    qsl = [0, 7, 40, 41, 77, 100]
    slices = split_batch(qsl, num_tokens_padded=100, num_ubatches=num_ubatches)
    assert _token_slices(slices) == expected


def test_an_explicit_split_point_overrides_the_midpoint() -> None:
    slices, _ = maybe_create_ubatch_slices(True, [8, 8], 16, 2, 2, split_point=4)
    assert _token_slices(slices) == [(0, 4), (4, 16)]
    assert _request_slices(slices) == [(0, 1), (0, 2)]


def test_no_agreed_split_gives_no_slices() -> None:
    assert maybe_create_ubatch_slices(False, [8, 8], 16, 2, 2) == (None, None)


def test_padding_is_given_to_no_request_in_the_plain_slices() -> None:
    # 11 real tokens padded to 16: the cut is at 8, and the last slice ends at 11, not 16.
    slices = split_batch([0, 5, 11], num_tokens_padded=16, num_ubatches=2)
    assert _token_slices(slices) == [(0, 8), (8, 11)]


def test_the_padded_last_slice_runs_to_the_padded_counts() -> None:
    plain, padded = maybe_create_ubatch_slices(True, [5, 6], 17, 4, 2)
    assert _token_slices(plain) == [(0, 8), (8, 11)]
    assert _token_slices(padded) == [(0, 8), (8, 17)]
    assert _request_slices(padded) == [(0, 2), (1, 4)]
    assert sum(s.num_tokens for s in padded) == 17


def test_slices_at_split_points_takes_vllms_split_points() -> None:
    slices = slices_at_split_points(np.array([5, 4, 1], dtype=np.int32), [3, 6])
    assert _token_slices(slices) == [(0, 3), (3, 6), (6, 10)]
    assert _request_slices(slices) == [(0, 1), (0, 2), (1, 3)]


# --------------------------------------------------------------------------------------------
# Requests across a cut


def test_request_across_a_cut_appears_in_both_slices() -> None:
    qsl = [0, 3, 10, 12]  # request 1 holds tokens 3..9; the cut at 6 passes through it
    first, second = split_batch(qsl, num_tokens_padded=12, num_ubatches=2)
    assert _request_slices([first, second]) == [(0, 2), (1, 3)]


def test_clean_cut_on_a_request_boundary_duplicates_nothing() -> None:
    slices = split_batch([0, 4, 8], num_tokens_padded=8, num_ubatches=2)
    assert _request_slices(slices) == [(0, 1), (1, 2)]


def test_request_spanning_several_cuts_appears_in_every_slice_it_touches() -> None:
    meta = CommonAttentionMetadata.make([1, 10, 1], [1, 10, 1])
    slices = split_batch(meta.query_start_loc_cpu, num_tokens_padded=12, num_ubatches=4)
    assert _request_slices(slices) == [(0, 2), (1, 2), (1, 2), (1, 3)]
    assert [_qsl(m) for m in split_attn_metadata(slices, meta)] == [
        [0, 1, 3],
        [0, 3],
        [0, 3],
        [0, 2, 3],
    ]


def test_zero_token_requests_follow_vllms_rule() -> None:
    # Request 1 sits (empty) exactly on the cut at 4: vLLM's rule puts it in neither slice;
    # request 3, a padding request at the real end, is left to the padded slices.
    plain, padded = maybe_create_ubatch_slices(True, [4, 0, 4, 0], 8, 4, 2)
    assert _request_slices(plain) == [(0, 1), (2, 3)]
    assert _request_slices(padded) == [(0, 1), (2, 4)]


def test_a_cut_past_the_real_tokens_gives_an_empty_last_slice_not_a_negative_one() -> None:
    plain, padded = maybe_create_ubatch_slices(True, [1] * 6, 16, 6, 2)
    assert plain[-1].is_empty() and plain[-1].num_tokens == 0
    assert _token_slices(padded) == [(0, 8), (8, 16)]
    assert plain[0].request_slice == slice(0, 6)


# --------------------------------------------------------------------------------------------
# Attention metadata: vLLM's slicing behaviours, and every cut kind


@pytest.mark.parametrize(
    "req_slice, expected",
    [
        (slice(1, 3), [0, 7, 15]),
        (slice(0, 2), [0, 5, 12]),
        (slice(3, 5), [0, 15, 30]),
        (slice(2, 3), [0, 8]),
        (slice(0, 5), [0, 5, 12, 20, 35, 50]),
        (slice(4, 5), [0, 15]),
    ],
    ids=["middle", "from-start", "to-end", "one", "all", "last"],
)
def test_slice_query_start_locs_rebases_whole_requests(req_slice, expected) -> None:
    qsl = torch.tensor([0, 5, 12, 20, 35, 50])
    assert slice_query_start_locs(qsl, req_slice).tolist() == expected


def test_decode_metadata_slice_of_one_request() -> None:
    meta = CommonAttentionMetadata.make([1, 1], [32, 40])
    (part,) = split_attn_metadata([UBatchSlice(slice(0, 1), slice(0, 1))], meta)
    assert (part.num_reqs, part.num_actual_tokens, part.max_query_len) == (1, 1, 1)
    assert _qsl(part) == [0, 1] and part.seq_lens.tolist() == [32]


def test_mixed_metadata_slice_starting_inside_a_request() -> None:
    meta = CommonAttentionMetadata.make([1, 1, 5, 5], [32, 40, 48, 56])
    (part,) = split_attn_metadata([UBatchSlice(slice(1, 3), slice(1, 7))], meta)
    assert (part.num_reqs, part.num_actual_tokens, part.max_query_len) == (2, 6, 5)
    assert _qsl(part) == [0, 1, 6] and part.seq_lens.tolist() == [40, 48]


def test_a_decode_batch_splits_into_equal_halves() -> None:
    meta = CommonAttentionMetadata.make([1] * 8, [2048] * 8)
    halves = split_attn_metadata(split_batch(meta.query_start_loc_cpu, 8, 2), meta)
    assert [(m.num_reqs, m.num_actual_tokens) for m in halves] == [(4, 4), (4, 4)]
    assert all(m.seq_lens.tolist() == [2048] * 4 for m in halves)


@pytest.mark.parametrize(
    "split_point, first_reqs, second_reqs",
    [(12, 2, 1), (4, 1, 2)],
    ids=["inside-request-1", "inside-request-0"],
)
def test_a_prefill_cut_inside_a_request_is_shared_between_the_ubatches(
    split_point: int, first_reqs: int, second_reqs: int
) -> None:
    seq_lens, query_lens = [32, 40], [8, 8]
    meta = CommonAttentionMetadata.make(query_lens, seq_lens)
    slices, _ = maybe_create_ubatch_slices(True, query_lens, 16, 2, 2, split_point=split_point)
    first, second = split_attn_metadata(slices, meta)
    assert (first.num_actual_tokens, second.num_actual_tokens) == (split_point, 16 - split_point)
    assert (first.num_reqs, second.num_reqs) == (first_reqs, second_reqs)
    cut = int(np.searchsorted([0, 8, 16], split_point, side="right") - 1)
    in_first = split_point - [0, 8][cut]
    q_first, q_second = _qsl(first), _qsl(second)
    assert q_first[-1] - q_first[-2] == in_first
    assert (q_first[-1] - q_first[-2]) + (q_second[1] - q_second[0]) == query_lens[cut]
    context = seq_lens[cut] - query_lens[cut]
    assert int(first.seq_lens[-1]) == context + in_first  # the cut request ends at the cut
    assert first.seq_lens.tolist()[:-1] == seq_lens[: first.num_reqs - 1]
    assert int(second.seq_lens[0]) == seq_lens[cut]  # the continuation ends where it did
    assert second.seq_lens.tolist()[1:] == seq_lens[cut + 1 :]


def test_a_cut_request_keeps_seq_lens_minus_query_equal_to_computed_tokens() -> None:
    meta = CommonAttentionMetadata.make([3, 9, 3], [70, 300, 41])
    for part in split_attn_metadata(split_batch(meta.query_start_loc_cpu, 15, 2), meta):
        q = part.query_start_loc_cpu
        assert (part.seq_lens - (q[1:] - q[:-1])).tolist() == part.num_computed_tokens_cpu.tolist()


def test_a_cut_at_a_request_boundary_trims_nothing() -> None:
    meta = CommonAttentionMetadata.make([6, 2, 4, 4], [6, 130, 260, 4])
    first, second = split_attn_metadata(split_batch(meta.query_start_loc_cpu, 16, 2), meta)
    assert (_qsl(first), _qsl(second)) == ([0, 6, 8], [0, 4, 8])
    assert (first.seq_lens.tolist(), second.seq_lens.tolist()) == ([6, 130], [260, 4])


def test_block_table_rows_and_slot_mapping_follow_the_slice() -> None:
    meta = CommonAttentionMetadata.make([2, 20], [64, 300], block_size=16)
    first, second = split_attn_metadata(split_batch(meta.query_start_loc_cpu, 22, 2), meta)
    assert torch.equal(first.block_table_tensor, meta.block_table_tensor[0:2])
    assert torch.equal(second.block_table_tensor, meta.block_table_tensor[1:2])
    assert torch.equal(torch.cat([first.slot_mapping, second.slot_mapping]), meta.slot_mapping)


def test_a_padded_last_ubatch_keeps_padding_rows_empty_and_query_start_loc_flat() -> None:
    meta = CommonAttentionMetadata.make([1] * 6, [64] * 6, num_tokens_padded=8, num_reqs_padded=8)
    _, padded = maybe_create_ubatch_slices(True, [1] * 6, 8, 8, 2)
    last = split_attn_metadata(padded, meta)[-1]
    assert (last.num_reqs, last.num_actual_tokens) == (4, 4)
    assert _qsl(last) == [0, 1, 2, 2, 2] and last.seq_lens.tolist() == [64, 64, 0, 0]
    assert last.slot_mapping.tolist()[2:] == [-1, -1]


def test_an_empty_last_ubatch_is_refused_naming_the_rule() -> None:
    meta = CommonAttentionMetadata.make([1] * 6, [64] * 6, num_tokens_padded=16)
    assert is_last_ubatch_empty(6, 16, 2)
    plain, _ = maybe_create_ubatch_slices(True, [1] * 6, 16, 6, 2)
    with pytest.raises(ValueError, match="is_last_ubatch_empty"):
        split_attn_metadata(plain, meta)


def test_a_slice_whose_first_request_has_no_tokens_is_refused_as_vllm_refuses_it() -> None:
    # vLLM 0.33 asserts the slice's first token lies in its first request; a batch of empty
    # queries (all-zero query_start_loc) has no such request.
    meta = CommonAttentionMetadata.make([0, 0], [0, 0], num_tokens_padded=4)
    with pytest.raises(ValueError, match="Token slice start outside of first request"):
        split_attn_metadata([UBatchSlice(slice(0, 2), slice(0, 4))], meta)


def test_a_slice_of_padding_only_is_refused_not_given_negative_metadata() -> None:
    meta = CommonAttentionMetadata.make([3, 2], [3, 2], num_tokens_padded=8, num_reqs_padded=3)
    with pytest.raises(ValueError, match="padding only"):
        split_attn_metadata([UBatchSlice(slice(2, 3), slice(5, 8))], meta)


def test_a_dummy_batch_of_one_request_splits_it_across_both_ubatches() -> None:
    # A DP rank with no work still runs its ubatches: one dummy request of 32 tokens.
    meta = CommonAttentionMetadata.make([32], [32])
    slices, _ = maybe_create_ubatch_slices(True, [32], 32, 1, 2)
    parts = split_attn_metadata(slices, meta)
    assert [(p.num_actual_tokens, p.num_reqs) for p in parts] == [(16, 1), (16, 1)]
    assert [_qsl(p) for p in parts] == [[0, 16], [0, 16]]
    assert [p.seq_lens.tolist() for p in parts] == [[16], [32]]


def test_ubatch_metadata_do_not_share_the_rebased_tensors() -> None:
    meta = CommonAttentionMetadata.make([1, 1, 10, 1, 1], [64, 96, 512, 32, 48])
    first, second = split_attn_metadata(split_batch(meta.query_start_loc_cpu, 14, 2), meta)
    kept = (first.query_start_loc.clone(), first.seq_lens.clone())
    second.query_start_loc.add_(100)
    second.seq_lens.add_(100)
    assert torch.equal(first.query_start_loc, kept[0]) and torch.equal(first.seq_lens, kept[1])


def test_splitting_leaves_the_input_metadata_unchanged() -> None:
    meta = CommonAttentionMetadata.make([3, 9, 3], [70, 300, 41])
    before = (
        meta.query_start_loc.clone(),
        meta.seq_lens.clone(),
        meta.num_computed_tokens_cpu.clone(),
    )
    split_attn_metadata(split_batch(meta.query_start_loc_cpu, 15, 2), meta)
    after = (meta.query_start_loc, meta.seq_lens, meta.num_computed_tokens_cpu)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("num_ubatches", [2, 3, 4])
def test_random_batches_rebuild_every_request_from_its_parts(num_ubatches: int) -> None:
    rng = random.Random(1234 + num_ubatches)
    checked = 0
    for _ in range(100):
        lengths = [rng.randint(0, 40) for _ in range(rng.randint(1, 12))]
        contexts = [rng.randint(0, 100) for _ in lengths]
        real = sum(lengths)
        padded = real + rng.randint(0, 30)
        if real == 0 or is_last_ubatch_empty(real, padded, num_ubatches):
            continue
        meta = CommonAttentionMetadata.make(
            lengths, [c + q for c, q in zip(contexts, lengths)], num_tokens_padded=padded
        )
        slices, _ = maybe_create_ubatch_slices(True, lengths, padded, len(lengths), num_ubatches)
        rebuilt = [0] * len(lengths)
        for s, part in zip(slices, split_attn_metadata(slices, meta)):
            q = _qsl(part)
            assert q[0] == 0 and q[-1] == part.num_actual_tokens
            for i, (lo, hi) in enumerate(pairwise(q)):
                rebuilt[s.request_slice.start + i] += hi - lo
        assert rebuilt == lengths
        checked += 1
    assert checked > 30


# --------------------------------------------------------------------------------------------
# Thresholds and the empty-last-ubatch rule


def test_decode_steps_split_from_32_tokens() -> None:
    assert not should_ubatch(31, True, 2)
    assert should_ubatch(32, True, 2)


def test_prefill_and_mixed_steps_split_from_512_tokens() -> None:
    assert not should_ubatch(511, False, 2)
    assert should_ubatch(512, False, 2)
    # 100 tokens would clear the decode bar but not the prefill one.
    assert not should_ubatch(100, False, 2)


def test_thresholds_are_configurable() -> None:
    t = UBatchThresholds(decode_min_tokens=8, prefill_min_tokens=64)
    assert should_ubatch(8, True, 2, t) and not should_ubatch(7, True, 2, t)
    assert should_ubatch(64, False, 2, t) and not should_ubatch(63, False, 2, t)


def test_check_ubatch_thresholds_reads_vllms_config_names() -> None:
    config = DBOConfig(dbo_decode_token_threshold=32, dbo_prefill_token_threshold=128)
    assert check_ubatch_thresholds(config, 64, uniform_decode=True)
    assert not check_ubatch_thresholds(config, 64, uniform_decode=False)
    assert not check_ubatch_thresholds(DBOConfig(use_ubatching=False), 10_000, False)
    assert check_ubatch_thresholds(UBatchThresholds(), 512, False)


def test_no_split_when_padding_would_empty_the_last_ubatch() -> None:
    # 600 real tokens padded to 1200: the cut at 600 leaves ubatch 1 only padding.
    assert not should_ubatch(600, False, 2, num_tokens_padded=1200)
    assert should_ubatch(601, False, 2, num_tokens_padded=1200)


def test_empty_last_ubatch_rule_uses_the_last_cut_for_n_ubatches() -> None:
    # N = 3, padded 900: the last cut is at 600.
    assert is_last_ubatch_empty(600, 900, 3)
    assert not is_last_ubatch_empty(601, 900, 3)


def test_split_batch_refuses_a_split_with_an_empty_last_ubatch() -> None:
    with pytest.raises(ValueError, match="no real tokens"):
        split_batch([0, 300, 600], num_tokens_padded=1200, num_ubatches=2)


# --------------------------------------------------------------------------------------------
# Bad input


BAD_INPUTS: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    ("negative num_tokens", lambda: should_ubatch(-1, True, 2), ValueError, "num_tokens"),
    ("negative padded", lambda: split_batch([0, 4], -1, 2), ValueError, "num_tokens_padded"),
    ("one ubatch", lambda: split_batch([0, 4], 4, 1), ValueError, "num_ubatches"),
    ("one ubatch threshold", lambda: should_ubatch(600, False, 1), ValueError, "num_ubatches"),
    ("qsl not from 0", lambda: split_batch([1, 4, 8], 8, 2), ValueError, "start at 0"),
    ("qsl decreasing", lambda: split_batch([0, 5, 4, 8], 8, 2), ValueError, "non-decreasing"),
    ("qsl empty", lambda: split_batch([], 8, 2), ValueError, "query_start_loc"),
    ("qsl 2-D", lambda: split_batch([[0, 4], [4, 8]], 8, 2), ValueError, "1-D"),
    ("qsl float", lambda: split_batch(torch.tensor([0.0, 8.0]), 8, 2), TypeError, "integers"),
    ("padded < real", lambda: split_batch([0, 4, 8], 6, 2), ValueError, "num_tokens_padded"),
    (
        "padded < real threshold",
        lambda: should_ubatch(600, False, 2, num_tokens_padded=500),
        ValueError,
        "padded_num_tokens",
    ),
    ("bool count", lambda: split_batch([0, 8], True, 2), TypeError, "num_tokens_padded"),
    ("decode flag not bool", lambda: should_ubatch(64, 1, 2), TypeError, "is_decode_only"),
    (
        "negative threshold",
        lambda: UBatchThresholds(decode_min_tokens=-1),
        ValueError,
        "decode_min_tokens",
    ),
    (
        "negative count",
        lambda: slices_at_split_points([4, -1], [2]),
        ValueError,
        r"num_scheduled_tokens\[1\]",
    ),
    (
        "points decreasing",
        lambda: slices_at_split_points([4, 4], [5, 3]),
        ValueError,
        "non-decreasing",
    ),
    (
        "wrong number of points",
        lambda: maybe_create_ubatch_slices(True, [8], 8, 1, 3, [4]),
        ValueError,
        "need 2",
    ),
    (
        "points past padding",
        lambda: maybe_create_ubatch_slices(True, [8], 8, 1, 2, 9),
        ValueError,
        "past num_tokens_padded",
    ),
    (
        "reqs padded < reqs",
        lambda: maybe_create_ubatch_slices(True, [4, 4], 8, 1, 2),
        ValueError,
        "num_reqs_padded",
    ),
    (
        "slice outside metadata",
        lambda: split_attn_metadata(
            [UBatchSlice(slice(0, 3), slice(0, 4))], CommonAttentionMetadata.make([4], [4])
        ),
        ValueError,
        "request_slice",
    ),
    (
        "slice without bounds",
        lambda: split_attn_metadata(
            [UBatchSlice(slice(None, 1), slice(0, 4))], CommonAttentionMetadata.make([4], [4])
        ),
        ValueError,
        "explicit bounds",
    ),
    (
        "slice not matching metadata",
        lambda: split_attn_metadata(
            [UBatchSlice(slice(1, 2), slice(0, 4))], CommonAttentionMetadata.make([4, 4], [4, 4])
        ),
        ValueError,
        "does not match",
    ),
    (
        "metadata of the wrong type",
        lambda: split_attn_metadata([], {"query_start_loc": 0}),
        TypeError,
        "CommonAttentionMetadata",
    ),
    (
        "seq shorter than query",
        lambda: CommonAttentionMetadata.make([4], [3]),
        ValueError,
        "seq_lens",
    ),
    (
        "config without thresholds",
        lambda: check_ubatch_thresholds(object(), 4, True),
        TypeError,
        "use_ubatching",
    ),
    (
        "uniform_decode missing",
        lambda: coordinate_batch_across_dp(600, True, DBOConfig()),
        ValueError,
        "uniform_decode",
    ),
]


@pytest.mark.parametrize(
    "call, error, fragment", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS]
)
def test_bad_input_raises_an_error_naming_the_problem(
    call: Callable[[], Any], error: type[Exception], fragment: str
) -> None:
    with pytest.raises(error, match=fragment):
        call()


# --------------------------------------------------------------------------------------------
# Agreement, without processes: the pure decision and the no-process-group path


def _proposals(*rows: tuple[bool, int, int, int]) -> list[UBatchProposal]:
    return [UBatchProposal(r, *row) for r, row in enumerate(rows)]


def test_decision_pads_every_rank_to_the_largest_padded_count() -> None:
    d = decide_ubatching(_proposals((True, 1000, 1024, 2), (True, 1500, 1536, 2)))
    assert (d.split, d.num_tokens_padded, d.num_ubatches, d.reason) == (True, 1536, 2, "")


def test_decision_does_not_split_when_one_rank_cannot() -> None:
    d = decide_ubatching(_proposals((True, 1000, 1024, 2), (False, 100, 128, 2)))
    assert not d.split and "[1]" in d.reason and d.num_tokens_padded == 1024


def test_decision_refuses_padding_that_empties_a_ranks_last_ubatch() -> None:
    d = decide_ubatching(_proposals((True, 600, 600, 2), (True, 2000, 2000, 2)))
    assert not d.split and "rank 0" in d.reason


def test_decision_names_each_ranks_count_when_counts_differ() -> None:
    with pytest.raises(UBatchAgreementError, match=r"rank 0: 2, rank 1: 3"):
        decide_ubatching(_proposals((True, 1000, 1024, 2), (True, 1000, 1024, 3)))


def test_decision_takes_the_smallest_graph_mode_and_pads_by_it_without_a_split() -> None:
    d = decide_ubatching(
        [
            UBatchProposal(0, False, 100, 128, 2, cudagraph_mode=2),
            UBatchProposal(1, False, 300, 320, 2, cudagraph_mode=1),
        ]
    )
    assert (d.split, d.cudagraph_mode, d.dp_padded) == (False, 1, True)
    assert d.num_tokens_across_dp == (320, 320)


def test_decision_does_not_pad_when_one_rank_runs_eager_and_nobody_splits() -> None:
    d = decide_ubatching(
        [
            UBatchProposal(0, False, 100, 128, 2, cudagraph_mode=0),
            UBatchProposal(1, False, 300, 320, 2, cudagraph_mode=2),
        ]
    )
    assert (d.cudagraph_mode, d.dp_padded, d.num_tokens_across_dp) == (0, False, (128, 320))


def test_decision_pads_every_rank_when_it_splits_even_in_eager_mode() -> None:
    d = decide_ubatching(_proposals((True, 1000, 1024, 2), (True, 1500, 1536, 2)))
    assert (d.cudagraph_mode, d.dp_padded, d.num_tokens_across_dp) == (0, True, (1536, 1536))


def test_agreement_error_is_a_value_error() -> None:
    assert issubclass(UBatchAgreementError, ValueError)


def _skip_if_a_process_group_exists() -> None:
    if torch.distributed.is_initialized():
        pytest.skip("another test left a process group initialised in this process")


def test_without_a_process_group_the_local_decision_is_returned() -> None:
    _skip_if_a_process_group_exists()
    d = coordinate_ubatching(True, 1024, 2, num_tokens=1000)
    assert (d.split, d.num_tokens_padded, d.num_ubatches, len(d.per_rank)) == (True, 1024, 2, 1)


@pytest.mark.timeout(30)
def test_a_group_of_one_decides_locally_without_communicating(monkeypatch) -> None:
    import torch.distributed as dist

    _skip_if_a_process_group_exists()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{_free_loopback_port()}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=20),
    )
    try:

        def no_collectives(*args: Any, **kwargs: Any) -> None:
            raise AssertionError("a group of one must not communicate")

        monkeypatch.setattr(dist, "all_gather", no_collectives)
        d = coordinate_ubatching(True, 600, 2, num_tokens=600)
    finally:
        dist.destroy_process_group()
    assert d.split and d.num_tokens_padded == 600 and len(d.per_rank) == 1


def test_without_dp_coordinate_batch_across_dp_returns_vllms_early_answer() -> None:
    _skip_if_a_process_group_exists()
    assert coordinate_batch_across_dp(
        600, True, DBOConfig(), uniform_decode=False, cudagraph_mode=2
    ) == (False, None, 2)


def test_the_exchange_runs_on_the_current_gpu_over_nccl_and_the_cpu_over_gloo(monkeypatch):
    # No GPU here: the NCCL path is checked up to the device choice, torch's answers stubbed.
    monkeypatch.setattr(agreement_module.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(agreement_module.torch.cuda, "current_device", lambda: 3)
    assert agreement_module.exchange_device(None) == torch.device("cuda", 3)
    monkeypatch.setattr(agreement_module.dist, "get_backend", lambda group=None: "gloo")
    assert agreement_module.exchange_device(None) == torch.device("cpu")
    monkeypatch.setattr(agreement_module.dist, "get_backend", lambda group=None: "ucc")
    with pytest.raises(ValueError, match="gloo .* or NCCL"):
        agreement_module.exchange_device(None)


def test_without_a_process_group_a_split_needing_one_ubatch_is_refused() -> None:
    with pytest.raises(ValueError, match="num_ubatches"):
        coordinate_ubatching(True, 1024, 1)


# --------------------------------------------------------------------------------------------
# Agreement across real gloo process groups


def _dp_scenarios(rank: int, world: int) -> list[tuple[str, dict[str, Any]]]:
    """Each rank's arguments for every scenario, run in this order by every worker."""
    last = world - 1
    return [
        (
            "all_agree",
            dict(
                should_split=True,
                num_tokens_padded=1024 + 256 * rank,
                num_ubatches=2,
                num_tokens=1000 + 256 * rank,
            ),
        ),
        (
            "one_cannot",
            dict(
                should_split=rank != last,
                num_tokens_padded=1024 + 256 * rank,
                num_ubatches=2,
                num_tokens=1000 + 256 * rank,
            ),
        ),
        (
            "mismatched_counts",
            dict(
                should_split=True,
                num_tokens_padded=1024,
                num_ubatches=2 + rank % 2,
                num_tokens=1000,
            ),
        ),
        (
            "padding_empties_rank_0",
            dict(
                should_split=True,
                num_tokens_padded=600 if rank == 0 else 2000,
                num_ubatches=2,
                num_tokens=600 if rank == 0 else 2000,
            ),
        ),
        (
            "bad_argument_on_rank_1",
            dict(
                should_split=True,
                num_tokens_padded=-1 if rank == 1 else 1024,
                num_ubatches=2,
                num_tokens=1000 if rank != 1 else 0,
            ),
        ),
        (
            "after_errors_three_ubatches",
            dict(should_split=True, num_tokens_padded=900 + rank, num_ubatches=3, num_tokens=900),
        ),
        # graph modes differ: rank 0 FULL, the others PIECEWISE; nobody splits
        (
            "graph_modes_differ",
            dict(
                should_split=False,
                num_tokens_padded=100 + 50 * rank,
                num_ubatches=2,
                num_tokens=90 + 50 * rank,
                cudagraph_mode=2 if rank == 0 else 1,
            ),
        ),
        # the last rank runs eager: the agreed mode is NONE, so nobody is padded
        (
            "one_rank_eager",
            dict(
                should_split=False,
                num_tokens_padded=100 + 50 * rank,
                num_ubatches=2,
                num_tokens=90 + 50 * rank,
                cudagraph_mode=0 if rank == last else 2,
            ),
        ),
    ]


def _dp_worker(rank: int, world: int, port: int, out_path: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=30),
    )
    results: dict[str, Any] = {}

    def record(name: str, call: Callable[[], UBatchDecision]) -> None:
        try:
            results[name] = ("ok", call())
        except Exception as exc:  # recorded for the parent to check, type and message
            results[name] = ("error", type(exc).__name__, str(exc))

    for name, kwargs in _dp_scenarios(rank, world):
        record(name, lambda kwargs=kwargs: coordinate_ubatching(**kwargs))
    # vLLM's entry point: every rank clears the prefill threshold; graph modes 2, 1, 2, 1...
    config = DBOConfig(num_ubatches=2, dbo_prefill_token_threshold=512)
    record(
        "vllm_entry",
        lambda: coordinate_batch_across_dp(
            600 + 100 * rank,
            True,
            config,
            num_tokens_padded=640 + 100 * rank,
            uniform_decode=False,
            cudagraph_mode=2 - rank % 2,
        ),
    )
    # and one rank below it: nobody splits, padding by the agreed graph mode only
    record(
        "vllm_entry_below_threshold",
        lambda: coordinate_batch_across_dp(
            600 if rank else 100, True, config, uniform_decode=False, cudagraph_mode=1
        ),
    )
    if world >= 4:
        # A DP group that is not the world: only ranks 1 and 3 take part.
        sub = dist.new_group([1, 3], backend="gloo")
        if rank in (1, 3):
            record(
                "subgroup",
                lambda: coordinate_ubatching(True, 1024 + rank, 2, group=sub, num_tokens=1000),
            )
    dist.destroy_process_group()
    tmp = out_path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(results, f)
    os.replace(tmp, out_path)


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_dp_group(world: int, workdir: Path, deadline_s: float = 45.0) -> list[dict[str, Any]]:
    """Start `world` worker processes, wait for all with a deadline, return each rank's
    results. Kills every worker it started on a timeout, so nothing outlives the test."""
    port = _free_loopback_port()
    env = dict(os.environ)
    repo_root = str(Path(dbo.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo_root, env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    if Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"  # keep gloo's data connections on loopback too
    procs, outs, errs = [], [], []
    try:
        for rank in range(world):
            out = workdir / f"rank{rank}.pkl"
            err = open(workdir / f"rank{rank}.stderr", "wb")
            errs.append(err)
            outs.append(out)
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, str(rank), str(world), str(port), str(out)],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                )
            )
        end = time.monotonic() + deadline_s
        for p in procs:
            p.wait(timeout=max(0.1, end - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"{world}-rank gloo group did not finish in {deadline_s}s:\n"
            + _stderr_tails(workdir, world)
        )
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for e in errs:
            e.close()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        pytest.fail(f"ranks {failed} exited non-zero:\n" + _stderr_tails(workdir, world))
    return [pickle.loads(o.read_bytes()) for o in outs]


def _stderr_tails(workdir: Path, world: int) -> str:
    parts = []
    for r in range(world):
        path = workdir / f"rank{r}.stderr"
        text = path.read_text(errors="replace") if path.exists() else ""
        parts.append(f"--- rank {r} ---\n{text[-2000:]}")
    return "\n".join(parts)


@pytest.fixture(scope="module")
def dp_group_results(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], list]:
    """Results of one gloo group per world size, started on first use and then reused."""
    cache: dict[int, list[dict[str, Any]]] = {}

    def get(world: int) -> list[dict[str, Any]]:
        if world not in cache:
            cache[world] = _run_dp_group(world, tmp_path_factory.mktemp(f"dp{world}"))
        return cache[world]

    return get


def _decisions(results: list[dict[str, Any]], name: str) -> list[UBatchDecision]:
    outcomes = [r[name] for r in results]
    assert all(o[0] == "ok" for o in outcomes), outcomes
    return [o[1] for o in outcomes]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 4])
def test_dp_all_ranks_agree_split_and_pad_to_the_max(dp_group_results, world: int) -> None:
    decisions = _decisions(dp_group_results(world), "all_agree")
    expected_padded = 1024 + 256 * (world - 1)
    assert all(d.split and d.num_tokens_padded == expected_padded for d in decisions)
    assert all(d == decisions[0] for d in decisions)
    assert [p.num_tokens_padded for p in decisions[0].per_rank] == [
        1024 + 256 * r for r in range(world)
    ]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 4])
def test_dp_one_rank_cannot_so_nobody_splits(dp_group_results, world: int) -> None:
    decisions = _decisions(dp_group_results(world), "one_cannot")
    assert not any(d.split for d in decisions)
    assert all(f"[{world - 1}]" in d.reason for d in decisions)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 4])
def test_dp_mismatched_ubatch_counts_raise_on_every_rank(dp_group_results, world: int) -> None:
    outcomes = [r["mismatched_counts"] for r in dp_group_results(world)]
    assert all(o[:2] == ("error", "UBatchAgreementError") for o in outcomes), outcomes
    assert len({o[2] for o in outcomes}) == 1, "every rank gets the same message"
    for r in range(world):
        assert f"rank {r}: {2 + r % 2}" in outcomes[0][2]


@pytest.mark.timeout(60)
def test_dp_padding_to_the_max_that_empties_a_rank_stops_the_split(dp_group_results) -> None:
    decisions = _decisions(dp_group_results(2), "padding_empties_rank_0")
    assert not any(d.split for d in decisions)
    assert all(d.num_tokens_padded == 2000 for d in decisions)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 4])
def test_dp_bad_argument_on_one_rank_raises_on_every_rank(dp_group_results, world: int) -> None:
    outcomes = [r["bad_argument_on_rank_1"] for r in dp_group_results(world)]
    assert outcomes[1][:2] == ("error", "ValueError") and "num_tokens_padded" in outcomes[1][2]
    for r in range(world):
        if r != 1:
            assert outcomes[r][:2] == ("error", "UBatchAgreementError"), outcomes[r]
            assert "[1]" in outcomes[r][2]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 4])
def test_dp_group_still_agrees_after_errors(dp_group_results, world: int) -> None:
    decisions = _decisions(dp_group_results(world), "after_errors_three_ubatches")
    assert all(d.split and d.num_ubatches == 3 for d in decisions)
    assert all(d.num_tokens_padded == 900 + world - 1 for d in decisions)


@pytest.mark.timeout(60)
def test_dp_agreement_over_a_subgroup_counts_only_its_members(dp_group_results) -> None:
    results = dp_group_results(4)
    assert "subgroup" not in results[0] and "subgroup" not in results[2]
    decisions = _decisions([results[1], results[3]], "subgroup")
    assert all(len(d.per_rank) == 2 and d.num_tokens_padded == 1027 for d in decisions)
    assert all(d.split for d in decisions)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 4])
def test_dp_graph_modes_agree_on_the_smallest_and_pad_by_it(dp_group_results, world: int):
    decisions = _decisions(dp_group_results(world), "graph_modes_differ")
    assert all(d == decisions[0] for d in decisions)
    d = decisions[0]
    assert (d.split, d.cudagraph_mode, d.dp_padded) == (False, 1, True)
    assert d.num_tokens_across_dp == (100 + 50 * (world - 1),) * world


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 4])
def test_dp_one_eager_rank_means_no_graph_and_no_padding(dp_group_results, world: int):
    decisions = _decisions(dp_group_results(world), "one_rank_eager")
    d = decisions[0]
    assert all(x == d for x in decisions)
    assert (d.cudagraph_mode, d.dp_padded) == (0, False)
    assert d.num_tokens_across_dp == tuple(100 + 50 * r for r in range(world))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 4])
def test_dp_coordinate_batch_across_dp_answers_as_vllm_does(dp_group_results, world: int):
    outcomes = [r["vllm_entry"] for r in dp_group_results(world)]
    assert all(o[0] == "ok" for o in outcomes), outcomes
    for _, (split, across, mode) in outcomes:
        assert split and mode == 1
        assert across.dtype == torch.int32
        assert across.tolist() == [640 + 100 * (world - 1)] * world


@pytest.mark.timeout(60)
def test_dp_a_rank_below_the_threshold_stops_the_split_but_graphs_still_pad(dp_group_results):
    outcomes = [r["vllm_entry_below_threshold"] for r in dp_group_results(2)]
    assert all(o[0] == "ok" for o in outcomes), outcomes
    assert [(o[1][0], o[1][1].tolist(), o[1][2]) for o in outcomes] == [(False, [600, 600], 1)] * 2


if __name__ == "__main__":
    _rank, _world, _port, _out = sys.argv[1:5]
    _dp_worker(int(_rank), int(_world), int(_port), _out)
