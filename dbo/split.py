"""Splitting one step's batch into N ubatches, under vLLM's names: where to cut, whether to,
how attention metadata follows the cut, and agreeing on it across data-parallel ranks.

A step's scheduled tokens are laid out request after request (`num_scheduled_tokens[r]` of
request r; their prefix sums are `query_start_loc`). The batch may be padded (for CUDA graphs,
or to match other DP ranks) to `num_tokens_padded` tokens and `num_reqs_padded` requests.

Cutting (vLLM's `maybe_create_ubatch_slices` / `create_ubatch_slices`). The split point is
q = num_tokens_padded // N and cut k falls at k * q. A ubatch holds the requests whose tokens
overlap its range: it starts at the request holding its first token and stops before the first
request starting at or after its end, so a request the cut passes through is in both
neighbours. The unpadded last slice ends at the real token count; the padded one runs to
`num_tokens_padded` and takes the padding requests up to `num_reqs_padded`.

    >>> plain, padded = maybe_create_ubatch_slices(True, [3, 7, 2], 16, 3, 2)
    >>> [(s.request_slice, s.token_slice) for s in plain]  # the cut at 8 cuts request 1
    [(slice(0, 2, None), slice(0, 8, None)), (slice(1, 3, None), slice(8, 12, None))]
    >>> padded[-1].token_slice
    slice(8, 16, None)

Metadata (`split_attn_metadata`). Each slice gets its own `CommonAttentionMetadata`: rebased
`query_start_loc`, its requests' `seq_lens`, block-table rows and computed-token counts, its
tokens' `slot_mapping`. A request cut by a boundary keeps, in the earlier ubatch, only its
first part (its query and its `seq_lens` shortened by what the next ubatch takes) and, in the
later one, the rest (query starting at the cut, full `seq_lens`).

Deciding and agreeing. `check_ubatch_thresholds` applies the size thresholds and
`is_last_ubatch_empty` the rule that every ubatch must hold real tokens;
`coordinate_batch_across_dp` makes every DP rank take the same decision with one collective,
by vLLM's rules: split only if every rank can and the rank with the fewest real tokens, padded
to the largest count, still fills its last ubatch; the CUDA-graph mode is the minimum over
ranks; every rank is padded to the largest count when the agreed mode is not NONE or the step
is split, and otherwise runs its own count. `coordinate_ubatching` is the same exchange with
a richer answer (`UBatchDecision`).

Deliberate differences from vLLM (each safer, none on a path vLLM's own runner takes):
- `is_last_ubatch_empty` is also True when the split point is 0 (fewer padded tokens than
  ubatches), where vLLM's formula answers False and every ubatch but the last is empty;
- where vLLM would build a negative-length last slice (an empty last ubatch), the unpadded
  last slice here is empty (`is_empty()`), and request positions past the real tokens are
  clamped to the last real request;
- in the later part of a cut request `num_computed_tokens_cpu` counts the earlier part too,
  so `seq_lens - query lens == num_computed_tokens` holds for every request of every slice
  (vLLM keeps the whole request's count there);
- bad input raises ValueError/TypeError naming the argument, never a bare assert;
- the agreement also compares ubatch counts across ranks (UBatchAgreementError naming each)
  and flags a rank's bad arguments in the exchange, so its peers raise instead of hanging;
- a rank's `cudagraph_mode` travels as an int (0 = NONE), as in vLLM's all-reduce.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dbo.checks import as_int

__all__ = [
    "CommonAttentionMetadata",
    "DBOConfig",
    "UBatchAgreementError",
    "UBatchDecision",
    "UBatchProposal",
    "UBatchSlice",
    "UBatchSlices",
    "UBatchThresholds",
    "check_ubatch_thresholds",
    "coordinate_batch_across_dp",
    "coordinate_ubatching",
    "create_ubatch_slices",
    "decide_ubatching",
    "is_last_ubatch_empty",
    "maybe_create_ubatch_slices",
    "should_ubatch",
    "slice_query_start_locs",
    "split_attn_metadata",
    "split_batch",
    "ubatch_cut_points",
]


class UBatchAgreementError(ValueError):
    """The data-parallel ranks cannot agree on ubatching (different ubatch counts, or a rank
    passed bad arguments). Raised on every rank of the group, with the same message."""


# --------------------------------------------------------------------------------------------
# Records


@dataclass(frozen=True)
class UBatchSlice:
    """The requests and tokens of one ubatch, as half-open slices of the step's batch.

    A request cut by a ubatch boundary is in both neighbours' `request_slice`.
    """

    request_slice: slice
    token_slice: slice

    @property
    def num_tokens(self) -> int:
        return self.token_slice.stop - self.token_slice.start

    @property
    def num_requests(self) -> int:
        return self.request_slice.stop - self.request_slice.start

    def is_empty(self) -> bool:
        return self.num_tokens <= 0 or self.num_requests <= 0


UBatchSlices = list[UBatchSlice]


@dataclass(frozen=True)
class UBatchThresholds:
    """The smallest steps worth splitting: below these the overlap gains less than the split
    costs (a decode step of a few tokens is launch-bound, not communication-bound).

    Also readable under vLLM's `ParallelConfig` names, so `check_ubatch_thresholds` takes
    either this or a vLLM config.
    """

    decode_min_tokens: int = 32
    prefill_min_tokens: int = 512

    def __post_init__(self) -> None:
        _as_count("decode_min_tokens", self.decode_min_tokens)
        _as_count("prefill_min_tokens", self.prefill_min_tokens)

    def min_tokens(self, is_decode_only: bool) -> int:
        return self.decode_min_tokens if is_decode_only else self.prefill_min_tokens

    @property
    def use_ubatching(self) -> bool:
        return True

    @property
    def dbo_decode_token_threshold(self) -> int:
        return self.decode_min_tokens

    @property
    def dbo_prefill_token_threshold(self) -> int:
        return self.prefill_min_tokens


@dataclass(frozen=True)
class DBOConfig:
    """The fields of vLLM's `ParallelConfig` that ubatching reads, under the same names."""

    num_ubatches: int = 2
    use_ubatching: bool = True
    dbo_decode_token_threshold: int = 32
    dbo_prefill_token_threshold: int = 512

    def __post_init__(self) -> None:
        _as_num_ubatches(self.num_ubatches)
        _as_bool("use_ubatching", self.use_ubatching)
        _as_count("dbo_decode_token_threshold", self.dbo_decode_token_threshold)
        _as_count("dbo_prefill_token_threshold", self.dbo_prefill_token_threshold)


