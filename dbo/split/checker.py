"""The ubatch-metadata checker: does a split's per-ubatch attention metadata describe exactly
the parent batch? `check_ubatch_metadata(parent, ubatches)` raises `UBatchMetadataError` at the
first violated invariant, naming the field, the ubatch and the parent's request;
`find_metadata_violation` returns that record (or None) instead.

The invariants of a correct split, checked in this order:
1. shapes: each record agrees with itself (`num_reqs` rows of `seq_lens`,
   `num_computed_tokens_cpu` and `block_table_tensor`; `num_reqs + 1` entries of
   `query_start_loc`, the device copy equal to the host one; `num_actual_tokens` entries of
   `slot_mapping` and of every per-token field).
2. coverage: the ubatches' token ranges tile the parent's tokens in order, and each ubatch row
   runs tokens of the parent request it stands for, so every request's tokens are run exactly
   once.
3. padding: padding tokens sit only after the real ones, in the last ubatch (unless
   `padding_in_last_ubatch=False`: vLLM's V2 runner pads every ubatch's share and runs a
   ubatch of padding only like a dummy run).
4. computed tokens: per request `seq_lens - query_lens == num_computed_tokens_cpu`, and both
   match the parent's counts plus the part of a cut request an earlier ubatch ran.
5. fields: every optional per-token (`positions`) and per-request (`is_prefilling`,
   `seq_lens_cpu_upper_bound`) field the parent carries is present and sliced; the
   `max_query_len`/`max_seq_len` bounds hold.
6. block table and slots: each row is its request's block-table row, each token's slot is the
   parent's (and, given `block_size`, inside its request's blocks at its position).

The ubatch slices may be given; by default they are inferred as a correct split would lay them
out (ubatch k starts where ubatch k - 1 ended, at the request holding that token). A builder
that reused another ubatch's record (a cache keyed without the ubatch id) fails 1 or 2; one
that dropped a field fails 5; one that left a cut request's computed count at the parent's
fails 4.

The rules live by family: `dbo.split.layout_rules` (1-3), `dbo.split.value_rules` (4-6), and
what they share (the violation record, the host copy of a record) in `dbo.split.violations`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from dbo.split.layout_rules import (
    check_padding,
    check_rows,
    check_shapes,
    check_tiling,
    infer_slices,
)
from dbo.split.metadata import CommonAttentionMetadata
from dbo.split.records import UBatchSlice
from dbo.split.value_rules import check_blocks, check_computed, check_fields
from dbo.split.violations import (
    HostMetadata,
    MetadataViolation,
    UBatchMetadataError,
    ViolationFound,
)

__all__ = [
    "MetadataViolation",
    "UBatchMetadataError",
    "check_split_inputs",
    "check_ubatch_metadata",
    "find_metadata_violation",
]


def _records(parent: Any, ubatches: Any) -> tuple[HostMetadata, list[HostMetadata]]:
    if not isinstance(parent, CommonAttentionMetadata):
        raise TypeError(f"parent must be a CommonAttentionMetadata, got {type(parent).__name__}")
    ubatches = list(ubatches)
    for k, u in enumerate(ubatches):
        if not isinstance(u, CommonAttentionMetadata):
            raise TypeError(
                f"ubatches[{k}] must be a CommonAttentionMetadata, got {type(u).__name__}"
            )
    if not ubatches:
        raise ValueError("ubatches must not be empty")
    return HostMetadata.of(parent), [HostMetadata.of(u) for u in ubatches]


def find_metadata_violation(
    parent: CommonAttentionMetadata,
    ubatches: Sequence[CommonAttentionMetadata],
    slices: Sequence[UBatchSlice] | None = None,
    *,
    block_size: int | None = None,
    padding_in_last_ubatch: bool = True,
) -> MetadataViolation | None:
    """The first invariant the per-ubatch metadata breaks against `parent`, or None.

    `slices`: the ubatch slices the records were built from (default: inferred as a correct
    split lays them out). `block_size`: also check each token's slot against its request's
    blocks at its position. `padding_in_last_ubatch=False`: padding may fill any ubatch after
    the real tokens (vLLM's V2 runner)."""
    p, us = _records(parent, ubatches)
    try:
        check_shapes(None, p)
        for k, u in enumerate(us):
            check_shapes(k, u)
        slices = list(slices) if slices is not None else infer_slices(p, us)
        check_tiling(p, slices, us)
        for k, (s, u) in enumerate(zip(slices, us)):
            check_rows(k, p, s, u)
        check_padding(p, slices, padding_in_last_ubatch)
        for k, (s, u) in enumerate(zip(slices, us)):
            check_computed(k, p, s, u)
            check_fields(k, p, s, u)
            check_blocks(k, p, s, u, block_size)
    except ViolationFound as found:
        return found.violation
    return None


def check_ubatch_metadata(
    parent: CommonAttentionMetadata,
    ubatches: Sequence[CommonAttentionMetadata],
    slices: Sequence[UBatchSlice] | None = None,
    *,
    block_size: int | None = None,
) -> None:
    """`find_metadata_violation`, raising `UBatchMetadataError` at the first violation.

    parts = split_attn_metadata(slices, meta)
    check_ubatch_metadata(meta, parts, slices)  # silent for dbo.split's own split
    """
    violation = find_metadata_violation(parent, ubatches, slices, block_size=block_size)
    if violation is not None:
        raise UBatchMetadataError(violation)


def _metadata_leaves(value: Any) -> dict[str, CommonAttentionMetadata]:
    """The attention metadata a step's inputs carry, by where they sit: the value itself, or
    one level down (a mapping's values, a sequence's items, a dataclass's fields)."""
    if isinstance(value, CommonAttentionMetadata):
        return {"": value}
    if isinstance(value, Mapping):
        items = [(f"[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, (tuple, list)):
        items = [(f"[{i}]", v) for i, v in enumerate(value)]
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [(f".{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value)]
    else:
        return {}
    return {where: v for where, v in items if isinstance(v, CommonAttentionMetadata)}


def check_split_inputs(
    inputs: Any,
    pieces: Sequence[Any],
    slices: Sequence[UBatchSlice] | None = None,
    *,
    padding_in_last_ubatch: bool = True,
) -> UBatchMetadataError | None:
    """For a step's whole inputs and its per-ubatch inputs (what `dbo.verify` runs): the
    error of the first attention metadata the pieces carry that breaks an invariant against
    the one the inputs carry at the same place, or None (also when the inputs carry none).
    `slices`: the layout the pieces were cut by (default: inferred)."""
    for where, parent in _metadata_leaves(inputs).items():
        parts = []
        for k, piece in enumerate(pieces):
            found = _metadata_leaves(piece).get(where)
            if found is None:
                field = f"inputs{where}" if where else "inputs"
                return UBatchMetadataError(
                    MetadataViolation(
                        "fields",
                        field,
                        k,
                        None,
                        "the batch's inputs carry attention metadata here; this ubatch's do not",
                    )
                )
            parts.append(found)
        violation = find_metadata_violation(
            parent, parts, slices, padding_in_last_ubatch=padding_in_last_ubatch
        )
        if violation is not None:
            return UBatchMetadataError(violation)
    return None
