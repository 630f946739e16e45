"""`dbo.verify(..., slices=, split_rules=)`: an explicit ubatch layout, empty ubatches legal
where the engine's split runs them and refused with its own rule where it does not, and a
broken split reported beside the ubatched step's own error."""

from __future__ import annotations

import pytest
import torch

import dbo
from dbo.split import CommonAttentionMetadata, UBatchSlice, maybe_create_ubatch_slices
from dbo.verification.layout import EmptyUBatchError


def scale_by_seq_len(batch: dict) -> torch.Tensor:
    """Each real token times its request's seq_len; padding tokens give 0."""
    m, q = batch["attn"], batch["q"]
    dbo.dbo_yield()
    query_lens = m.query_start_loc_cpu[1:] - m.query_start_loc_cpu[:-1]
    per_token = torch.repeat_interleave(m.seq_lens.to(q.dtype), query_lens.long())
    out = torch.zeros_like(q)
    out[: per_token.shape[0]] = q[: per_token.shape[0]] * per_token[:, None]
    return out


def _batch(query_lens, seq_lens, padded=None) -> dict:
    meta = CommonAttentionMetadata.make(query_lens, seq_lens, num_tokens_padded=padded)
    q = torch.arange(meta.num_actual_tokens * 2, dtype=torch.float64).reshape(-1, 2)
    return {"q": q, "attn": meta}


def _padded_layout() -> tuple[dict, list[UBatchSlice]]:
    # 6 real tokens padded to 16 (a DP peer runs 16): the cut at 8 leaves ubatch 1 padding only.
    batch = _batch([3, 3], [5, 9], padded=16)
    _, padded = maybe_create_ubatch_slices(True, [3, 3], 16, 2, 2)
    return batch, padded


@pytest.mark.timeout(60)
def test_a_padding_only_ubatch_is_clean_under_vllm_v2_rules() -> None:
    batch, layout = _padded_layout()
    report = dbo.verify(scale_by_seq_len, batch, slices=layout, split_rules="vllm-v2")
    assert report.ok, report.describe()
    assert report.num_ubatches == 2 and report.metadata_error is None


def test_the_same_layout_is_refused_with_vllm_v1s_own_rule() -> None:
    batch, layout = _padded_layout()
    with pytest.raises(EmptyUBatchError, match="is_last_ubatch_empty") as caught:
        dbo.verify(scale_by_seq_len, batch, slices=layout)
    assert "ubatch 1 holds no real token (tokens [8, 16); the real ones end at 6)" in str(
        caught.value
    )


@pytest.mark.timeout(60)
def test_an_empty_first_child_batch_is_clean_under_sglang_rules() -> None:
    # A decode batch of one request: SGLang splits it at sequence index 0.
    batch = _batch([1], [7])
    report = dbo.verify(
        scale_by_seq_len, batch, slices=[slice(0, 0), slice(0, 1)], split_rules="sglang"
    )
    assert report.ok, report.describe()


def test_vllm_v2_refuses_an_empty_ubatch_before_real_tokens() -> None:
    batch = _batch([1, 2], [7, 4])
    with pytest.raises(EmptyUBatchError, match="ubatch 0 holds no real token"):
        dbo.verify(
            scale_by_seq_len, batch, slices=[slice(0, 0), slice(0, 3)], split_rules="vllm-v2"
        )


def test_slices_that_do_not_tile_the_batch_are_refused_before_work() -> None:
    batch = _batch([3, 3], [5, 9])
    with pytest.raises(
        ValueError, match="ubatch 1 is \\[4, 6\\) but the ubatches before it end at 3"
    ):
        dbo.verify(scale_by_seq_len, batch, slices=[slice(0, 3), slice(4, 6)])


def test_an_unknown_split_rule_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="split_rules must be one of"):
        dbo.verify(scale_by_seq_len, _batch([2], [2]), split_rules="vllm-v3")


def _broken_split_that_raises(inputs: dict, n: int) -> list[dict]:
    """Ubatch 1 gets ubatch 0's metadata (a cache keyed without the ubatch id) and a q of
    no feature dim, so its forward raises."""
    meta = inputs["attn"]
    layout, _ = maybe_create_ubatch_slices(True, [3, 3], 6, 2, 2)
    parts = dbo.split.split_attn_metadata(layout, meta)
    return [
        {"q": inputs["q"][:3], "attn": parts[0]},
        {"q": inputs["q"][3:, 0], "attn": parts[0]},
    ]


@pytest.mark.timeout(60)
def test_a_metadata_violation_is_reported_beside_the_ubatchs_own_error() -> None:
    report = dbo.verify(scale_by_seq_len, _batch([3, 3], [5, 9]), split=_broken_split_that_raises)
    assert not report.ok
    assert type(report.metadata_error).__name__ == "UBatchMetadataError"
    assert report.error is not None and "ubatch 1" in str(report.error)
    text = report.describe()
    assert "split metadata   UBatchMetadataError" in text and "DBO step failed" in text


@pytest.mark.timeout(60)
def test_describe_says_the_dbo_step_failed_only_when_it_did() -> None:
    def reused_metadata(inputs: dict, n: int) -> list[dict]:
        pieces = _broken_split_that_raises(inputs, n)
        pieces[1]["q"] = inputs["q"][3:]
        return pieces

    report = dbo.verify(scale_by_seq_len, _batch([3, 3], [5, 9]), split=reused_metadata)
    assert report.metadata_error is not None and report.error is None
    assert "DBO step failed" not in report.describe()


def test_vllm_v2_refuses_a_batch_with_fewer_tokens_than_ubatches() -> None:
    batch = _batch([1], [7])
    with pytest.raises(EmptyUBatchError, match="fewer tokens than ubatches"):
        dbo.verify(
            scale_by_seq_len, batch, slices=[slice(0, 1), slice(1, 1)], split_rules="vllm-v2"
        )
