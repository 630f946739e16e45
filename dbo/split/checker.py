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
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dbo.split.metadata import PAD_SLOT_ID, CommonAttentionMetadata
from dbo.split.records import UBatchSlice

__all__ = [
    "MetadataViolation",
    "UBatchMetadataError",
    "check_split_inputs",
    "check_ubatch_metadata",
    "find_metadata_violation",
]


@dataclass(frozen=True)
class MetadataViolation:
    """The first broken invariant: which (see the module docstring), in which field, ubatch
    and parent request (None where it is not about one), and why."""

    invariant: str
    field: str
    ubatch: int | None
    request: int | None
    message: str

    def describe(self) -> str:
        where = [f"ubatch {self.ubatch}"] if self.ubatch is not None else ["parent"]
        if self.request is not None:
            where.append(f"request {self.request}")
        return f"{', '.join(where)}, {self.field}: {self.message} [{self.invariant}]"


class UBatchMetadataError(ValueError):
    """A split's ubatch metadata breaks an invariant; `violation` says which and where."""

    def __init__(self, violation: MetadataViolation) -> None:
        super().__init__(f"ubatch metadata: {violation.describe()}")
        self.violation = violation


class _Found(Exception):
    """Carries the first violation out of the nested checks."""

    def __init__(self, violation: MetadataViolation) -> None:
        self.violation = violation


def _fail(invariant: str, field: str, ubatch: int | None, request: int | None, why: str):
    raise _Found(MetadataViolation(invariant, field, ubatch, request, why))


def _ints(t: torch.Tensor | None) -> list[int] | None:
    return None if t is None else [int(v) for v in t.detach().cpu().reshape(-1).tolist()]


@dataclass
class _Host:
    """One record's fields on the host, read once."""

    qsl: list[int]
    qsl_dev: list[int]
    seq: list[int]
    computed: list[int]
    table: torch.Tensor
    slots: list[int]
    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    optional: dict[str, list[int] | None]

    @classmethod
    def of(cls, m: CommonAttentionMetadata) -> _Host:
        return cls(
            qsl=_ints(m.query_start_loc_cpu),
            qsl_dev=_ints(m.query_start_loc),
            seq=_ints(m.seq_lens),
            computed=_ints(m.num_computed_tokens_cpu),
            table=m.block_table_tensor.detach().cpu(),
            slots=_ints(m.slot_mapping),
            num_reqs=int(m.num_reqs),
            num_tokens=int(m.num_actual_tokens),
            max_query_len=int(m.max_query_len),
            max_seq_len=int(m.max_seq_len),
            optional={name: _ints(getattr(m, name)) for name in _OPTIONAL},
        )


# Optional fields and what they are indexed by.
_OPTIONAL = {
    "positions": "token",
    "is_prefilling": "request",
    "seq_lens_cpu_upper_bound": "request",
}


# --------------------------------------------------------------------------------------------
# 1. shapes


def _check_shapes(k: int | None, u: _Host) -> None:
    n = u.num_reqs
    rows = {
        "seq_lens": len(u.seq),
        "num_computed_tokens_cpu": len(u.computed),
        "block_table_tensor": int(u.table.shape[0]),
    }
    for field, count in rows.items():
        if count != n:
            _fail(
                "shapes",
                field,
                k,
                None,
                f"has {count} rows but num_reqs is {n} (query_start_loc describes "
                f"{len(u.qsl) - 1} requests): the record mixes metadata of different batches",
            )
    if len(u.qsl) != n + 1:
        _fail(
            "shapes", "query_start_loc_cpu", k, None, f"has {len(u.qsl)} entries for {n} requests"
        )
    if u.qsl_dev != u.qsl:
        _fail("shapes", "query_start_loc", k, None, "differs from query_start_loc_cpu")
    if u.qsl[0] != 0 or any(b < a for a, b in zip(u.qsl, u.qsl[1:])) or u.qsl[-1] > u.num_tokens:
        _fail(
            "shapes",
            "query_start_loc_cpu",
            k,
            None,
            f"{u.qsl} must rise from 0 to at most num_actual_tokens ({u.num_tokens})",
        )
    if len(u.slots) != u.num_tokens:
        _fail(
            "shapes",
            "slot_mapping",
            k,
            None,
            f"has {len(u.slots)} entries but num_actual_tokens is {u.num_tokens}",
        )
    for field, kind in _OPTIONAL.items():
        values = u.optional[field]
        want = u.num_tokens if kind == "token" else n
        if values is not None and len(values) != want:
            _fail("shapes", field, k, None, f"has {len(values)} entries for {want} {kind}s")


