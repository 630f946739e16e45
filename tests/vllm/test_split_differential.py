"""dbo.split against vLLM 0.33's `ubatch_utils` on random batches: the slices, and every
field of each ubatch's attention metadata (vLLM's `_make_metadata_with_slice`)."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from dbo.split import CommonAttentionMetadata, maybe_create_ubatch_slices, split_attn_metadata

ubatch_utils = pytest.importorskip(
    "vllm.v1.worker.ubatch_utils", reason="vLLM 0.33 is not installed: make vllm-oracle"
)
backend = pytest.importorskip("vllm.v1.attention.backend")

# The fields vLLM's _make_metadata_with_slice fills (is_prefilling: see its own test below).
FIELDS = tuple(
    "query_start_loc query_start_loc_cpu seq_lens num_reqs num_actual_tokens max_query_len "
    "max_seq_len block_table_tensor slot_mapping positions seq_lens_cpu_upper_bound".split()
)


def random_batch(rng: random.Random) -> tuple[list[int], CommonAttentionMetadata, int, int]:
    query = [rng.randint(1, 12) for _ in range(rng.randint(1, 6))]
    seq = [q + rng.randint(0, 20) for q in query]
    tokens = sum(query) + rng.randint(0, 4)
    reqs = len(query) + rng.randint(0, 2)
    prompts = [s - rng.randint(0, 1) for s in seq]
    meta = CommonAttentionMetadata.make(
        query, seq, num_tokens_padded=tokens, num_reqs_padded=reqs, prompt_lens=prompts
    )
    return query, meta, tokens, reqs


def as_vllm(meta: CommonAttentionMetadata):
    """The same batch as vLLM's record: every field the two records share, by name."""
    theirs = {f.name for f in dataclasses.fields(backend.CommonAttentionMetadata)}
    shared = {f.name for f in dataclasses.fields(meta)} & theirs
    return backend.CommonAttentionMetadata(**{name: getattr(meta, name) for name in shared})


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is not None and b is not None and torch.equal(a.long(), b.long())
    return a == b


def test_slices_agree_with_vllms_on_random_batches():
    rng = random.Random(0)
    for _ in range(200):
        query, _, tokens, reqs = random_batch(rng)
        n = rng.choice([2, 3])
        ours = maybe_create_ubatch_slices(True, query, tokens, reqs, n)
        theirs = ubatch_utils.maybe_create_ubatch_slices(True, np.array(query), tokens, reqs, n)
        for mine, vllms in zip(ours, theirs):
            got = [(s.request_slice, s.token_slice) for s in mine]
            want = [(s.request_slice, s.token_slice) for s in vllms]
            # Deliberate: where a slice starts past the real tokens (vLLM: a negative-length
            # or padding-request slice), dbo.split clamps it onto the last real request.
            if all(s.token_slice.start < sum(query) for s in vllms):
                assert got == want, (query, tokens, reqs, n)


def test_every_metadata_field_agrees_with_vllms_on_random_slices():
    rng = random.Random(1)
    compared = refused = 0
    for _ in range(300):
        query, meta, tokens, reqs = random_batch(rng)
        start = rng.randrange(0, tokens)
        stop = rng.randint(start + 1, tokens)
        cu = meta.query_start_loc_cpu.tolist()
        first = max(r for r in range(reqs) if cu[r] <= start)
        last = min([r for r in range(reqs) if cu[r + 1] >= stop] or [reqs - 1])
        sl = ubatch_utils.UBatchSlice(slice(first, last + 1), slice(start, stop))
        try:
            (want,) = ubatch_utils.split_attn_metadata([sl], as_vllm(meta))
        except AssertionError:
            with pytest.raises(ValueError):
                split_attn_metadata([sl], meta)
            refused += 1
            continue
        (got,) = split_attn_metadata([sl], as_vllm(meta))
        for name in FIELDS:
            assert same(getattr(got, name), getattr(want, name)), (name, query, sl)
        compared += 1
    assert compared > 100 and refused > 0


def test_no_random_slice_gets_negative_or_inconsistent_metadata():
    rng = random.Random(2)
    checked = 0
    for _ in range(300):
        _, meta, tokens, reqs = random_batch(rng)
        start = rng.randrange(0, tokens)
        stop = rng.randint(start + 1, tokens)
        cu = meta.query_start_loc_cpu.tolist()
        first = rng.choice([r for r in range(reqs) if cu[r] <= start])
        last = rng.randint(first, reqs - 1)
        try:
            (part,) = split_attn_metadata(
                [ubatch_utils.UBatchSlice(slice(first, last + 1), slice(start, stop))], meta
            )
        except ValueError:
            continue
        qsl = part.query_start_loc_cpu
        assert int(qsl[0]) == 0 and bool((qsl[1:] >= qsl[:-1]).all())
        assert part.max_query_len >= 0 and bool((part.seq_lens >= 0).all())
        computed = part.num_computed_tokens_cpu
        assert bool((computed >= 0).all()) and bool((computed <= part.seq_lens).all())
        checked += 1
    assert checked > 50


def test_vllm_drops_is_prefilling_from_a_ubatchs_metadata():
    """A vLLM 0.33 bug by its own contract: the batch's `is_prefilling` (read by backends that
    treat prefill rows apart) is not carried into the ubatches; dbo.split slices it."""
    meta = CommonAttentionMetadata.make([4, 4], [8, 4], prompt_lens=[8, 10])
    sl = ubatch_utils.UBatchSlice(slice(0, 1), slice(0, 4))
    (theirs,) = ubatch_utils.split_attn_metadata([sl], as_vllm(meta))
    (ours,) = split_attn_metadata([sl], meta)
    assert theirs.is_prefilling is None
    assert ours.is_prefilling.tolist() == meta.is_prefilling[:1].tolist()


def test_vllm_returns_a_decreasing_query_start_loc_for_a_request_slice_past_its_tokens():
    """A vLLM 0.33 bug by its own contract: request 1 starts at token 5, after the slice's
    last token, and its query length comes out negative; dbo.split refuses the slice."""
    meta = CommonAttentionMetadata.make([5, 3], [5, 3])
    sl = ubatch_utils.UBatchSlice(slice(0, 2), slice(0, 3))
    (theirs,) = ubatch_utils.split_attn_metadata([sl], as_vllm(meta))
    assert theirs.query_start_loc_cpu.tolist() == [0, 5, 3]
    with pytest.raises(ValueError, match="after the slice's tokens end"):
        split_attn_metadata([sl], meta)
