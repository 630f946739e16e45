"""Attention metadata and how it follows a ubatch cut (vLLM's `CommonAttentionMetadata`,
`split_attn_metadata`).

Each slice gets its own record: rebased `query_start_loc`, its requests' `seq_lens`,
block-table rows and computed-token counts, its tokens' `slot_mapping` and `positions`. A
request cut by a boundary keeps, in the earlier ubatch, only its first part (its query and its
`seq_lens` shortened by what the next ubatch takes) and, in the later one, the rest (query
starting at the cut, full `seq_lens`, and the earlier part counted as computed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dbo.split.checks import as_count
from dbo.split.records import UBatchSlice

__all__ = [
    "PAD_SLOT_ID",
    "CommonAttentionMetadata",
    "slice_query_start_locs",
    "split_attn_metadata",
    "as_split_metadata",
]

PAD_SLOT_ID = -1  # vLLM's slot for a padding token: written nowhere in the KV cache


# eq=False: tensor fields make field-wise == ambiguous, so records compare by identity.
@dataclass(frozen=True, eq=False)
class CommonAttentionMetadata:
    """The attention metadata a ubatch split has to slice (a subset of vLLM's record).

    Per request row (`num_reqs` of them, padding requests included, as in vLLM):
    `query_start_loc` (+1 entry, on the device) and `query_start_loc_cpu`, `seq_lens`,
    `num_computed_tokens_cpu`, `block_table_tensor` rows. Per token: `slot_mapping` (padding
    tokens `PAD_SLOT_ID`). `num_actual_tokens` is the token count the batch runs (padding
    included). Optional, as in vLLM (None when the model runner does not fill them):
    `positions` (per token, each token's position in its sequence), `is_prefilling` (per
    request, still in its prompt) and model runner V2's `seq_lens_cpu_upper_bound` (per
    request, a host-side bound on `seq_lens` that needs no device sync).
    """

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    num_computed_tokens_cpu: torch.Tensor
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    positions: torch.Tensor | None = None
    is_prefilling: torch.Tensor | None = None
    seq_lens_cpu_upper_bound: torch.Tensor | None = None

    @classmethod
    def make(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        *,
        block_size: int = 16,
        num_tokens_padded: int | None = None,
        num_reqs_padded: int | None = None,
        prompt_lens: Sequence[int] | None = None,
        device: torch.device | str = "cpu",
    ) -> CommonAttentionMetadata:
        """Metadata for requests with these query and sequence lengths, blocks numbered in
        order (request r's blocks follow request r - 1's). Padding requests have no tokens and
        seq_len 0; padding tokens map to slot `PAD_SLOT_ID` and position 0. `prompt_lens`
        (per request) fills `is_prefilling`: a request whose computed tokens stop short of its
        prompt."""
        q, s = _lengths(query_lens, seq_lens)
        bs = as_count("block_size", block_size)
        if bs < 1:
            raise ValueError("block_size must be >= 1")
        tokens, padded_reqs = _padded_counts(q, num_tokens_padded, num_reqs_padded)
        pad_r = padded_reqs - len(q)
        qsl = [0]
        for ql in q:
            qsl.append(qsl[-1] + ql)
        qsl += [qsl[-1]] * pad_r
        table = _block_table(s, bs, padded_reqs)
        slots, positions = _slots_and_positions(q, s, qsl, table, bs, tokens)
        qsl_cpu = torch.tensor(qsl, dtype=torch.int32)
        seq_cpu = torch.tensor(s + [0] * pad_r, dtype=torch.int32)
        return cls(
            query_start_loc=qsl_cpu.to(device),
            query_start_loc_cpu=qsl_cpu,
            seq_lens=seq_cpu.to(device),
            num_computed_tokens_cpu=torch.tensor(
                [sl - ql for sl, ql in zip(s, q)] + [0] * pad_r, dtype=torch.int32
            ),
            block_table_tensor=table.to(device),
            slot_mapping=slots.to(device),
            num_reqs=padded_reqs,
            num_actual_tokens=tokens,
            max_query_len=max(q, default=0),
            max_seq_len=max(s, default=0),
            positions=positions.to(device),
            is_prefilling=_is_prefilling(q, s, prompt_lens, pad_r, device),
            seq_lens_cpu_upper_bound=seq_cpu.clone(),
        )


def _lengths(query_lens: Sequence[int], seq_lens: Sequence[int]) -> tuple[list[int], list[int]]:
    q = [as_count(f"query_lens[{i}]", v) for i, v in enumerate(query_lens)]
    s = [as_count(f"seq_lens[{i}]", v) for i, v in enumerate(seq_lens)]
    if len(q) != len(s):
        raise ValueError(f"query_lens has {len(q)} entries but seq_lens has {len(s)}")
    for i, (ql, sl) in enumerate(zip(q, s)):
        if sl < ql:
            raise ValueError(f"seq_lens[{i}] ({sl}) is smaller than query_lens[{i}] ({ql})")
    return q, s


def _padded_counts(
    q: list[int], num_tokens_padded: int | None, num_reqs_padded: int | None
) -> tuple[int, int]:
    real_tokens, reqs = sum(q), len(q)
    tokens = real_tokens if num_tokens_padded is None else num_tokens_padded
    padded_reqs = reqs if num_reqs_padded is None else num_reqs_padded
    if as_count("num_tokens_padded", tokens) < real_tokens:
        raise ValueError(f"num_tokens_padded ({tokens}) is below the {real_tokens} tokens")
    if as_count("num_reqs_padded", padded_reqs) < reqs:
        raise ValueError(f"num_reqs_padded ({padded_reqs}) is below the {reqs} requests")
    return tokens, padded_reqs


def _block_table(s: list[int], bs: int, rows: int) -> torch.Tensor:
    blocks = [-(-sl // bs) for sl in s]
    table = torch.full((rows, max([1, *blocks])), -1, dtype=torch.int32)
    first = 0
    for r, nb in enumerate(blocks):
        table[r, :nb] = torch.arange(first, first + nb, dtype=torch.int32)
        first += nb
    return table


def _slots_and_positions(
    q: list[int], s: list[int], qsl: list[int], table: torch.Tensor, bs: int, tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    slots = torch.full((tokens,), PAD_SLOT_ID, dtype=torch.int64)
    positions = torch.zeros(tokens, dtype=torch.int64)
    for r in range(len(q)):
        context = s[r] - q[r]
        for i in range(q[r]):
            pos = context + i
            slots[qsl[r] + i] = int(table[r, pos // bs]) * bs + pos % bs
            positions[qsl[r] + i] = pos
    return slots, positions


def _is_prefilling(
    q: list[int], s: list[int], prompt_lens: Sequence[int] | None, pad_r: int, device: Any
) -> torch.Tensor | None:
    if prompt_lens is None:
        return None
    prompts = [as_count(f"prompt_lens[{i}]", v) for i, v in enumerate(prompt_lens)]
    if len(prompts) != len(q):
        raise ValueError(f"prompt_lens has {len(prompts)} entries but query_lens has {len(q)}")
    flags = [sl - ql < p for sl, ql, p in zip(s, q, prompts)] + [False] * pad_r
    return torch.tensor(flags, dtype=torch.bool, device=device)


# --------------------------------------------------------------------------------------------
# Following the cut


def slice_query_start_locs(query_start_loc: torch.Tensor, request_slice: slice) -> torch.Tensor:
    """The `query_start_loc` entries of `request_slice`'s requests, rebased to start at 0
    (whole requests; `split_attn_metadata` also trims a request cut by the boundary)."""
    return (
        query_start_loc[request_slice.start : request_slice.stop + 1]
        - query_start_loc[request_slice.start]
    )


def _check_slice_against(ubatch_slice: Any, meta: CommonAttentionMetadata, cu: list[int]) -> None:
    if not isinstance(ubatch_slice, UBatchSlice):
        raise TypeError(f"expected a UBatchSlice, got {type(ubatch_slice).__name__}")
    reqs, toks = ubatch_slice.request_slice, ubatch_slice.token_slice
    bounds = (reqs.start, reqs.stop, toks.start, toks.stop)
    if reqs.step not in (None, 1) or toks.step not in (None, 1) or None in bounds:
        raise ValueError(
            f"ubatch_slice must use contiguous slices with explicit bounds, got {ubatch_slice}"
        )
    if ubatch_slice.is_empty():
        raise ValueError(
            f"ubatch slice {ubatch_slice} is empty: a ubatch needs real tokens (check "
            f"is_last_ubatch_empty before splitting)"
        )
    if not 0 <= reqs.start < reqs.stop <= len(cu) - 1:
        raise ValueError(
            f"request_slice {reqs} is outside the metadata's {len(cu) - 1} request rows"
        )
    if not 0 <= toks.start < toks.stop <= meta.slot_mapping.shape[0]:
        raise ValueError(
            f"token_slice {toks} is outside the metadata's {meta.slot_mapping.shape[0]} tokens"
        )
    # vLLM's rule: the first token lies in the first request. A slice of padding only (its
    # first token past the real ones, in no request) is refused, as vLLM refuses it: its
    # metadata would be negative (query_start_loc [0, -1], max_query_len -1).
    if not cu[reqs.start] <= toks.start < cu[reqs.start + 1]:
        padding = "; a slice of padding only has no request to run" * (toks.start >= cu[-1])
        raise ValueError(
            f"Token slice start outside of first request: ubatch slice {ubatch_slice} does "
            f"not match the metadata: its first token {toks.start} is not in its first "
            f"request (tokens [{cu[reqs.start]}, {cu[reqs.start + 1]})){padding}"
        )


def _check_last_request(ubatch_slice: UBatchSlice, cu: list[int]) -> None:
    """Every request of the slice must start by its last token: one that starts after it
    would get a negative query length (vLLM 0.33 does not check, and returns a decreasing
    query_start_loc)."""
    reqs, toks = ubatch_slice.request_slice, ubatch_slice.token_slice
    if cu[reqs.stop - 1] > toks.stop:
        raise ValueError(
            f"ubatch slice {ubatch_slice} does not match the metadata: its request "
            f"{reqs.stop - 1} starts at token {cu[reqs.stop - 1]}, past the slice's end "
            f"{toks.stop}; end request_slice at the first request that starts at or after it"
        )


def _optional(field: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if field is None else field[rows]


def _make_metadata_with_slice(
    ubatch_slice: UBatchSlice, attn_metadata: CommonAttentionMetadata
) -> CommonAttentionMetadata:
    """The metadata of one ubatch: its requests and tokens, a cut request trimmed. vLLM's
    own `UBatchSlice` (any record with its two slices) is accepted too."""
    if not isinstance(ubatch_slice, UBatchSlice) and hasattr(ubatch_slice, "token_slice"):
        ubatch_slice = UBatchSlice(ubatch_slice.request_slice, ubatch_slice.token_slice)
    cu = [int(v) for v in attn_metadata.query_start_loc_cpu.tolist()]
    _check_slice_against(ubatch_slice, attn_metadata, cu)
    _check_last_request(ubatch_slice, cu)
    reqs, toks = ubatch_slice.request_slice, ubatch_slice.token_slice
    # Tokens of the first request that an earlier ubatch ran, and of the last request that a
    # later ubatch runs (0 unless the boundary cuts it; padding tokens past it are not cut).
    head_cut = toks.start - cu[reqs.start]
    tail_cut = max(0, cu[reqs.stop] - toks.stop)

    qsl_cpu = slice_query_start_locs(attn_metadata.query_start_loc_cpu, reqs).clone()
    qsl = slice_query_start_locs(attn_metadata.query_start_loc, reqs).clone()
    seq_lens = attn_metadata.seq_lens[reqs].clone()
    computed = attn_metadata.num_computed_tokens_cpu[reqs].clone()
    upper = _optional(attn_metadata.seq_lens_cpu_upper_bound, reqs)
    upper = None if upper is None else upper.clone()
    if head_cut:
        qsl_cpu[1:] -= head_cut
        qsl[1:] -= head_cut
        computed[0] += head_cut
    if tail_cut:
        qsl_cpu[-1] -= tail_cut
        qsl[-1] -= tail_cut
        seq_lens[-1] -= tail_cut
        if upper is not None:
            upper[-1] -= tail_cut
    query_lens = qsl_cpu[1:] - qsl_cpu[:-1]
    max_query_len = int(query_lens.max()) if query_lens.numel() else 0
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl_cpu,
        seq_lens=seq_lens,
        num_computed_tokens_cpu=computed,
        block_table_tensor=attn_metadata.block_table_tensor[reqs],
        slot_mapping=attn_metadata.slot_mapping[toks],
        num_reqs=ubatch_slice.num_requests,
        num_actual_tokens=ubatch_slice.num_tokens,
        # 0 only for a dummy run (every query empty): keep the batch's, as vLLM does
        max_query_len=max_query_len or attn_metadata.max_query_len,
        # floored by the whole batch's, as vLLM does: kernels picked for a captured graph
        # by max_seq_len must stay the captured ones
        max_seq_len=max(int(seq_lens.max()) if seq_lens.numel() else 0, attn_metadata.max_seq_len),
        positions=_optional(attn_metadata.positions, toks),
        is_prefilling=_optional(attn_metadata.is_prefilling, reqs),
        seq_lens_cpu_upper_bound=upper,
    )


def split_attn_metadata(
    ubatch_slices: Sequence[UBatchSlice], common_attn_metadata: CommonAttentionMetadata
) -> list[CommonAttentionMetadata]:
    """One metadata per slice (the input is not modified). Raises ValueError for an empty
    slice or one that does not match the metadata."""
    metadata = as_split_metadata(common_attn_metadata)
    return [_make_metadata_with_slice(s, metadata) for s in ubatch_slices]


# --------------------------------------------------------------------------------------------
# vLLM's own record (vllm.v1.attention.backend.CommonAttentionMetadata), read as this one.
# 0.33's record has no num_computed_tokens_cpu: it is derived from the host-side sequence
# lengths minus the query lengths, which is what it meant. vLLM is never imported: any
# object with vLLM's field names is accepted.

_REQUIRED = (
    "query_start_loc",
    "query_start_loc_cpu",
    "seq_lens",
    "num_reqs",
    "num_actual_tokens",
    "max_query_len",
    "max_seq_len",
    "block_table_tensor",
    "slot_mapping",
)


def as_split_metadata(metadata: Any) -> CommonAttentionMetadata:
    """`metadata` itself when it is dbo.split's record; vLLM's record (or any with its field
    names) converted; anything else refused with the fields it lacks."""
    if isinstance(metadata, CommonAttentionMetadata):
        return metadata
    missing = [name for name in _REQUIRED if not hasattr(metadata, name)]
    if missing:
        raise TypeError(
            f"common_attn_metadata must be a CommonAttentionMetadata (dbo.split's or vLLM's), "
            f"got {type(metadata).__name__} without {', '.join(missing)}"
        )
    qsl_cpu = metadata.query_start_loc_cpu
    upper = getattr(metadata, "seq_lens_cpu_upper_bound", None)
    host_seq_lens = upper if upper is not None else metadata.seq_lens.cpu()
    computed = getattr(metadata, "num_computed_tokens_cpu", None)
    if computed is None:
        computed = (host_seq_lens - (qsl_cpu[1:] - qsl_cpu[:-1])).to(torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=metadata.query_start_loc,
        query_start_loc_cpu=qsl_cpu,
        seq_lens=metadata.seq_lens,
        num_computed_tokens_cpu=computed,
        block_table_tensor=metadata.block_table_tensor,
        slot_mapping=metadata.slot_mapping,
        num_reqs=int(metadata.num_reqs),
        num_actual_tokens=int(metadata.num_actual_tokens),
        max_query_len=int(metadata.max_query_len),
        max_seq_len=int(metadata.max_seq_len),
        positions=getattr(metadata, "positions", None),
        is_prefilling=getattr(metadata, "is_prefilling", None),
        seq_lens_cpu_upper_bound=upper,
    )
