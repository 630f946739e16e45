"""Splitting one step's batch into N ubatches, under vLLM's names: where to cut, whether to,
how attention metadata follows the cut, agreeing on it across data-parallel ranks, and
checking that a split's metadata describes exactly its batch.

A step's scheduled tokens are laid out request after request (`num_scheduled_tokens[r]` of
request r; their prefix sums are `query_start_loc`). The batch may be padded (for CUDA graphs,
or to match other DP ranks) to `num_tokens_padded` tokens and `num_reqs_padded` requests.

    >>> plain, padded = maybe_create_ubatch_slices(True, [3, 7, 2], 16, 3, 2)
    >>> [(s.request_slice, s.token_slice) for s in plain]  # the cut at 8 cuts request 1
    [(slice(0, 2, None), slice(0, 8, None)), (slice(1, 3, None), slice(8, 12, None))]
    >>> padded[-1].token_slice
    slice(8, 16, None)

The jobs, one module each: `dbo.split.slicing` (where and whether to cut),
`dbo.split.metadata` (`CommonAttentionMetadata` and `split_attn_metadata`),
`dbo.split.agreement` (`coordinate_batch_across_dp`), `dbo.split.checker`
(`check_ubatch_metadata`); `dbo.split.records` holds the small records they share. Every
public name is importable from `dbo.split`.

Deliberate differences from vLLM (each safer, none on a path vLLM's own runner takes):
- `is_last_ubatch_empty` is also True when the split point is 0 (fewer padded tokens than
  ubatches), where vLLM's formula answers False and every ubatch but the last is empty;
- where vLLM would build a negative-length last slice (an empty last ubatch), the unpadded
  last slice here is empty (`is_empty()`), and request positions past the real tokens are
  clamped to the last real request;
- in the later part of a cut request `num_computed_tokens_cpu` counts the earlier part too,
  so `seq_lens - query lens == num_computed_tokens` holds for every request of every slice
  (vLLM kept the whole request's count there until its #56031);
- `split_attn_metadata` refuses what vLLM 0.33 asserts against (a first token outside the
  slice's first request: a slice of padding only), with vLLM's reason, and also a request
  slice running past its token slice, which vLLM turns into a decreasing `query_start_loc`;
  it reads vLLM's own `CommonAttentionMetadata` and `UBatchSlice` too;
- bad input raises ValueError/TypeError naming the argument, never a bare assert;
- `DBOConfig` refuses a token threshold below its ubatch count;
- the agreement also compares ubatch counts across ranks (UBatchAgreementError naming each)
  and flags a rank's bad arguments in the exchange, so its peers raise instead of hanging.
"""

from dbo.split.agreement import (
    UBatchAgreementError,
    UBatchDecision,
    UBatchProposal,
    check_dp_padding,
    coordinate_batch_across_dp,
    coordinate_ubatching,
    decide_ubatching,
)
from dbo.split.checker import (
    MetadataViolation,
    UBatchMetadataError,
    check_split_inputs,
    check_ubatch_metadata,
    find_metadata_violation,
)
from dbo.split.metadata import (
    PAD_SLOT_ID,
    CommonAttentionMetadata,
    slice_query_start_locs,
    split_attn_metadata,
)
from dbo.split.model_inputs import get_num_ubatches, merge_ubatch_outputs, slice_model_inputs
from dbo.split.records import DBOConfig, UBatchSlice, UBatchSlices, UBatchThresholds
from dbo.split.slicing import (
    check_ubatch_thresholds,
    is_last_ubatch_empty,
    maybe_create_ubatch_slices,
    should_ubatch,
    slices_at_split_points,
    split_batch,
    ubatch_cut_points,
)

__all__ = [
    "get_num_ubatches",
    "merge_ubatch_outputs",
    "slice_model_inputs",
    "PAD_SLOT_ID",
    "CommonAttentionMetadata",
    "DBOConfig",
    "MetadataViolation",
    "UBatchAgreementError",
    "UBatchDecision",
    "UBatchMetadataError",
    "UBatchProposal",
    "UBatchSlice",
    "UBatchSlices",
    "UBatchThresholds",
    "check_dp_padding",
    "check_split_inputs",
    "check_ubatch_metadata",
    "check_ubatch_thresholds",
    "coordinate_batch_across_dp",
    "coordinate_ubatching",
    "slices_at_split_points",
    "decide_ubatching",
    "find_metadata_violation",
    "is_last_ubatch_empty",
    "maybe_create_ubatch_slices",
    "should_ubatch",
    "slice_query_start_locs",
    "split_attn_metadata",
    "split_batch",
    "ubatch_cut_points",
]
