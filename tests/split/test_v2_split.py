"""Model runner V2's split (vLLM 0.33): create_ubatch_slices on an input batch, each ubatch's
model inputs, the merged output, and get_num_ubatches."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from dbo.split import (
    CommonAttentionMetadata,
    DBOConfig,
    IntermediateTensors,
    create_ubatch_slices,
    get_num_ubatches,
    merge_ubatch_outputs,
    slice_model_inputs,
    split_attn_metadata,
)


def _batch(query: list[int], tokens_padded: int, reqs_padded: int) -> SimpleNamespace:
    return SimpleNamespace(
        num_scheduled_tokens=query,
        num_reqs=len(query),
        num_tokens_after_padding=tokens_padded,
        num_reqs_after_padding=reqs_padded,
    )


def _spans(slices) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    return [
        ((s.request_slice.start, s.request_slice.stop), (s.token_slice.start, s.token_slice.stop))
        for s in slices
    ]


def test_a_trailing_ubatch_in_the_padding_holds_the_last_request_with_no_query():
    slices = create_ubatch_slices(_batch([3, 1], 16, 2), 2)
    assert _spans(slices) == [((0, 2), (0, 8)), ((1, 2), (8, 16))]


def test_the_padding_only_ubatch_gets_a_record_with_no_request_rows():
    meta = CommonAttentionMetadata.make([3, 1], [5, 4], num_tokens_padded=16)
    parts = split_attn_metadata(
        create_ubatch_slices(_batch([3, 1], 16, 2), 2), meta, allow_empty=True
    )
    assert [(p.num_reqs, p.num_actual_tokens) for p in parts] == [(2, 8), (0, 8)]


def test_an_input_batch_without_vllms_fields_is_refused():
    with pytest.raises(TypeError, match="num_reqs_after_padding"):
        create_ubatch_slices(SimpleNamespace(num_scheduled_tokens=[4], num_reqs=1), 2)


def test_create_ubatch_slices_agrees_with_vllms_on_random_batches():
    v2 = pytest.importorskip("vllm.v1.worker.gpu.ubatch_utils", reason="vLLM 0.33 not installed")
    rng = random.Random(33)
    for case in range(200):
        query = [rng.randint(1, 9) for _ in range(rng.randint(1, 5))]
        batch = _batch(
            query, sum(query) + rng.choice([0, 1, 7, 30]), len(query) + rng.randint(0, 2)
        )
        batch.num_scheduled_tokens = torch.tensor(query).numpy()
        n = rng.choice([2, 3])
        ours, theirs = create_ubatch_slices(batch, n), v2.create_ubatch_slices(batch, n)
        assert _spans(ours) == _spans(theirs), f"case {case}: {query}, n={n}"


def test_slice_model_inputs_narrows_the_per_token_inputs_only():
    inputs = {"input_ids": torch.arange(8), "positions": torch.arange(8) + 100, "scale": 3}
    sliced = slice_model_inputs(inputs, slice(2, 5))
    assert sliced["input_ids"].tolist() == [2, 3, 4]
    assert sliced["positions"].tolist() == [102, 103, 104] and sliced["scale"] == 3


def test_slice_model_inputs_cuts_mrope_positions_along_tokens():
    sliced = slice_model_inputs({"positions": torch.arange(24).reshape(3, 8)}, slice(6, 8))
    assert sliced["positions"].tolist() == [[6, 7], [14, 15], [22, 23]]


def test_slice_model_inputs_slices_intermediate_tensors_by_key():
    it = IntermediateTensors({"hidden": torch.arange(6), "residual": torch.arange(6) * 2})
    sliced = slice_model_inputs(
        {"positions": torch.arange(6), "intermediate_tensors": it}, slice(4, 6)
    )
    assert sliced["intermediate_tensors"] == IntermediateTensors(
        {"hidden": torch.tensor([4, 5]), "residual": torch.tensor([8, 10])}
    )


def test_model_inputs_without_positions_are_refused():
    with pytest.raises(KeyError, match="positions"):
        slice_model_inputs({"input_ids": torch.arange(4)}, slice(0, 2))


def test_merge_concatenates_hidden_states_and_tuples_along_tokens():
    a, b = torch.ones(2, 3), torch.zeros(1, 3)
    assert merge_ubatch_outputs([a, b]).shape == (3, 3)
    merged = merge_ubatch_outputs([(a, a[:, :1]), (b, b[:, :1])])
    assert [t.shape for t in merged] == [(3, 3), (3, 1)]


def test_merge_joins_intermediate_tensors_key_by_key():
    parts = [
        IntermediateTensors({"h": torch.tensor([1, 2])}),
        IntermediateTensors({"h": torch.tensor([3])}),
    ]
    assert merge_ubatch_outputs(parts) == IntermediateTensors({"h": torch.tensor([1, 2, 3])})


def test_merge_of_vllms_intermediate_tensors_matches_vllms_merge():
    v2 = pytest.importorskip("vllm.v1.worker.gpu.ubatch_utils", reason="vLLM 0.33 not installed")
    from vllm.sequence import IntermediateTensors as Theirs

    parts = [
        Theirs({"h": torch.arange(3), "r": torch.arange(3)}),
        Theirs({"h": torch.arange(2), "r": torch.ones(2, dtype=torch.long)}),
    ]
    ours = merge_ubatch_outputs(parts)
    assert type(ours) is Theirs and ours == v2.merge_ubatch_outputs(parts)


def test_merge_refuses_outputs_of_different_kinds():
    with pytest.raises(TypeError, match="outputs of different kinds"):
        merge_ubatch_outputs([torch.ones(1), (torch.ones(1),)])


def test_merge_refuses_no_outputs():
    with pytest.raises(ValueError, match="at least one ubatch"):
        merge_ubatch_outputs([])


@pytest.mark.parametrize("use, expected", [(True, 3), (False, 1)])
def test_get_num_ubatches_is_one_with_ubatching_off(use, expected):
    assert get_num_ubatches(DBOConfig(num_ubatches=3, use_ubatching=use)) == expected


def test_get_num_ubatches_agrees_with_vllms():
    v1 = pytest.importorskip("vllm.v1.worker.ubatch_utils", reason="vLLM 0.33 not installed")
    for use in (True, False):
        config = SimpleNamespace(num_ubatches=2, use_ubatching=use)
        assert get_num_ubatches(config) == v1.get_num_ubatches(config)
