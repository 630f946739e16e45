"""The split checker's layout rules (invariants 1-3 of `dbo.split.checker`): each record's
shapes agree with themselves, the ubatches tile the parent's tokens request by request, and
padding sits only where the engine puts it.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from dbo.split.metadata import PAD_SLOT_ID
from dbo.split.records import UBatchSlice
from dbo.split.violations import OPTIONAL_FIELDS, HostMetadata, fail

__all__ = ["check_padding", "check_rows", "check_shapes", "check_tiling", "infer_slices"]


# --------------------------------------------------------------------------------------------
# 1. shapes


def check_shapes(k: int | None, u: HostMetadata) -> None:
    """Record `k` (None: the parent) agrees with itself: per-request rows, then per-token
    entries, then the optional fields by what they are indexed by."""
    _check_request_rows(k, u)
    _check_token_entries(k, u)
    for field, kind in OPTIONAL_FIELDS.items():
        values = u.optional[field]
        want = u.num_tokens if kind == "token" else u.num_reqs
        if values is not None and len(values) != want:
            fail("shapes", field, k, None, f"has {len(values)} entries for {want} {kind}s")


def _check_request_rows(k: int | None, u: HostMetadata) -> None:
    n = u.num_reqs
    rows = {
        "seq_lens": len(u.seq),
        "num_computed_tokens_cpu": len(u.computed),
        "block_table_tensor": int(u.table.shape[0]),
    }
    for field, count in rows.items():
        if count != n:
            fail(
                "shapes",
                field,
                k,
                None,
                f"has {count} rows but num_reqs is {n} (query_start_loc describes "
                f"{len(u.qsl) - 1} requests): the record mixes metadata of different batches",
            )
    if len(u.qsl) != n + 1:
        fail("shapes", "query_start_loc_cpu", k, None, f"has {len(u.qsl)} entries for {n} requests")


def _check_token_entries(k: int | None, u: HostMetadata) -> None:
    if u.qsl_dev != u.qsl:
        fail("shapes", "query_start_loc", k, None, "differs from query_start_loc_cpu")
    if u.qsl[0] != 0 or any(b < a for a, b in zip(u.qsl, u.qsl[1:])) or u.qsl[-1] > u.num_tokens:
        fail(
            "shapes",
            "query_start_loc_cpu",
            k,
            None,
            f"{u.qsl} must rise from 0 to at most num_actual_tokens ({u.num_tokens})",
        )
    if len(u.slots) != u.num_tokens:
        fail(
            "shapes",
            "slot_mapping",
            k,
            None,
            f"has {len(u.slots)} entries but num_actual_tokens is {u.num_tokens}",
        )


# --------------------------------------------------------------------------------------------
# 2. coverage and 3. padding


def real_tokens(p: HostMetadata) -> int:
    return p.qsl[-1]


def infer_slices(p: HostMetadata, ubatches: list[HostMetadata]) -> list[UBatchSlice]:
    """The slices a correct split gives these records: consecutive token ranges, each from the
    request holding its first token (padding requests past the real ones)."""
    slices, start = [], 0
    real_reqs = bisect.bisect_left(p.qsl, real_tokens(p)) if p.qsl[-1] else 0
    for u in ubatches:
        first = bisect.bisect_right(p.qsl, start) - 1 if start < real_tokens(p) else real_reqs
        first = max(0, min(first, p.num_reqs))
        slices.append(
            UBatchSlice(slice(first, first + u.num_reqs), slice(start, start + u.num_tokens))
        )
        start += u.num_tokens
    return slices


def check_tiling(
    p: HostMetadata, slices: Sequence[UBatchSlice], ubatches: list[HostMetadata]
) -> None:
    """The slices follow each other from token 0, each the size of its record, and together
    end where the parent's real tokens (or its padding) end."""
    if len(slices) != len(ubatches):
        fail(
            "coverage",
            "ubatch_slices",
            None,
            None,
            f"{len(slices)} slices for {len(ubatches)} ubatches",
        )
    expected = 0
    for k, (s, u) in enumerate(zip(slices, ubatches)):
        _check_slice(k, p, s, u, expected)
        expected = s.token_slice.stop
    if expected not in (real_tokens(p), p.num_tokens):
        fail(
            "coverage",
            "num_actual_tokens",
            None,
            None,
            f"the ubatches cover {expected} tokens; the parent has {real_tokens(p)} "
            f"({p.num_tokens} padded)",
        )


def _check_slice(k: int, p: HostMetadata, s: UBatchSlice, u: HostMetadata, expected: int) -> None:
    """Ubatch k's slice starts at `expected` (where the ones before it end), is the size of
    its record and stays inside the parent's requests."""
    toks, reqs = s.token_slice, s.request_slice
    if toks.start != expected:
        fail(
            "coverage",
            "num_actual_tokens",
            k,
            None,
            f"starts at token {toks.start}, but the ubatches before it end at {expected}",
        )
    if u.num_tokens != toks.stop - toks.start or u.num_reqs != reqs.stop - reqs.start:
        fail(
            "coverage",
            "num_actual_tokens",
            k,
            None,
            f"holds {u.num_tokens} tokens of {u.num_reqs} requests, its slice {s} "
            f"{toks.stop - toks.start} of {reqs.stop - reqs.start}",
        )
    if reqs.stop > p.num_reqs:
        fail("coverage", "num_reqs", k, None, f"requests {reqs} run past the parent's {p.num_reqs}")


def check_rows(k: int, p: HostMetadata, s: UBatchSlice, u: HostMetadata) -> None:
    """Row i of ubatch k stands for parent request start + i: its tokens must be that
    request's, and the ubatch must run every real token of its range."""
    ts, real = s.token_slice.start, real_tokens(p)
    for i in range(u.num_reqs):
        r = s.request_slice.start + i
        lo, hi = ts + u.qsl[i], ts + u.qsl[i + 1]
        if hi > lo and not (p.qsl[r] <= lo and hi <= p.qsl[r + 1]):
            fail(
                "coverage",
                "query_start_loc_cpu",
                k,
                r,
                f"row {i} runs tokens [{lo}, {hi}) but the parent's request {r} holds "
                f"[{p.qsl[r]}, {p.qsl[r + 1]})",
            )
    runs, holds = u.qsl[-1], max(0, min(s.token_slice.stop, real) - ts)
    if runs != holds:
        fail(
            "coverage",
            "query_start_loc_cpu",
            k,
            None,
            f"its requests run {runs} tokens but its range [{ts}, {s.token_slice.stop}) holds "
            f"{holds} real tokens, so some token runs twice or never",
        )


def check_padding(p: HostMetadata, slices: Sequence[UBatchSlice], last_only: bool) -> None:
    real = real_tokens(p)
    for t in range(real, p.num_tokens):
        if p.slots[t] != PAD_SLOT_ID:
            fail(
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
            fail(
                "padding",
                "num_actual_tokens",
                k,
                None,
                f"holds only padding tokens [{s.token_slice.start}, {s.token_slice.stop}) "
                f"(the real ones end at {real}): padding belongs at the end of the last ubatch",
            )
        if k < len(slices) - 1 and s.token_slice.stop > real:
            fail(
                "padding",
                "num_actual_tokens",
                k,
                None,
                f"holds padding tokens [{real}, {s.token_slice.stop}) but is not the last ubatch",
            )