# --------------------------------------------------------------------------------------------
# 2. coverage and 3. padding


def _real_tokens(p: _Host) -> int:
    return p.qsl[-1]


def _infer_slices(p: _Host, ubatches: list[_Host]) -> list[UBatchSlice]:
    """The slices a correct split gives these records: consecutive token ranges, each from the
    request holding its first token (padding requests past the real ones)."""
    slices, start = [], 0
    real_reqs = bisect.bisect_left(p.qsl, _real_tokens(p)) if p.qsl[-1] else 0
    for u in ubatches:
        first = bisect.bisect_right(p.qsl, start) - 1 if start < _real_tokens(p) else real_reqs
        first = max(0, min(first, p.num_reqs))
        slices.append(
            UBatchSlice(slice(first, first + u.num_reqs), slice(start, start + u.num_tokens))
        )
        start += u.num_tokens
    return slices


def _check_tiling(p: _Host, slices: Sequence[UBatchSlice], ubatches: list[_Host]) -> None:
    if len(slices) != len(ubatches):
        _fail(
            "coverage",
            "ubatch_slices",
            None,
            None,
            f"{len(slices)} slices for {len(ubatches)} ubatches",
        )
    expected = 0
    for k, (s, u) in enumerate(zip(slices, ubatches)):
        toks, reqs = s.token_slice, s.request_slice
        if toks.start != expected:
            _fail(
                "coverage",
                "num_actual_tokens",
                k,
                None,
                f"starts at token {toks.start}, but the ubatches before it end at {expected}",
            )
        if u.num_tokens != toks.stop - toks.start or u.num_reqs != reqs.stop - reqs.start:
            _fail(
                "coverage",
                "num_actual_tokens",
                k,
                None,
                f"holds {u.num_tokens} tokens of {u.num_reqs} requests, its slice {s} "
                f"{toks.stop - toks.start} of {reqs.stop - reqs.start}",
            )
        if reqs.stop > p.num_reqs:
            _fail(
                "coverage",
                "num_reqs",
                k,
                None,
                f"requests {reqs} run past the parent's {p.num_reqs}",
            )
        expected = toks.stop
    if expected not in (_real_tokens(p), p.num_tokens):
        _fail(
            "coverage",
            "num_actual_tokens",
            None,
            None,
            f"the ubatches cover {expected} tokens; the parent has {_real_tokens(p)} "
            f"({p.num_tokens} padded)",
        )


def _check_rows(k: int, p: _Host, s: UBatchSlice, u: _Host) -> None:
    """Row i of ubatch k stands for parent request start + i: its tokens must be that
    request's, and the ubatch must run every real token of its range."""
    ts, real = s.token_slice.start, _real_tokens(p)
    for i in range(u.num_reqs):
        r = s.request_slice.start + i
        lo, hi = ts + u.qsl[i], ts + u.qsl[i + 1]
        if hi > lo and not (p.qsl[r] <= lo and hi <= p.qsl[r + 1]):
            _fail(
                "coverage",
                "query_start_loc_cpu",
                k,
                r,
                f"row {i} runs tokens [{lo}, {hi}) but the parent's request {r} holds "
                f"[{p.qsl[r]}, {p.qsl[r + 1]})",
            )
    runs, holds = u.qsl[-1], max(0, min(s.token_slice.stop, real) - ts)
    if runs != holds:
        _fail(
            "coverage",
            "query_start_loc_cpu",
            k,
            None,
            f"its requests run {runs} tokens but its range [{ts}, {s.token_slice.stop}) holds "
            f"{holds} real tokens, so some token runs twice or never",
        )


