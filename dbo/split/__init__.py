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
(`check_ubatch_metadata`; its rules in `layout_rules` and `value_rules`, over `violations`),
`dbo.split.v2` (model runner V2's `create_ubatch_slices`, `slice_model_inputs`,
`merge_ubatch_outputs`); `dbo.split.records` holds the small records they share. Every public
name is importable from `dbo.split`.

Deliberate differences from vLLM (each safer, none on a path vLLM's own runner takes):
- `is_last_ubatch_empty` is also True when the split point is 0 (fewer padded tokens than
  ubatches), where vLLM's formula answers False and every ubatch but the last is empty;
- where vLLM would build a negative-length last slice (an empty last ubatch), the unpadded
  last slice here is empty (`is_empty()`), and request positions past the real tokens are
  clamped to the last real request;
- in the later part of a cut request `num_computed_tokens_cpu` counts the earlier part too,
  so `seq_lens - query lens == num_computed_tokens` holds for every request of every slice
  (vLLM kept the whole request's count there until its #56031);
- bad input raises ValueError/TypeError naming the argument, never a bare assert; every
  slice vLLM's `split_attn_metadata` asserts against (empty, padding only, first token
  outside its first request, no `seq_lens_cpu_upper_bound`) is refused with vLLM's reason
  first, and so is every slice it would turn into negative metadata without a word (a last
  request starting after the slice's tokens, real tokens past its last request);
- `split_attn_metadata` also takes vLLM's own `CommonAttentionMetadata` and `UBatchSlice`s
  and returns vLLM's records, `is_prefilling` kept (vLLM 0.33's split drops it);
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
from dbo.split.records import DBOConfig, UBatchSlice, UBatchSlices, UBatchThresholds
from dbo.split.slicing import (
    check_ubatch_thresholds,
    cut_ubatch_slices,
    get_num_ubatches,
    is_last_ubatch_empty,
    maybe_create_ubatch_slices,
    should_ubatch,
    split_batch,
    ubatch_cut_points,
)
from dbo.split.v2 import (
    IntermediateTensors,
    create_ubatch_slices,
    merge_ubatch_outputs,
    slice_model_inputs,
)

__all__ = [
    "IntermediateTensors",
    "create_ubatch_slices",
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
    "cut_ubatch_slices",
    "decide_ubatching",
    "find_metadata_violation",
    "get_num_ubatches",
    "is_last_ubatch_empty",
    "maybe_create_ubatch_slices",
    "should_ubatch",
    "slice_query_start_locs",
    "split_attn_metadata",
    "split_batch",
    "ubatch_cut_points",
]
