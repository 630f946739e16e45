"""vLLM 0.33's own attention metadata and slices go through `dbo.split.split_attn_metadata`,
and come back as vLLM's records with the values vLLM's split computes."""

from __future__ import annotations

import pytest
import torch

from dbo.split import CommonAttentionMetadata, maybe_create_ubatch_slices, split_attn_metadata

vllm_utils = pytest.importorskip(
    "vllm.v1.worker.ubatch_utils", reason="vLLM 0.33 not installed (pip install --no-deps vllm)"
)
vllm_backend = pytest.importorskip("vllm.v1.attention.backend")

QUERY, SEQ = [5, 3, 6], [9, 3, 20]


def _theirs(meta: CommonAttentionMetadata):
    return vllm_backend.CommonAttentionMetadata(
        query_start_loc=meta.query_start_loc,
        query_start_loc_cpu=meta.query_start_loc_cpu,
        seq_lens=meta.seq_lens,
        num_reqs=meta.num_reqs,
        num_actual_tokens=meta.num_actual_tokens,
        max_query_len=meta.max_query_len,
        max_seq_len=meta.max_seq_len,
        block_table_tensor=meta.block_table_tensor,
        slot_mapping=meta.slot_mapping,
        positions=meta.positions,
        seq_lens_cpu_upper_bound=meta.seq_lens_cpu_upper_bound,
    )


def _vllm_slices():
    plain, _ = vllm_utils.maybe_create_ubatch_slices(True, QUERY, 14, 3, 2)
    return plain


def test_vllms_record_is_accepted_and_comes_back_as_vllms_record():
    theirs = _theirs(CommonAttentionMetadata.make(QUERY, SEQ))
    parts = split_attn_metadata(_vllm_slices(), theirs)
    assert all(type(p) is vllm_backend.CommonAttentionMetadata for p in parts)


@pytest.mark.parametrize(
    "name",
    [
        "query_start_loc_cpu",
        "query_start_loc",
        "seq_lens",
        "seq_lens_cpu_upper_bound",
        "block_table_tensor",
        "slot_mapping",
        "positions",
    ],
)
def test_every_tensor_field_of_a_vllm_split_matches_vllms_own(name):
    theirs = _theirs(CommonAttentionMetadata.make(QUERY, SEQ))
    ours = split_attn_metadata(_vllm_slices(), theirs)
    reference = vllm_utils.split_attn_metadata(_vllm_slices(), theirs)
    for a, b in zip(ours, reference):
        assert torch.equal(getattr(a, name), getattr(b, name))


@pytest.mark.parametrize("name", ["num_reqs", "num_actual_tokens", "max_query_len", "max_seq_len"])
def test_every_count_of_a_vllm_split_matches_vllms_own(name):
    theirs = _theirs(CommonAttentionMetadata.make(QUERY, SEQ))
    ours = split_attn_metadata(_vllm_slices(), theirs)
    reference = vllm_utils.split_attn_metadata(_vllm_slices(), theirs)
    assert [getattr(p, name) for p in ours] == [getattr(p, name) for p in reference]


def test_our_slices_split_vllms_record_too():
    theirs = _theirs(CommonAttentionMetadata.make(QUERY, SEQ))
    ours, _ = maybe_create_ubatch_slices(True, QUERY, 14, 3, 2)
    parts = split_attn_metadata(ours, theirs)
    assert [p.num_actual_tokens for p in parts] == [7, 7]


def test_a_padding_only_slice_is_refused_with_vllms_reason_by_both():
    meta = CommonAttentionMetadata.make([2, 2], [2, 2], num_tokens_padded=16, num_reqs_padded=3)
    theirs = _theirs(meta)
    _, padded = vllm_utils.maybe_create_ubatch_slices(True, [2, 2], 16, 3, 2)
    with pytest.raises(AssertionError, match="Token slice start outside of first request"):
        vllm_utils.split_attn_metadata(padded, theirs)
    with pytest.raises(ValueError, match="Token slice start outside of first request"):
        split_attn_metadata(padded, theirs)


def test_a_vllm_record_without_the_seq_lens_upper_bound_is_refused_as_vllm_refuses_it():
    meta = CommonAttentionMetadata.make(QUERY, SEQ)
    theirs = _theirs(meta)
    theirs.seq_lens_cpu_upper_bound = None
    with pytest.raises(AssertionError):
        vllm_utils.split_attn_metadata(_vllm_slices(), theirs)
    with pytest.raises(ValueError, match="seq_lens_cpu_upper_bound is None"):
        split_attn_metadata(_vllm_slices(), theirs)


def test_dbo_sims_record_has_no_required_field_vllm_0_33_lacks():
    from dataclasses import fields

    theirs = {f.name for f in fields(vllm_backend.CommonAttentionMetadata)}
    extra = {f.name for f in fields(CommonAttentionMetadata)} - theirs
    assert extra == {"num_computed_tokens_cpu"}  # optional here: derived when omitted


def test_computed_tokens_are_derived_as_vllm_derives_them():
    made = CommonAttentionMetadata.make(QUERY, SEQ)
    meta = CommonAttentionMetadata(
        **{k: v for k, v in made.__dict__.items() if k != "num_computed_tokens_cpu"}
    )
    theirs = _theirs(meta)
    assert torch.equal(meta.compute_num_computed_tokens(), theirs.compute_num_computed_tokens())


def _negative(part) -> bool:
    qsl = part.query_start_loc_cpu
    return bool((qsl[1:] < qsl[:-1]).any() or (part.seq_lens < 0).any() or part.max_query_len < 0)


def test_on_random_slices_dbo_sim_gives_vllms_metadata_or_refuses_what_vllm_gets_wrong():
    import random

    rng = random.Random(31)
    compared = 0
    for case in range(300):
        query = [rng.choice([0, 1, 3, 6]) for _ in range(rng.randint(1, 5))]
        query[0] = query[0] or 1
        meta = CommonAttentionMetadata.make(
            query,
            [q + rng.randint(0, 5) for q in query],
            num_tokens_padded=sum(query) + rng.choice([0, 4]),
        )
        r0, t0 = rng.randint(0, meta.num_reqs - 1), rng.randint(0, meta.num_actual_tokens - 1)
        s = vllm_utils.UBatchSlice(
            slice(r0, rng.randint(r0 + 1, meta.num_reqs)),
            slice(t0, rng.randint(t0 + 1, meta.num_actual_tokens)),
        )
        try:
            (reference,) = vllm_utils.split_attn_metadata([s], _theirs(meta))
        except AssertionError:
            with pytest.raises(ValueError):
                split_attn_metadata([s], _theirs(meta))
            continue
        if _negative(reference):
            with pytest.raises(ValueError):
                split_attn_metadata([s], _theirs(meta))
            continue
        if min(s.token_slice.stop, sum(query)) > int(
            meta.query_start_loc_cpu[s.request_slice.stop]
        ):
            # vLLM leaves real tokens of the slice in no request's query: refused here
            with pytest.raises(ValueError, match="belong to requests after its last one"):
                split_attn_metadata([s], _theirs(meta))
            continue
        (ours,) = split_attn_metadata([s], _theirs(meta))
        compared += 1
        for name in ("query_start_loc_cpu", "seq_lens", "slot_mapping", "block_table_tensor"):
            assert torch.equal(getattr(ours, name), getattr(reference, name)), (
                f"case {case}: {name}"
            )
        assert (ours.num_reqs, ours.max_query_len) == (reference.num_reqs, reference.max_query_len)
    assert compared > 30  # many slices are compared field by field, not refused