def _check_padding(p: _Host, slices: Sequence[UBatchSlice], last_only: bool) -> None:
    real = _real_tokens(p)
    for t in range(real, p.num_tokens):
        if p.slots[t] != PAD_SLOT_ID:
            _fail(
                "padding",
                "slot_mapping",
                None,
                None,
                f"padding token {t} maps to slot {p.slots[t]}",
            )
    if not last_only:  # the engine runs a ubatch of padding only (vLLM's V2 runner, SGLang)
        return
    for k, s in enumerate(slices):
        if s.token_slice.start >= real and s.token_slice.stop > s.token_slice.start:
            _fail(
                "padding",
                "num_actual_tokens",
                k,
                None,
                f"holds only padding tokens [{s.token_slice.start}, {s.token_slice.stop}) "
                f"(the real ones end at {real}): padding belongs at the end of the last ubatch",
            )
        if k < len(slices) - 1 and s.token_slice.stop > real:
            _fail(
                "padding",
                "num_actual_tokens",
                k,
                None,
                f"holds padding tokens [{real}, {s.token_slice.stop}) but is not the last ubatch",
            )


# --------------------------------------------------------------------------------------------
# 4. computed tokens


def _check_computed(k: int, p: _Host, s: UBatchSlice, u: _Host) -> None:
    ts = s.token_slice.start
    for i in range(u.num_reqs):
        r = s.request_slice.start + i
        query = u.qsl[i + 1] - u.qsl[i]
        if u.seq[i] - query != u.computed[i]:
            _fail(
                "computed tokens",
                "num_computed_tokens_cpu",
                k,
                r,
                f"is {u.computed[i]} but seq_lens - query_lens is {u.seq[i]} - {query} = "
                f"{u.seq[i] - query}",
            )
        if query == 0:  # a zero-token or padding request: nothing of it runs here
            if u.seq[i] != p.seq[r]:
                _fail(
                    "computed tokens",
                    "seq_lens",
                    k,
                    r,
                    f"is {u.seq[i]}; the parent's row for this request says {p.seq[r]}",
                )
            continue
        earlier = ts + u.qsl[i] - p.qsl[r]  # this request's tokens run by earlier ubatches
        want_computed = p.computed[r] + earlier
        if u.computed[i] != want_computed:
            _fail(
                "computed tokens",
                "num_computed_tokens_cpu",
                k,
                r,
                f"is {u.computed[i]}; the parent's {p.computed[r]} plus the {earlier} tokens "
                f"earlier ubatches ran of this request make {want_computed}",
            )
        if u.seq[i] != want_computed + query:
            _fail(
                "computed tokens",
                "seq_lens",
                k,
                r,
                f"is {u.seq[i]}; its computed tokens plus this ubatch's {query} make "
                f"{want_computed + query}",
            )


# --------------------------------------------------------------------------------------------
# 5. fields


def _check_fields(k: int, p: _Host, s: UBatchSlice, u: _Host) -> None:
    toks, reqs = s.token_slice, s.request_slice
    for field, kind in _OPTIONAL.items():
        whole, mine = p.optional[field], u.optional[field]
        if whole is None:
            continue
        if mine is None:
            _fail(
                "fields",
                field,
                k,
                None,
                f"is None but the parent carries it: the split dropped a per-{kind} field",
            )
        if field == "seq_lens_cpu_upper_bound":
            _check_upper_bound(k, reqs.start, whole[reqs], mine, u.seq)
            continue
        want = whole[toks] if kind == "token" else whole[reqs]
        for i, (got, exp) in enumerate(zip(mine, want)):
            if got != exp:
                if kind == "token":  # the parent request holding that token
                    r, where = (
                        bisect.bisect_right(p.qsl, toks.start + i) - 1,
                        f"token {toks.start + i}",
                    )
                else:
                    r, where = reqs.start + i, f"row {i}"
                _fail("fields", field, k, r, f"{where} is {got}; the parent's is {exp}")
    if u.qsl[-1] and u.max_query_len < max(b - a for a, b in zip(u.qsl, u.qsl[1:])):
        _fail("fields", "max_query_len", k, None, f"{u.max_query_len} is below a query here")
    if u.seq and u.max_seq_len < max(u.seq):
        _fail("fields", "max_seq_len", k, None, f"{u.max_seq_len} is below a seq_len here")


