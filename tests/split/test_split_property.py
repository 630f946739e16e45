"""Property: over random batches and random slices, `split_attn_metadata` either refuses the
slice (ValueError, before any work) or returns metadata that is non-negative and consistent
with itself and its slice. A seeded loop, so a failure names a reproducible case."""

from __future__ import annotations

import random

import pytest
import torch

from dbo.split import (
    CommonAttentionMetadata,
    UBatchSlice,
    maybe_create_ubatch_slices,
    split_attn_metadata,
)

CASES = 300


def _random_batch(rng: random.Random) -> tuple[list[int], CommonAttentionMetadata]:
    query = [rng.choice([0, 1, 1, 2, 5, 9]) for _ in range(rng.randint(1, 6))]
    if sum(query) == 0:
        query[0] = 1
    seq = [q + rng.randint(0, 12) for q in query]
    padded_tokens = sum(query) + rng.choice([0, 0, 1, 4, 16])
    padded_reqs = len(query) + rng.choice([0, 0, 1, 3])
    meta = CommonAttentionMetadata.make(
        query, seq, num_tokens_padded=padded_tokens, num_reqs_padded=padded_reqs
    )
    return query, meta


def _random_slice(rng: random.Random, meta: CommonAttentionMetadata) -> UBatchSlice:
    r0 = rng.randint(0, meta.num_reqs)
    t0 = rng.randint(0, meta.num_actual_tokens)
    return UBatchSlice(
        slice(r0, rng.randint(r0, meta.num_reqs)),
        slice(t0, rng.randint(t0, meta.num_actual_tokens)),
    )


def _problems(part: CommonAttentionMetadata, ubatch_slice: UBatchSlice) -> list[str]:
    qsl = part.query_start_loc_cpu.tolist()
    query = [b - a for a, b in zip(qsl, qsl[1:])]
    seq = part.seq_lens.tolist()
    computed = part.num_computed_tokens_cpu.tolist()
    checks = {
        "query_start_loc starts at 0": qsl[:1] == [0],
        "query lengths >= 0": all(q >= 0 for q in query),
        "query_start_loc on device == on host": part.query_start_loc.tolist() == qsl,
        "num_reqs + 1 query_start_loc entries": len(qsl) == part.num_reqs + 1,
        "num_reqs == the slice's requests": part.num_reqs == ubatch_slice.num_requests,
        "queries fit the tokens": qsl[-1] <= part.num_actual_tokens,
        "one slot per token": part.slot_mapping.shape[0] == part.num_actual_tokens,
        "num_actual_tokens == the slice's": part.num_actual_tokens == ubatch_slice.num_tokens,
        "seq_lens >= query lengths": all(s >= q for s, q in zip(seq, query)),
        "computed == seq_lens - query": computed == [s - q for s, q in zip(seq, query)],
        "max_query_len == the longest query": part.max_query_len == max(query, default=0),
        "max_seq_len >= every seq_len": part.max_seq_len >= max(seq, default=0),
        "one block-table row per request": part.block_table_tensor.shape[0] == part.num_reqs,
        "upper bound >= seq_lens": bool((part.seq_lens_cpu_upper_bound >= part.seq_lens).all()),
    }
    return [name for name, ok in checks.items() if not ok]


def test_random_slices_are_refused_or_give_consistent_non_negative_metadata():
    rng = random.Random(29)
    refused = 0
    for case in range(CASES):
        _, meta = _random_batch(rng)
        ubatch_slice = _random_slice(rng, meta)
        try:
            (part,) = split_attn_metadata([ubatch_slice], meta)
        except ValueError:
            refused += 1
            continue
        problems = _problems(part, ubatch_slice)
        where = f"case {case}: {ubatch_slice} on {meta.query_start_loc_cpu.tolist()}"
        assert not problems, f"{where}: {problems}"
    assert 0 < refused < CASES  # both branches exercised: the loop tests something


@pytest.mark.parametrize("allow_empty", [False, True])
def test_every_split_the_slicer_makes_is_consistent_or_refused_only_when_padding_only(
    allow_empty,
):
    rng = random.Random(30)
    for case in range(CASES):
        query, meta = _random_batch(rng)
        n = rng.choice([2, 2, 3, 4])
        plain, padded = maybe_create_ubatch_slices(
            True, query, meta.num_actual_tokens, meta.num_reqs, n
        )
        for slices in (plain, padded):
            real_start = [s.token_slice.start < sum(query) for s in slices if not s.is_empty()]
            if not allow_empty and not all(real_start):
                with pytest.raises(ValueError):
                    split_attn_metadata(slices, meta)
                continue
            if not allow_empty and any(s.is_empty() for s in slices):
                continue  # an empty unpadded slice: refused too, as vLLM's is_empty assert
            parts = split_attn_metadata(slices, meta, allow_empty=allow_empty)
            for part, s in zip(parts, slices):
                if part.num_reqs == 0:  # allow_empty's record of a ubatch without real tokens
                    assert part.query_start_loc_cpu.tolist() == [0]
                    continue
                assert not _problems(part, s), f"case {case}: {s}: {_problems(part, s)}"


def test_a_padding_only_ubatch_is_refused_where_it_returned_negative_metadata():
    meta = CommonAttentionMetadata.make([2, 2], [2, 2], num_tokens_padded=16, num_reqs_padded=3)
    _, padded = maybe_create_ubatch_slices(True, [2, 2], 16, 3, 2)
    assert padded[1].token_slice == slice(8, 16)  # all of it padding
    with pytest.raises(ValueError, match="Token slice start outside of first request"):
        split_attn_metadata(padded, meta)


def test_a_padding_only_ubatch_is_still_legal_under_allow_empty():
    meta = CommonAttentionMetadata.make([2, 2], [2, 2], num_tokens_padded=16, num_reqs_padded=3)
    _, padded = maybe_create_ubatch_slices(True, [2, 2], 16, 3, 2)
    parts = split_attn_metadata(padded, meta, allow_empty=True)
    assert parts[1].num_reqs == 0 and parts[1].num_actual_tokens == 8
    assert torch.equal(parts[1].slot_mapping, meta.slot_mapping[8:16])
