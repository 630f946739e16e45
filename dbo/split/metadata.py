"""Attention metadata and how it follows a ubatch cut (vLLM's `CommonAttentionMetadata`,
`split_attn_metadata`).

Each slice gets its own record: rebased `query_start_loc`, its requests' `seq_lens`,
block-table rows and computed-token counts, its tokens' `slot_mapping` and `positions`. A
request cut by a boundary keeps, in the earlier ubatch, only its first part (its query and its
`seq_lens` shortened by what the next ubatch takes) and, in the later one, the rest (query
starting at the cut, full `seq_lens`, and the earlier part counted as computed).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, fields, is_dataclass
from typing import Any

import torch

from dbo.split.checks import as_count
from dbo.split.records import UBatchSlice

__all__ = [
    "PAD_SLOT_ID",
    "CommonAttentionMetadata",
    "slice_query_start_locs",
    "split_attn_metadata",
]

PAD_SLOT_ID = -1  # vLLM's slot for a padding token: written nowhere in the KV cache


# eq=False: tensor fields make field-wise == ambiguous, so records compare by identity.
@dataclass(frozen=True, eq=False)
class CommonAttentionMetadata:
    """The attention metadata a ubatch split has to slice (a subset of vLLM 0.33's record,
    same field names; `dbo.split.split_attn_metadata` also takes vLLM's own record).

    Per request row (`num_reqs` of them, padding requests included, as in vLLM):
    `query_start_loc` (+1 entry, on the device) and `query_start_loc_cpu`, `seq_lens`,
    `block_table_tensor` rows. Per token: `slot_mapping` (padding tokens `PAD_SLOT_ID`).
    `num_actual_tokens` is the token count the batch runs (padding included). Optional, as in
    vLLM (None when the model runner does not fill them): `positions` (per token, each token's
    position in its sequence), `is_prefilling` (per request, still in its prompt) and
    `seq_lens_cpu_upper_bound` (per request, a host-side bound on `seq_lens` that needs no
    device sync; a split needs it, as vLLM's does).

    `num_computed_tokens_cpu` is no field of vLLM 0.33's record (it derives
    `compute_num_computed_tokens()`, seq_lens - query lens); here it may be omitted and is
    then derived the same way, on the host. Given, it is what the split checker compares.
    """

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    positions: torch.Tensor | None = None
    is_prefilling: torch.Tensor | None = None
    seq_lens_cpu_upper_bound: torch.Tensor | None = None
    num_computed_tokens_cpu: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.num_computed_tokens_cpu is None:
            # frozen: the derived default is set once, here, as vLLM caches its own
            object.__setattr__(self, "num_computed_tokens_cpu", self._derived_computed())

    def _derived_computed(self) -> torch.Tensor:
        qsl = self.query_start_loc_cpu
        return self.seq_lens.cpu() - (qsl[1:] - qsl[:-1])

    def compute_num_computed_tokens(self) -> torch.Tensor:
        """vLLM 0.33's accessor: computed tokens per request, on the device of `seq_lens`."""
        computed = self.num_computed_tokens_cpu
        assert computed is not None  # set by __post_init__
        return computed.to(self.seq_lens.device)

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
        """Metadata for requests of these query and sequence lengths, blocks numbered in order
        (request r's follow request r - 1's). Padding requests have no tokens and seq_len 0;
        padding tokens map to slot `PAD_SLOT_ID`, position 0. `prompt_lens` (per request) fills
        `is_prefilling`: a request whose computed tokens stop short of its prompt."""
        q, s = _lengths(query_lens, seq_lens)
        bs = _block_size(block_size)
        tokens, padded_reqs = _padded_counts(q, num_tokens_padded, num_reqs_padded)
        pad_r = padded_reqs - len(q)
        qsl = list(itertools.accumulate(q, initial=0)) + [sum(q)] * pad_r  # padding: no tokens
        table = _block_table(s, bs, padded_reqs)
        slots, positions = _slots_and_positions(q, s, qsl, table, bs, tokens)
        qsl_cpu = torch.tensor(qsl, dtype=torch.int32)
        seq_cpu = torch.tensor(s + [0] * pad_r, dtype=torch.int32)
        computed = [sl - ql for sl, ql in zip(s, q)] + [0] * pad_r
        return cls(
            query_start_loc=qsl_cpu.to(device),
            query_start_loc_cpu=qsl_cpu,
            seq_lens=seq_cpu.to(device),
            num_computed_tokens_cpu=torch.tensor(computed, dtype=torch.int32),
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


def _block_size(block_size: Any) -> int:
    bs = as_count("block_size", block_size)
    if bs < 1:
        raise ValueError("block_size must be >= 1")
    return bs


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
    """Refuse, before any work, every slice vLLM's `_make_metadata_with_slice` asserts against
    (with its reason first) and every one it would turn into negative or inconsistent
    metadata without a word."""
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
            f"Ubatch slice {ubatch_slice} is empty: a ubatch needs real tokens (check "
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
    if meta.seq_lens_cpu_upper_bound is None:
        raise ValueError(
            "seq_lens_cpu_upper_bound is None: splitting needs the host-side bound on seq_lens "
            "(vLLM's split asserts it too); fill it as CommonAttentionMetadata.make does"
        )
    _check_requests_hold_the_tokens(ubatch_slice, cu)
    _check_seq_lens_cover_queries(ubatch_slice, meta, cu)


def _check_requests_hold_the_tokens(ubatch_slice: UBatchSlice, cu: list[int]) -> None:
    reqs, toks = ubatch_slice.request_slice, ubatch_slice.token_slice
    # vLLM's assert: a slice made only of padding (its first token past the real ones) has no
    # request to hold that token; the V2 rules that run such a ubatch pass allow_empty.
    if not cu[reqs.start] <= toks.start < cu[reqs.start + 1]:
        why = (
            "it holds only padding (refused as in vLLM; pass allow_empty=True where the "
            "engine runs such a ubatch)"
            if toks.start >= cu[-1]
            else "the slice does not match the metadata"
        )
        raise ValueError(
            f"Token slice start outside of first request: ubatch slice {ubatch_slice} starts "
            f"at token {toks.start}, but its first request {reqs.start} holds tokens "
            f"[{cu[reqs.start]}, {cu[reqs.start + 1]}): {why}"
        )
    last = reqs.stop - 1
    if cu[last] > toks.stop:  # vLLM would give it a negative query length
        raise ValueError(
            f"ubatch slice {ubatch_slice} does not match the metadata: its last request {last} "
            f"starts at token {cu[last]}, after the slice's tokens end ({toks.stop})"
        )
    real_end = min(toks.stop, cu[-1])
    if real_end > cu[reqs.stop]:  # real tokens no request of the slice holds
        raise ValueError(
            f"ubatch slice {ubatch_slice} does not match the metadata: its tokens "
            f"[{cu[reqs.stop]}, {real_end}) belong to requests after its last one ({last})"
        )


def _check_seq_lens_cover_queries(
    ubatch_slice: UBatchSlice, meta: CommonAttentionMetadata, cu: list[int]
) -> None:
    reqs = ubatch_slice.request_slice
    seq_lens = [int(v) for v in meta.seq_lens[reqs].tolist()]
    for r, seq_len in zip(range(reqs.start, reqs.stop), seq_lens):
        if seq_len < cu[r + 1] - cu[r]:
            raise ValueError(
                f"metadata's seq_lens[{r}] ({seq_len}) is below request {r}'s query length "
                f"({cu[r + 1] - cu[r]}): a split would give it negative computed tokens"
            )


def _optional(field: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if field is None else field[rows]


def _make_metadata_with_slice(
    ubatch_slice: UBatchSlice, attn_metadata: CommonAttentionMetadata
) -> CommonAttentionMetadata:
    """The metadata of one ubatch: its requests and tokens, a cut request trimmed."""
    cu = [int(v) for v in attn_metadata.query_start_loc_cpu.tolist()]
    _check_slice_against(ubatch_slice, attn_metadata, cu)
    reqs, toks = ubatch_slice.request_slice, ubatch_slice.token_slice
    qsl_cpu, qsl, seq_lens, computed, upper = _trimmed_rows(attn_metadata, reqs, toks, cu)
    # >= 1: the checks above put the first token inside the first request (vLLM's fallback
    # for a dummy run of empty queries is unreachable behind the same assert)
    max_query_len = int((qsl_cpu[1:] - qsl_cpu[:-1]).max())
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl_cpu,
        seq_lens=seq_lens,
        num_computed_tokens_cpu=computed,
        block_table_tensor=attn_metadata.block_table_tensor[reqs],
        slot_mapping=attn_metadata.slot_mapping[toks],
        num_reqs=ubatch_slice.num_requests,
        num_actual_tokens=ubatch_slice.num_tokens,
        max_query_len=max_query_len,
        # floored by the whole batch's, as vLLM does: kernels picked for a captured graph
        # by max_seq_len must stay the captured ones
        max_seq_len=max(int(seq_lens.max()) if seq_lens.numel() else 0, attn_metadata.max_seq_len),
        positions=_optional(attn_metadata.positions, toks),
        is_prefilling=_optional(attn_metadata.is_prefilling, reqs),
        seq_lens_cpu_upper_bound=upper,
    )


def _trimmed_rows(
    meta: CommonAttentionMetadata, reqs: slice, toks: slice, cu: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Copies of the per-request rows of `reqs` (query_start_loc on the host and the device,
    seq_lens, num_computed_tokens_cpu, seq_lens_cpu_upper_bound), trimmed to the tokens in
    `toks` where the slice cuts its first or last request."""
    # Tokens of the first request that an earlier ubatch ran, and of the last request that a
    # later ubatch runs (0 unless the boundary cuts it; padding tokens past it are not cut).
    head_cut = toks.start - cu[reqs.start]
    tail_cut = max(0, cu[reqs.stop] - toks.stop)
    qsl_cpu = slice_query_start_locs(meta.query_start_loc_cpu, reqs).clone()
    qsl = slice_query_start_locs(meta.query_start_loc, reqs).clone()
    seq_lens = meta.seq_lens[reqs].clone()
    computed = meta.num_computed_tokens_cpu[reqs].clone()
    upper = _optional(meta.seq_lens_cpu_upper_bound, reqs)
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
    return qsl_cpu, qsl, seq_lens, computed, upper


def _empty_slice_metadata(
    ubatch_slice: UBatchSlice, attn_metadata: CommonAttentionMetadata
) -> CommonAttentionMetadata:
    """The record of a ubatch with no real tokens: no request rows, and the slice's padding
    tokens (none for an unpadded empty slice), as vLLM's V2 runner runs it like a dummy run."""
    toks = ubatch_slice.token_slice
    width = attn_metadata.block_table_tensor.shape[1]
    rows = attn_metadata.block_table_tensor[:0].reshape(0, width)
    zero = attn_metadata.query_start_loc_cpu[:1] * 0
    return CommonAttentionMetadata(
        query_start_loc=zero.to(attn_metadata.query_start_loc.device),
        query_start_loc_cpu=zero,
        seq_lens=attn_metadata.seq_lens[:0],
        num_computed_tokens_cpu=attn_metadata.num_computed_tokens_cpu[:0],
        block_table_tensor=rows,
        slot_mapping=attn_metadata.slot_mapping[toks],
        num_reqs=0,
        num_actual_tokens=max(0, toks.stop - toks.start),
        max_query_len=attn_metadata.max_query_len,
        max_seq_len=attn_metadata.max_seq_len,
        positions=_optional(attn_metadata.positions, toks),
        is_prefilling=_optional(attn_metadata.is_prefilling, slice(0, 0)),
        seq_lens_cpu_upper_bound=_optional(attn_metadata.seq_lens_cpu_upper_bound, slice(0, 0)),
    )


def _holds_no_real_token(ubatch_slice: Any, attn_metadata: CommonAttentionMetadata) -> bool:
    real = int(attn_metadata.query_start_loc_cpu[-1])
    toks = getattr(ubatch_slice, "token_slice", None)
    return (
        isinstance(toks, slice)
        and toks.start is not None
        and toks.start >= min(real, toks.stop if toks.stop is not None else real)
    )


def split_attn_metadata(
    ubatch_slices: Sequence[UBatchSlice],
    common_attn_metadata: CommonAttentionMetadata,
    *,
    allow_empty: bool = False,
) -> list[CommonAttentionMetadata]:
    """One metadata per slice (the input is not modified). Raises ValueError for a slice
    that does not match the metadata, and for a slice with no real tokens unless
    `allow_empty` (engines whose split rules run such a ubatch: vLLM's V2 runner, SGLang),
    which gives it a record with no request rows.

    Also takes vLLM's own `CommonAttentionMetadata` and `UBatchSlice`s, and then returns
    vLLM's records, with the fields vLLM's split fills (and `is_prefilling`, which vLLM 0.33's
    drops); its other optional fields are left unset, as vLLM's split leaves them."""
    meta = _as_our_metadata(common_attn_metadata)
    parts = [
        _empty_slice_metadata(s, meta)
        if allow_empty and _holds_no_real_token(s, meta)
        else _make_metadata_with_slice(_as_our_slice(s), meta)
        for s in ubatch_slices
    ]
    if meta is common_attn_metadata:
        return parts
    return [_as_their_metadata(p, type(common_attn_metadata)) for p in parts]


# --------------------------------------------------------------------------------------------
# vLLM's records in and out: the same field names, so a split reads and fills them by name.

_OUR_FIELDS = tuple(f.name for f in fields(CommonAttentionMetadata))
_REQUIRED_FIELDS = tuple(f.name for f in fields(CommonAttentionMetadata) if f.default is MISSING)


def _as_our_metadata(meta: Any) -> CommonAttentionMetadata:
    if isinstance(meta, CommonAttentionMetadata):
        return meta
    theirs = {f.name for f in fields(meta)} if is_dataclass(meta) else set()
    missing = [name for name in _REQUIRED_FIELDS if name not in theirs]
    if missing:
        raise TypeError(
            f"common_attn_metadata must be a CommonAttentionMetadata (dbo.split's or vLLM's), "
            f"got {type(meta).__module__}.{type(meta).__name__} without {', '.join(missing)}"
        )
    return CommonAttentionMetadata(
        **{name: getattr(meta, name) for name in _OUR_FIELDS if name in theirs}
    )


def _as_their_metadata(part: CommonAttentionMetadata, cls: type) -> Any:
    theirs = {f.name for f in fields(cls)}
    return cls(**{name: getattr(part, name) for name in _OUR_FIELDS if name in theirs})


def _as_our_slice(ubatch_slice: Any) -> Any:
    """vLLM's `UBatchSlice` (a plain dataclass of the same two slices) as ours; anything
    else is left for the checks to refuse."""
    if isinstance(ubatch_slice, UBatchSlice):
        return ubatch_slice
    reqs = getattr(ubatch_slice, "request_slice", None)
    toks = getattr(ubatch_slice, "token_slice", None)
    if isinstance(reqs, slice) and isinstance(toks, slice):
        return UBatchSlice(reqs, toks)
    return ubatch_slice