def _check_upper_bound(k: int, first: int, whole: list[int], mine: list[int], seq: list[int]):
    for i, (bound, parent_bound, length) in enumerate(zip(mine, whole, seq)):
        if not length <= bound <= parent_bound:
            _fail(
                "fields",
                "seq_lens_cpu_upper_bound",
                k,
                first + i,
                f"is {bound}; it must bound seq_lens ({length}) and not exceed the parent's "
                f"({parent_bound})",
            )


# --------------------------------------------------------------------------------------------
# 6. block table and slots


def _check_blocks(k: int, p: _Host, s: UBatchSlice, u: _Host, block_size: int | None) -> None:
    reqs, toks = s.request_slice, s.token_slice
    rows = p.table[reqs]
    if u.table.shape != rows.shape or not torch.equal(u.table, rows):
        bad = next(
            (
                i
                for i in range(min(len(rows), len(u.table)))
                if not torch.equal(u.table[i], rows[i])
            ),
            0,
        )
        _fail(
            "block table",
            "block_table_tensor",
            k,
            reqs.start + bad,
            f"row {bad} is not the block-table row of the parent's request {reqs.start + bad}",
        )
    for j, (got, want) in enumerate(zip(u.slots, p.slots[toks])):
        if got != want:
            r = bisect.bisect_right(p.qsl, toks.start + j) - 1
            _fail(
                "block table",
                "slot_mapping",
                k,
                r,
                f"token {toks.start + j} maps to slot {got}; the parent maps it to {want}",
            )
    if block_size is not None:
        _check_slots_in_blocks(k, s, u, block_size)


def _check_slots_in_blocks(k: int, s: UBatchSlice, u: _Host, block_size: int) -> None:
    """Each real token's slot is in its request's blocks, at its position in the sequence."""
    for i in range(u.num_reqs):
        row = u.table[i].tolist()
        for j in range(u.qsl[i], u.qsl[i + 1]):
            pos = u.computed[i] + j - u.qsl[i]
            block = pos // block_size
            want = row[block] * block_size + pos % block_size if block < len(row) else None
            if u.slots[j] != want:
                _fail(
                    "block table",
                    "slot_mapping",
                    k,
                    s.request_slice.start + i,
                    f"token {s.token_slice.start + j} (position {pos}) maps to slot "
                    f"{u.slots[j]}, not into its request's block-table row (slot {want})",
                )


# --------------------------------------------------------------------------------------------
# Entry points


def _records(parent: Any, ubatches: Any) -> tuple[_Host, list[_Host]]:
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
    return _Host.of(parent), [_Host.of(u) for u in ubatches]


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
        _check_shapes(None, p)
        for k, u in enumerate(us):
            _check_shapes(k, u)
        slices = list(slices) if slices is not None else _infer_slices(p, us)
        _check_tiling(p, slices, us)
        for k, (s, u) in enumerate(zip(slices, us)):
            _check_rows(k, p, s, u)
        _check_padding(p, slices, padding_in_last_ubatch)
        for k, (s, u) in enumerate(zip(slices, us)):
            _check_computed(k, p, s, u)
            _check_fields(k, p, s, u)
            _check_blocks(k, p, s, u, block_size)
    except _Found as found:
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
