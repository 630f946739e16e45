"""Tests of dbo.split's ubatch-metadata checker: one per invariant (each a split broken in
exactly one way, caught by field, ubatch and request), silence on every correct split, and
the split parts of vLLM parity (thresholds, DBO not configured, V2's upper bound)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from dbo.split import (
    CommonAttentionMetadata,
    DBOConfig,
    MetadataViolation,
    UBatchMetadataError,
    UBatchSlice,
    check_split_inputs,
    check_ubatch_metadata,
    find_metadata_violation,
    is_last_ubatch_empty,
    maybe_create_ubatch_slices,
    split_attn_metadata,
)

# 23 tokens of four requests, cut at 11: request 1 (tokens 3..11) is in both ubatches, which
# hold 2 and 3 requests.
QUERY, SEQ, PROMPTS = [3, 9, 4, 7], [40, 33, 4, 20], [40, 40, 4, 20]


def _split(block_size: int = 16, **make):
    meta = CommonAttentionMetadata.make(
        QUERY, SEQ, block_size=block_size, prompt_lens=PROMPTS, **make
    )
    slices, _ = maybe_create_ubatch_slices(True, QUERY, meta.num_actual_tokens, len(QUERY), 2)
    return meta, slices, split_attn_metadata(slices, meta)


def _violation(parent, parts, slices=None, **kw) -> MetadataViolation:
    found = find_metadata_violation(parent, parts, slices, **kw)
    assert found is not None, "the broken split was not caught"
    return found


def test_a_correct_split_has_no_violation() -> None:
    meta, slices, parts = _split()
    assert find_metadata_violation(meta, parts, slices, block_size=16) is None
    assert find_metadata_violation(meta, parts) is None  # slices inferred
    check_ubatch_metadata(meta, parts)


@pytest.mark.parametrize("num_ubatches", [2, 3, 4])
def test_random_correct_splits_have_no_violation(num_ubatches: int) -> None:
    rng = random.Random(7 + num_ubatches)
    checked = 0
    for _ in range(60):
        lengths = [rng.randint(0, 30) for _ in range(rng.randint(1, 8))]
        real = sum(lengths)
        padded = real + rng.randint(0, 12)
        if real == 0 or is_last_ubatch_empty(real, padded, num_ubatches):
            continue
        seqs = [q + rng.randint(0, 50) for q in lengths]
        meta = CommonAttentionMetadata.make(
            lengths, seqs, block_size=8, num_tokens_padded=padded, num_reqs_padded=len(lengths) + 2
        )
        plain, padded_slices = maybe_create_ubatch_slices(
            True, lengths, padded, len(lengths) + 2, num_ubatches
        )
        for slices in (plain, padded_slices):
            parts = split_attn_metadata(slices, meta)
            assert find_metadata_violation(meta, parts, slices, block_size=8) is None
        checked += 1
    assert checked > 20


def test_shapes_a_record_with_another_ubatchs_sequence_metadata_is_caught() -> None:
    # ubatch 1 keeps ubatch 0's query_start_loc and seq_lens with its own block table.
    meta, _, (first, second) = _split()
    mixed = replace(
        first, block_table_tensor=second.block_table_tensor, slot_mapping=second.slot_mapping
    )
    found = _violation(meta, [first, mixed])
    assert (found.invariant, found.field, found.ubatch) == ("shapes", "block_table_tensor", 1)


def test_coverage_a_token_run_by_two_ubatches_is_caught() -> None:
    meta, slices, (first, second) = _split()
    # ubatch 1 starts one token early: token 10 would run twice.
    early = [slices[0], UBatchSlice(slices[1].request_slice, slice(10, 23))]
    found = _violation(meta, [first, second], early)
    assert (found.invariant, found.ubatch) == ("coverage", 1)


def test_coverage_a_row_standing_for_the_wrong_request_is_caught() -> None:
    meta, slices, (first, second) = _split()
    shifted = [slices[0], UBatchSlice(slice(2, 5), slices[1].token_slice)]
    found = _violation(meta, [first, second], shifted)
    assert found.invariant == "coverage" and found.ubatch == 1


def test_padding_only_in_the_last_ubatch() -> None:
    meta = CommonAttentionMetadata.make([3, 3], [3, 3], num_tokens_padded=16)
    # Hand-built: ubatch 0 holds the 6 real tokens and 2 padding ones, ubatch 1 only padding.
    first = split_attn_metadata([UBatchSlice(slice(0, 2), slice(0, 8))], meta)[0]
    pad_meta = CommonAttentionMetadata.make([], [], num_tokens_padded=8)
    found = _violation(meta, [first, pad_meta])
    assert (found.invariant, found.ubatch) == ("padding", 0)
    assert "not the last ubatch" in found.message


def test_computed_tokens_of_a_cut_request_continuation_are_checked() -> None:
    meta, _, (first, second) = _split()
    computed = second.num_computed_tokens_cpu.clone()
    computed[0] = meta.num_computed_tokens_cpu[1]  # the parent's count, as vLLM kept it
    found = _violation(meta, [first, replace(second, num_computed_tokens_cpu=computed)])
    assert (found.invariant, found.field, found.ubatch, found.request) == (
        "computed tokens",
        "num_computed_tokens_cpu",
        1,
        1,
    )
    assert "seq_lens - query_lens" in found.message


@pytest.mark.parametrize("field", ["positions", "is_prefilling", "seq_lens_cpu_upper_bound"])
def test_fields_a_dropped_optional_field_is_named(field: str) -> None:
    meta, _, (first, second) = _split()
    found = _violation(meta, [replace(first, **{field: None}), second])
    assert (found.invariant, found.field, found.ubatch) == ("fields", field, 0)
    assert "dropped" in found.message


def test_fields_a_positions_slice_off_by_one_is_caught() -> None:
    meta, _, (first, second) = _split()
    found = _violation(meta, [first, replace(second, positions=second.positions + 1)])
    assert (found.field, found.ubatch, found.request) == ("positions", 1, 1)


def test_block_table_rows_must_be_their_requests() -> None:
    meta, _, (first, second) = _split()
    swapped = second.block_table_tensor.flip(0).contiguous()
    found = _violation(meta, [first, replace(second, block_table_tensor=swapped)])
    assert (found.invariant, found.field, found.ubatch, found.request) == (
        "block table",
        "block_table_tensor",
        1,
        1,
    )


def test_slot_mapping_must_be_its_tokens_and_inside_its_requests_blocks() -> None:
    meta, slices, (first, second) = _split()
    slots = second.slot_mapping.clone()
    slots[2] += 1
    found = _violation(meta, [first, replace(second, slot_mapping=slots)])
    assert (found.field, found.ubatch) == ("slot_mapping", 1)
    # Against the block table alone: a parent whose own slot is outside its request's blocks.
    bad_parent_slots = meta.slot_mapping.clone()
    bad_parent_slots[0] = 999
    parent = replace(meta, slot_mapping=bad_parent_slots)
    first_bad = replace(first, slot_mapping=bad_parent_slots[:11])
    found = _violation(parent, [first_bad, second], slices, block_size=16)
    assert (found.field, found.ubatch, found.request) == ("slot_mapping", 0, 0)


def test_check_ubatch_metadata_raises_naming_field_ubatch_and_request() -> None:
    meta, _, (first, second) = _split()
    with pytest.raises(UBatchMetadataError, match=r"ubatch 1, request 1, num_computed_tokens"):
        computed = second.num_computed_tokens_cpu.clone()
        computed[0] -= 4
        check_ubatch_metadata(meta, [first, replace(second, num_computed_tokens_cpu=computed)])


def test_check_split_inputs_finds_metadata_inside_step_inputs() -> None:
    meta, _, parts = _split()
    x = torch.zeros(23, 4)
    good = [{"x": x[:11], "attn": parts[0]}, {"x": x[11:], "attn": parts[1]}]
    assert check_split_inputs({"x": x, "attn": meta}, good) is None
    dropped = [good[0], {"x": x[11:], "attn": replace(parts[1], positions=None)}]
    error = check_split_inputs({"x": x, "attn": meta}, dropped)
    assert isinstance(error, UBatchMetadataError) and error.violation.field == "positions"
    missing = check_split_inputs({"x": x, "attn": meta}, [good[0], {"x": x[11:]}])
    assert missing is not None and missing.violation.ubatch == 1
    assert check_split_inputs(x, [x[:11], x[11:]]) is None  # no metadata: nothing to check


def test_bad_arguments_are_refused() -> None:
    meta, _, parts = _split()
    with pytest.raises(TypeError, match="parent"):
        find_metadata_violation({"query_start_loc": 0}, parts)
    with pytest.raises(TypeError, match=r"ubatches\[1\]"):
        find_metadata_violation(meta, [parts[0], object()])


# --------------------------------------------------------------------------------------------
# vLLM parity: the split parts


@pytest.mark.parametrize("field", ["dbo_decode_token_threshold", "dbo_prefill_token_threshold"])
def test_a_threshold_below_the_ubatch_count_is_refused(field: str) -> None:
    with pytest.raises(ValueError, match=f"{field} \\(2\\) is below num_ubatches \\(3\\)"):
        DBOConfig(num_ubatches=3, **{field: 2})
    DBOConfig(num_ubatches=3, **{field: 3})  # equal is fine


def test_a_vllm_config_with_a_threshold_below_its_ubatch_count_is_refused() -> None:
    from types import SimpleNamespace

    from dbo.split import check_ubatch_thresholds

    config = SimpleNamespace(
        use_ubatching=True,
        num_ubatches=2,
        dbo_decode_token_threshold=1,
        dbo_prefill_token_threshold=512,
    )
    with pytest.raises(ValueError, match=r"dbo_decode_token_threshold \(1\) is below"):
        check_ubatch_thresholds(config, 64, uniform_decode=True)
    assert check_ubatch_thresholds(config, 600, uniform_decode=False)


@pytest.mark.parametrize("num_ubatches", [0, 1])
def test_maybe_create_ubatch_slices_without_dbo_configured_returns_none(num_ubatches: int):
    assert maybe_create_ubatch_slices(True, [8, 8], 16, 2, num_ubatches) == (None, None)


def test_seq_lens_cpu_upper_bound_is_on_the_record_and_follows_the_cut() -> None:
    meta, _, (first, second) = _split()
    assert meta.seq_lens_cpu_upper_bound.device.type == "cpu"
    assert meta.seq_lens_cpu_upper_bound.tolist() == SEQ
    # request 1 is cut: the earlier part's bound shrinks with its seq_len, the later keeps it
    assert first.seq_lens_cpu_upper_bound.tolist() == first.seq_lens.tolist()
    assert second.seq_lens_cpu_upper_bound.tolist() == second.seq_lens.tolist()
    assert int(first.seq_lens_cpu_upper_bound[-1]) < SEQ[1]


@pytest.mark.timeout(60)
def test_verify_fails_a_split_whose_metadata_breaks_an_invariant() -> None:
    import dbo

    meta, slices, parts = _split()
    x = torch.randn(23, 4, dtype=torch.float64)

    def forward(inputs):
        return inputs["x"] * 2.0

    def split(inputs, n):
        return [
            {"x": inputs["x"][s.token_slice], "attn": replace(m, positions=None)}
            for s, m in zip(slices, parts)
        ]

    report = dbo.verify(forward, {"x": x, "attn": meta}, split=split)
    assert not report.ok and report.outputs_match  # the values agree; the metadata does not
    assert isinstance(report.metadata_error, UBatchMetadataError) and report.error is None
    assert "positions" in report.describe()


def test_check_dp_padding_without_a_group_checks_this_ranks_count() -> None:
    from dbo.split import UBatchAgreementError, check_dp_padding

    if torch.distributed.is_initialized():
        pytest.skip("a process group is initialised in this process")
    check_dp_padding(600, torch.tensor([600], dtype=torch.int32))
    with pytest.raises(UBatchAgreementError, match=r"rank 0 runs 1 \(agreed 600\)"):
        check_dp_padding(1, [600])