# eq=False: tensor fields make field-wise == ambiguous, so records compare by identity.
@dataclass(frozen=True, eq=False)
class CommonAttentionMetadata:
    """The attention metadata a ubatch split has to slice (a subset of vLLM's record).

    Per request row (`num_reqs` of them, padding requests included, as in vLLM):
    `query_start_loc` (+1 entry, on the device) and `query_start_loc_cpu`, `seq_lens`,
    `num_computed_tokens_cpu`, `block_table_tensor` rows. Per token: `slot_mapping` (padding
    tokens -1). `num_actual_tokens` is the token count the batch runs (padding included).
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

    @classmethod
    def make(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        *,
        block_size: int = 16,
        num_tokens_padded: int | None = None,
        num_reqs_padded: int | None = None,
        device: torch.device | str = "cpu",
    ) -> CommonAttentionMetadata:
        """Metadata for requests with these query and sequence lengths, blocks numbered in
        order (request r's blocks follow request r - 1's). Padding requests have no tokens and
        seq_len 0; padding tokens map to slot -1."""
        q = [_as_count(f"query_lens[{i}]", v) for i, v in enumerate(query_lens)]
        s = [_as_count(f"seq_lens[{i}]", v) for i, v in enumerate(seq_lens)]
        if len(q) != len(s):
            raise ValueError(f"query_lens has {len(q)} entries but seq_lens has {len(s)}")
        for i, (ql, sl) in enumerate(zip(q, s)):
            if sl < ql:
                raise ValueError(f"seq_lens[{i}] ({sl}) is smaller than query_lens[{i}] ({ql})")
        bs = _as_count("block_size", block_size)
        if bs < 1:
            raise ValueError("block_size must be >= 1")
        real_tokens, reqs = sum(q), len(q)
        tokens = real_tokens if num_tokens_padded is None else num_tokens_padded
        padded_reqs = reqs if num_reqs_padded is None else num_reqs_padded
        if _as_count("num_tokens_padded", tokens) < real_tokens:
            raise ValueError(f"num_tokens_padded ({tokens}) is below the {real_tokens} tokens")
        if _as_count("num_reqs_padded", padded_reqs) < reqs:
            raise ValueError(f"num_reqs_padded ({padded_reqs}) is below the {reqs} requests")
        pad_r = padded_reqs - reqs
        qsl = [0]
        for ql in q:
            qsl.append(qsl[-1] + ql)
        qsl += [real_tokens] * pad_r
        blocks = [-(-sl // bs) for sl in s]
        width = max([1, *blocks])
        table = torch.full((padded_reqs, width), -1, dtype=torch.int32)
        first = 0
        for r, nb in enumerate(blocks):
            table[r, :nb] = torch.arange(first, first + nb, dtype=torch.int32)
            first += nb
        slots = torch.full((tokens,), -1, dtype=torch.int64)
        for r in range(reqs):
            context = s[r] - q[r]
            for i in range(q[r]):
                pos = context + i
                slots[qsl[r] + i] = int(table[r, pos // bs]) * bs + pos % bs
        qsl_cpu = torch.tensor(qsl, dtype=torch.int32)
        return cls(
            query_start_loc=qsl_cpu.to(device),
            query_start_loc_cpu=qsl_cpu,
            seq_lens=torch.tensor(s + [0] * pad_r, dtype=torch.int32, device=device),
            num_computed_tokens_cpu=torch.tensor(
                [sl - ql for sl, ql in zip(s, q)] + [0] * pad_r, dtype=torch.int32
            ),
            block_table_tensor=table.to(device),
            slot_mapping=slots.to(device),
            num_reqs=padded_reqs,
            num_actual_tokens=tokens,
            max_query_len=max(q, default=0),
            max_seq_len=max(s, default=0),
        )


# --------------------------------------------------------------------------------------------
# Argument checks


def _as_count(name: str, value: Any) -> int:
    return as_int(name, value, minimum=0)


def _as_bool(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def _as_num_ubatches(value: Any) -> int:
    n = _as_count("num_ubatches", value)
    if n < 2:
        raise ValueError(f"num_ubatches must be >= 2 to split, got {n}")
    return n


def _as_int_array(name: str, values: Any) -> list[int]:
    """A 1-D integer sequence as Python ints (one host copy, so a device tensor syncs once)."""
    if isinstance(values, torch.Tensor):
        if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got dtype {values.dtype}")
        arr = values.detach().cpu().numpy()
    else:
        arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(arr.shape)}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    return [int(v) for v in arr.tolist()]


def _as_query_start_loc(query_start_loc: Any) -> list[int]:
    name = "query_start_loc"
    values = _as_int_array(name, query_start_loc)
    if not values:
        raise ValueError(f"{name} must have at least one entry (num_requests + 1), got none")
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    for i in range(len(values) - 1):
        if values[i + 1] < values[i]:
            raise ValueError(
                f"{name} must be non-decreasing, but entry {i + 1} ({values[i + 1]}) is "
                f"less than entry {i} ({values[i]})"
            )
    return values


def _as_num_scheduled_tokens(num_scheduled_tokens: Any) -> list[int]:
    counts = _as_int_array("num_scheduled_tokens", num_scheduled_tokens)
    for r, c in enumerate(counts):
        if c < 0:
            raise ValueError(f"num_scheduled_tokens[{r}] must be >= 0, got {c}")
    return counts


# --------------------------------------------------------------------------------------------
# Whether to cut


def ubatch_cut_points(num_tokens_padded: int, num_ubatches: int) -> list[int]:
    """The N - 1 token positions where ubatches start: k * (num_tokens_padded // N), vLLM's
    default split points."""
    padded = _as_count("num_tokens_padded", num_tokens_padded)
    n = _as_num_ubatches(num_ubatches)
    return [k * (padded // n) for k in range(1, n)]


def _brief(values: Sequence[int], keep: int = 3) -> str:
    """A list for an error message, its middle elided when long, so the message stays
    readable for any ubatch count."""
    if len(values) <= 2 * keep + 1:
        return str(list(values))
    head = ", ".join(map(str, values[:keep]))
    tail = ", ".join(map(str, values[-keep:]))
    return f"[{head}, ... {len(values) - 2 * keep} more ..., {tail}]"


def is_last_ubatch_empty(orig_num_tokens: int, padded_num_tokens: int, num_ubatches: int) -> bool:
    """True when cutting `padded_num_tokens` into `num_ubatches` at multiples of
    padded // N leaves the last ubatch without any of the `orig_num_tokens` real tokens.

    The last ubatch empties first (its start (N - 1) * q is the largest). Unlike vLLM's
    formula this is also True when q == 0, where every ubatch but the last would be empty.
    """
    real = _as_count("orig_num_tokens", orig_num_tokens)
    padded = _as_count("padded_num_tokens", padded_num_tokens)
    n = _as_num_ubatches(num_ubatches)
    if padded < real:
        raise ValueError(f"padded_num_tokens ({padded}) is smaller than orig_num_tokens ({real})")
    width = padded // n
    return width == 0 or (n - 1) * width >= real


def check_ubatch_thresholds(config: Any, num_tokens: int, uniform_decode: bool) -> bool:
    """Whether a step of `num_tokens` is big enough to split: uniform-decode steps from
    `config.dbo_decode_token_threshold`, others from `config.dbo_prefill_token_threshold`;
    never when `config.use_ubatching` is False. `config` is a `DBOConfig`, a
    `UBatchThresholds` or a vLLM `ParallelConfig`."""
    tokens = _as_count("num_tokens", num_tokens)
    decode = _as_bool("uniform_decode", uniform_decode)
    try:
        enabled = config.use_ubatching
        threshold = (
            config.dbo_decode_token_threshold if decode else config.dbo_prefill_token_threshold
        )
    except AttributeError as exc:
        raise TypeError(
            f"config must have use_ubatching, dbo_decode_token_threshold and "
            f"dbo_prefill_token_threshold (a DBOConfig, UBatchThresholds or vLLM "
            f"ParallelConfig), got {type(config).__name__}: {exc}"
        ) from None
    return bool(enabled) and tokens >= threshold


def should_ubatch(
    num_tokens: int,
    is_decode_only: bool,
    num_ubatches: int,
    thresholds: UBatchThresholds | None = None,
    *,
    num_tokens_padded: int | None = None,
) -> bool:
    """`check_ubatch_thresholds` and not `is_last_ubatch_empty`, for one rank alone: what
    this rank proposes to the DP agreement.

    Kept beside vLLM's two names because every caller needs both checks together.

        >>> should_ubatch(32, True, 2), should_ubatch(511, False, 2)
        (True, False)
        >>> should_ubatch(600, False, 2, num_tokens_padded=1200)  # cut at 600: ubatch 1 empty
        False
    """
    if thresholds is None:
        thresholds = UBatchThresholds()
    elif not isinstance(thresholds, UBatchThresholds):
        raise TypeError(f"thresholds must be a UBatchThresholds, got {type(thresholds).__name__}")
    padded = num_tokens if num_tokens_padded is None else num_tokens_padded
    n = _as_num_ubatches(num_ubatches)
    decode = _as_bool("is_decode_only", is_decode_only)
    big_enough = check_ubatch_thresholds(thresholds, num_tokens, decode)
    empty = is_last_ubatch_empty(num_tokens, padded, n)
    return big_enough and not empty


# --------------------------------------------------------------------------------------------
# Where to cut


def _request_range(cu: list[int], start: int, end: int) -> slice:
    """vLLM's rule: from the request holding token `start` (skipping zero-token requests
    sitting at it) to the first request starting at or after `end`; positions past the real
    tokens count as the real end."""
    total = cu[-1]
    start, end = min(start, total), min(end, total)
    return slice(bisect.bisect_right(cu, start) - 1, bisect.bisect_left(cu, end))


def create_ubatch_slices(
    num_scheduled_tokens: Sequence[int] | np.ndarray | torch.Tensor,
    token_split_points: Sequence[int],
) -> UBatchSlices:
    """One slice per ubatch, cut at `token_split_points` (ascending); the last slice ends at
    the real token count (or is empty if its cut lies past it).

        >>> [s.token_slice for s in create_ubatch_slices([5, 4, 1], [3, 6])]
        [slice(0, 3, None), slice(3, 6, None), slice(6, 10, None)]
    """
    counts = _as_num_scheduled_tokens(num_scheduled_tokens)
    points = [_as_count(f"token_split_points[{i}]", p) for i, p in enumerate(token_split_points)]
    if any(b < a for a, b in pairwise(points)):
        raise ValueError(f"token_split_points must be non-decreasing, got {points}")
    cu = [0]
    for c in counts:
        cu.append(cu[-1] + c)
    ends = [*points, cu[-1]]
    slices = []
    start = 0
    for end in ends:
        slices.append(UBatchSlice(_request_range(cu, start, end), slice(start, end)))
        start = end
    if points and points[-1] > cu[-1]:  # the last ubatch has no real token: empty, not negative
        slices[-1] = UBatchSlice(slice(len(counts), len(counts)), slice(points[-1], points[-1]))
    return slices


def _pad_out_ubatch_slices(
    slices: UBatchSlices, num_tokens_padded: int, num_reqs_padded: int
) -> UBatchSlices:
    last = slices[-1]
    padded = UBatchSlice(
        slice(min(last.request_slice.start, num_reqs_padded), num_reqs_padded),
        slice(last.token_slice.start, num_tokens_padded),
    )
    return [*slices[:-1], padded]


def maybe_create_ubatch_slices(
    should_ubatch: bool,
    num_scheduled_tokens: Sequence[int] | np.ndarray | torch.Tensor,
    num_tokens_padded: int,
    num_reqs_padded: int,
    num_ubatches: int,
    split_point: Sequence[int] | int | None = None,
) -> tuple[UBatchSlices | None, UBatchSlices | None]:
    """(slices, padded slices) for a step the ranks agreed to split, (None, None) otherwise.

    Cuts at multiples of `split_point` (default num_tokens_padded // num_ubatches), or at
    the given list of points. The padded slices differ only in the last one, which runs to
    `num_tokens_padded` and takes the requests up to `num_reqs_padded`.
    """
    if not _as_bool("should_ubatch", should_ubatch):
        return None, None
    counts = _as_num_scheduled_tokens(num_scheduled_tokens)
    padded = _as_count("num_tokens_padded", num_tokens_padded)
    reqs_padded = _as_count("num_reqs_padded", num_reqs_padded)
    n = _as_num_ubatches(num_ubatches)
    if padded < sum(counts):
        raise ValueError(f"num_tokens_padded ({padded}) is below the {sum(counts)} tokens")
    if reqs_padded < len(counts):
        raise ValueError(f"num_reqs_padded ({reqs_padded}) is below the {len(counts)} requests")
    if split_point is None:
        points = ubatch_cut_points(padded, n)
    elif isinstance(split_point, Sequence):
        points = [_as_count("split_point", p) for p in split_point]
        if len(points) != n - 1:
            raise ValueError(f"split_point lists {len(points)} cuts; {n} ubatches need {n - 1}")
    else:
        q = _as_count("split_point", split_point)
        points = [k * q for k in range(1, n)]
    if points and points[-1] > padded:
        raise ValueError(f"split points {points} run past num_tokens_padded ({padded})")
    slices = create_ubatch_slices(counts, points)
    return slices, _pad_out_ubatch_slices(slices, padded, reqs_padded)


def split_batch(
    query_start_loc: Sequence[int] | np.ndarray | torch.Tensor,
    num_tokens_padded: int,
    num_ubatches: int,
) -> UBatchSlices:
    """`maybe_create_ubatch_slices` for a batch given by `query_start_loc`, refusing a split
    that would leave a ubatch with no real tokens (ValueError); the unpadded slices.

    Kept for the workloads in `scenarios/`, which hold `query_start_loc` rather than
    per-request counts.

        >>> [s.token_slice for s in split_batch([0, 5, 9, 10], 10, 3)]
        [slice(0, 3, None), slice(3, 6, None), slice(6, 10, None)]
    """
    qsl = _as_query_start_loc(query_start_loc)
    n = _as_num_ubatches(num_ubatches)
    padded = _as_count("num_tokens_padded", num_tokens_padded)
    real = qsl[-1]
    if padded < real:
        raise ValueError(
            f"num_tokens_padded ({padded}) is smaller than the real token count "
            f"query_start_loc[-1] ({real})"
        )
    if is_last_ubatch_empty(real, padded, n):
        raise ValueError(
            f"cannot split {real} real tokens (padded to {padded}) into {n} ubatches at "
            f"{_brief(ubatch_cut_points(padded, n))}: a ubatch would hold no real tokens; "
            "check is_last_ubatch_empty first"
        )
    counts = [b - a for a, b in pairwise(qsl)]
    slices, _ = maybe_create_ubatch_slices(True, counts, padded, len(counts), n)
    assert slices is not None
    return slices


# --------------------------------------------------------------------------------------------
# Attention metadata


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
    # A first token past the real ones is padding (a dummy run, a padded tail): no request
    # holds it. A real first token must lie in the slice's first request.
    if toks.start < cu[-1] and not cu[reqs.start] <= toks.start < cu[reqs.start + 1]:
        raise ValueError(
            f"ubatch slice {ubatch_slice} does not match the metadata: its first token "
            f"{toks.start} is not in its first request (tokens [{cu[reqs.start]}, "
            f"{cu[reqs.start + 1]}))"
        )


def _make_metadata_with_slice(
    ubatch_slice: UBatchSlice, attn_metadata: CommonAttentionMetadata
) -> CommonAttentionMetadata:
    """The metadata of one ubatch: its requests and tokens, a cut request trimmed."""
    cu = [int(v) for v in attn_metadata.query_start_loc_cpu.tolist()]
    _check_slice_against(ubatch_slice, attn_metadata, cu)
    reqs, toks = ubatch_slice.request_slice, ubatch_slice.token_slice
    first_req, last_req = reqs.start, reqs.stop - 1
    # Tokens of the first request that an earlier ubatch ran, and of the last request that a
    # later ubatch runs (0 unless the boundary cuts it; padding tokens past it are not cut).
    head_cut = toks.start - cu[first_req]
    tail_cut = max(0, cu[last_req + 1] - toks.stop)

    qsl_cpu = slice_query_start_locs(attn_metadata.query_start_loc_cpu, reqs).clone()
    qsl = slice_query_start_locs(attn_metadata.query_start_loc, reqs).clone()
    seq_lens = attn_metadata.seq_lens[reqs].clone()
    computed = attn_metadata.num_computed_tokens_cpu[reqs].clone()
    if head_cut:
        qsl_cpu[1:] -= head_cut
        qsl[1:] -= head_cut
        computed[0] += head_cut
    if tail_cut:
        qsl_cpu[-1] -= tail_cut
        qsl[-1] -= tail_cut
        seq_lens[-1] -= tail_cut
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
    )


def split_attn_metadata(
    ubatch_slices: Sequence[UBatchSlice], common_attn_metadata: CommonAttentionMetadata
) -> list[CommonAttentionMetadata]:
    """One metadata per slice (the input is not modified). Raises ValueError for an empty
    slice or one that does not match the metadata."""
    if not isinstance(common_attn_metadata, CommonAttentionMetadata):
        raise TypeError(
            f"common_attn_metadata must be a CommonAttentionMetadata, got "
            f"{type(common_attn_metadata).__name__}"
        )
    return [_make_metadata_with_slice(s, common_attn_metadata) for s in ubatch_slices]


# --------------------------------------------------------------------------------------------
# Agreement across data-parallel ranks


@dataclass(frozen=True)
class UBatchProposal:
    """What one data-parallel rank brings to the agreement. `num_tokens` is its real token
    count, `num_tokens_padded` what it would run at alone, `cudagraph_mode` the CUDA-graph
    mode it would run (0 = NONE, 1 = PIECEWISE, 2 = FULL, as in vLLM)."""

    rank: int
    should_split: bool
    num_tokens: int
    num_tokens_padded: int
    num_ubatches: int
    cudagraph_mode: int = 0

    def __post_init__(self) -> None:
        _as_count("rank", self.rank)
        _as_bool("should_split", self.should_split)
        _as_count("num_tokens", self.num_tokens)
        _as_count("num_tokens_padded", self.num_tokens_padded)
        _as_count("cudagraph_mode", self.cudagraph_mode)
        n = _as_count("num_ubatches", self.num_ubatches)
        if n < 1:
            raise ValueError(f"num_ubatches must be >= 1, got {n}")
        if self.should_split and n < 2:
            raise ValueError(f"num_ubatches must be >= 2 to split, got {n}")
        if self.num_tokens_padded < self.num_tokens:
            raise ValueError(
                f"num_tokens_padded ({self.num_tokens_padded}) is smaller than num_tokens "
                f"({self.num_tokens})"
            )


@dataclass(frozen=True)
class UBatchDecision:
    """The agreed outcome, the same on every rank.

    `num_tokens_padded` is the largest padded count across ranks (where a split cuts).
    `num_tokens_across_dp[r]` is what rank r runs: that maximum for every rank when
    `dp_padded` (split, or an agreed CUDA-graph mode other than NONE), else rank r's own
    padded count. `cudagraph_mode` is the minimum over ranks. `per_rank[r]` is rank r's
    proposal (group ranks). `reason` says why the step does not split ("" when it does).
    """

    split: bool
    num_tokens_padded: int
    num_ubatches: int
    per_rank: tuple[UBatchProposal, ...]
    reason: str = ""
    cudagraph_mode: int = 0
    num_tokens_across_dp: tuple[int, ...] = ()
    dp_padded: bool = False


def decide_ubatching(proposals: Sequence[UBatchProposal]) -> UBatchDecision:
    """The decision every rank takes from the same list of proposals (index = group rank).

    Raises UBatchAgreementError, naming each rank's count, if the ubatch counts differ.
    Splits only if every rank proposes to and, padded to the largest padded count, the
    rank with the fewest real tokens still fills its last ubatch.
    """
    proposals = tuple(proposals)
    if not proposals:
        raise ValueError("proposals must not be empty")
    counts = [p.num_ubatches for p in proposals]
    if len(set(counts)) > 1:
        listing = ", ".join(f"rank {p.rank}: {p.num_ubatches}" for p in proposals)
        raise UBatchAgreementError(f"DP ranks asked for different ubatch counts ({listing})")
    n = counts[0]
    padded = max(p.num_tokens_padded for p in proposals)
    mode = min(p.cudagraph_mode for p in proposals)
    refusing = [p.rank for p in proposals if not p.should_split]
    if refusing:
        reason = f"rank(s) {refusing} cannot split"
    else:
        fewest = min(proposals, key=lambda p: p.num_tokens)
        reason = ""
        if is_last_ubatch_empty(fewest.num_tokens, padded, n):
            reason = (
                f"rank {fewest.rank}'s {fewest.num_tokens} real tokens, padded to {padded}, "
                f"would leave its last of {n} ubatches empty"
            )
    split = not reason
    dp_padded = split or mode != 0
    across = tuple(padded if dp_padded else p.num_tokens_padded for p in proposals)
    return UBatchDecision(
        split=split,
        num_tokens_padded=padded,
        num_ubatches=n,
        per_rank=proposals,
        reason=reason,
        cudagraph_mode=mode,
        num_tokens_across_dp=across,
        dp_padded=dp_padded,
    )


# One int64 row per rank on the wire: ok flag, then the proposal's fields.
_WIRE_FIELDS = 6


def _exchange_device(group: Any) -> torch.device:
    """Where the exchanged rows live: CPU for gloo (and MPI), this rank's GPU for NCCL.

    Every member sees the same backend, so a refusal here is identical on all ranks.
    """
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    if "gloo" in backend or backend == "mpi":
        return torch.device("cpu")
    raise ValueError(
        f"group uses backend {backend!r}; the agreement runs over gloo (CPU tensors) or NCCL "
        f"(this rank's current GPU): pass such a group"
    )


def coordinate_ubatching(
    should_split: bool,
    num_tokens_padded: int,
    num_ubatches: int,
    group: Any = None,
    *,
    num_tokens: int | None = None,
    cudagraph_mode: int = 0,
) -> UBatchDecision:
    """Agree across the ranks of `group` (default: the world) on whether and how to split.

    Every rank calls it once per step with its own view; one all_gather of a small int64
    tensor (on the CPU over gloo, on the current GPU over NCCL) then gives every rank the same
    inputs and so the same `UBatchDecision`. `num_tokens` is this rank's real token count
    (default: `num_tokens_padded`). With no process group, or a group of one, no
    communication happens.

    Errors are raised on every rank: different ubatch counts give each rank the same
    UBatchAgreementError; a rank with bad arguments raises its own ValueError/TypeError while
    its peers raise UBatchAgreementError naming it.

        decision = coordinate_ubatching(should_ubatch(n, decode, 2, num_tokens_padded=p),
                                        p, 2, group=dp_cpu_group, num_tokens=n)
        if decision.split:
            slices = split_batch(query_start_loc, decision.num_tokens_padded, 2)
    """
    real = num_tokens_padded if num_tokens is None else num_tokens
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if distributed else 1
    if world <= 1:
        local = UBatchProposal(
            0, should_split, real, num_tokens_padded, num_ubatches, cudagraph_mode
        )
        return decide_ubatching([local])

    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of group")
    device = _exchange_device(group)

    # Bad arguments still travel (flagged) so no peer is left waiting in the all_gather.
    local_error: Exception | None = None
    try:
        local = UBatchProposal(
            rank, should_split, real, num_tokens_padded, num_ubatches, cudagraph_mode
        )
        row = [
            1,
            int(local.should_split),
            local.num_tokens,
            local.num_tokens_padded,
            local.num_ubatches,
            local.cudagraph_mode,
        ]
    except (TypeError, ValueError) as exc:
        local_error = exc
        row = [0] * _WIRE_FIELDS

    mine = torch.tensor(row, dtype=torch.int64, device=device)
    rows = [torch.empty(_WIRE_FIELDS, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    table = torch.stack(rows).cpu().tolist()  # one device-to-host copy for every row

    if local_error is not None:
        raise local_error
    bad = [r for r, values in enumerate(table) if values[0] == 0]
    if bad:
        raise UBatchAgreementError(
            f"rank(s) {bad} passed invalid arguments to coordinate_ubatching (see the error "
            f"raised there)"
        )
    proposals = [UBatchProposal(r, bool(v[1]), v[2], v[3], v[4], v[5]) for r, v in enumerate(table)]
    return decide_ubatching(proposals)


def coordinate_batch_across_dp(
    num_tokens_unpadded: int,
    allow_microbatching: bool,
    parallel_config: Any,
    num_tokens_padded: int | None = None,
    uniform_decode: bool | None = None,
    cudagraph_mode: int = 0,
    group: Any = None,
) -> tuple[bool, torch.Tensor | None, int]:
    """vLLM's entry point: (should_ubatch, num_tokens_after_padding, synced_cudagraph_mode).

    `num_tokens_after_padding` is an int32 CPU tensor of every DP rank's token count after
    padding (None without DP); `synced_cudagraph_mode` the minimum over ranks. This rank
    proposes to split when `allow_microbatching` and `check_ubatch_thresholds` pass.
    `parallel_config` supplies `num_ubatches` and the thresholds (a `DBOConfig` or a vLLM
    `ParallelConfig`); the DP group is `group` (default: the world) rather than vLLM's
    global one.
    """
    allow = _as_bool("allow_microbatching", allow_microbatching)
    unpadded = _as_count("num_tokens_unpadded", num_tokens_unpadded)
    padded = unpadded if num_tokens_padded is None else num_tokens_padded
    try:
        num_ubatches = parallel_config.num_ubatches
    except AttributeError:
        raise TypeError(
            f"parallel_config must have num_ubatches and the dbo thresholds (a DBOConfig or "
            f"vLLM ParallelConfig), got {type(parallel_config).__name__}"
        ) from None
    attempt = False
    if allow:
        if uniform_decode is None:
            raise ValueError("uniform_decode is required when allow_microbatching is True")
        attempt = check_ubatch_thresholds(parallel_config, unpadded, uniform_decode)
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed or dist.get_world_size(group) <= 1:
        return False, None, _as_count("cudagraph_mode", cudagraph_mode)
    decision = coordinate_ubatching(
        attempt, padded, num_ubatches, group, num_tokens=unpadded, cudagraph_mode=cudagraph_mode
    )
    across = torch.tensor(decision.num_tokens_across_dp, dtype=torch.int32)
    return decision.split, across, decision.cudagraph_mode
