"""The split checker's value rules (invariants 4-6 of `dbo.split.checker`): computed-token
counts continue the parent's across a cut request, every optional field is carried and
sliced, and each row's block table and each token's slot are its request's.
"""

from __future__ import annotations

import bisect

import torch

from dbo.split.records import UBatchSlice
from dbo.split.violations import OPTIONAL_FIELDS, HostMetadata, fail

__all__ = ["check_blocks", "check_computed", "check_fields"]


# --------------------------------------------------------------------------------------------
# 4. computed tokens


def check_computed(k: int, p: HostMetadata, s: UBatchSlice, u: HostMetadata) -> None:
    """Each row of ubatch k counts its computed tokens consistently with its own lengths, and
    as the parent's count plus what earlier ubatches ran of the request."""
    for i in range(u.num_reqs):
        r = s.request_slice.start + i
        query = u.qsl[i + 1] - u.qsl[i]
        if u.seq[i] - query != u.computed[i]:
            fail(
                "computed tokens",
                "num_computed_tokens_cpu",
                k,
                r,
                f"is {u.computed[i]} but seq_lens - query_lens is {u.seq[i]} - {query} = "
                f"{u.seq[i] - query}",
            )
        if query == 0:  # a zero-token or padding request: nothing of it runs here
            if u.seq[i] != p.seq[r]:
                fail(
                    "computed tokens",
                    "seq_lens",
                    k,
                    r,
                    f"is {u.seq[i]}; the parent's row for this request says {p.seq[r]}",
                )
            continue
        _check_continued(k, r, p, s.token_slice.start + u.qsl[i], u.computed[i], u.seq[i], query)


def _check_continued(
    k: int, r: int, p: HostMetadata, first_token: int, computed: int, seq: int, query: int
) -> None:
    """A row running `query` tokens of request r from `first_token` on: its computed count
    is the parent's plus the request's tokens earlier ubatches ran."""
    earlier = first_token - p.qsl[r]  # this request's tokens run by earlier ubatches
    want_computed = p.computed[r] + earlier
    if computed != want_computed:
        fail(
            "computed tokens",
            "num_computed_tokens_cpu",
            k,
            r,
            f"is {computed}; the parent's {p.computed[r]} plus the {earlier} tokens "
            f"earlier ubatches ran of this request make {want_computed}",
        )
    if seq != want_computed + query:
        fail(
            "computed tokens",
            "seq_lens",
            k,
            r,
            f"is {seq}; its computed tokens plus this ubatch's {query} make "
            f"{want_computed + query}",
        )


# --------------------------------------------------------------------------------------------
# 5. fields


def check_fields(k: int, p: HostMetadata, s: UBatchSlice, u: HostMetadata) -> None:
    toks, reqs = s.token_slice, s.request_slice
    for field, kind in OPTIONAL_FIELDS.items():
        whole, mine = p.optional[field], u.optional[field]
        if whole is None:
            continue
        if mine is None:
            fail(
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
                fail("fields", field, k, r, f"{where} is {got}; the parent's is {exp}")
    if u.qsl[-1] and u.max_query_len < max(b - a for a, b in zip(u.qsl, u.qsl[1:])):
        fail("fields", "max_query_len", k, None, f"{u.max_query_len} is below a query here")
    if u.seq and u.max_seq_len < max(u.seq):
        fail("fields", "max_seq_len", k, None, f"{u.max_seq_len} is below a seq_len here")


def _check_upper_bound(k: int, first: int, whole: list[int], mine: list[int], seq: list[int]):
    for i, (bound, parent_bound, length) in enumerate(zip(mine, whole, seq)):
        if not length <= bound <= parent_bound:
            fail(
                "fields",
                "seq_lens_cpu_upper_bound",
                k,
                first + i,
                f"is {bound}; it must bound seq_lens ({length}) and not exceed the parent's "
                f"({parent_bound})",
            )


# --------------------------------------------------------------------------------------------
# 6. block table and slots


def check_blocks(
    k: int, p: HostMetadata, s: UBatchSlice, u: HostMetadata, block_size: int | None
) -> None:
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
        fail(
            "block table",
            "block_table_tensor",
            k,
            reqs.start + bad,
            f"row {bad} is not the block-table row of the parent's request {reqs.start + bad}",
        )
    for j, (got, want) in enumerate(zip(u.slots, p.slots[toks])):
        if got != want:
            r = bisect.bisect_right(p.qsl, toks.start + j) - 1
            fail(
                "block table",
                "slot_mapping",
                k,
                r,
                f"token {toks.start + j} maps to slot {got}; the parent maps it to {want}",
            )
    if block_size is not None:
        _check_slots_in_blocks(k, s, u, block_size)


def _check_slots_in_blocks(k: int, s: UBatchSlice, u: HostMetadata, block_size: int) -> None:
    """Each real token's slot is in its request's blocks, at its position in the sequence."""
    for i in range(u.num_reqs):
        row = u.table[i].tolist()
        for j in range(u.qsl[i], u.qsl[i + 1]):
            pos = u.computed[i] + j - u.qsl[i]
            block = pos // block_size
            want = row[block] * block_size + pos % block_size if block < len(row) else None
            if u.slots[j] != want:
                fail(
                    "block table",
                    "slot_mapping",
                    k,
                    s.request_slice.start + i,
                    f"token {s.token_slice.start + j} (position {pos}) maps to slot "
                    f"{u.slots[j]}, not into its request's block-table row (slot {want})",
                )
