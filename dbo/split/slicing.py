"""Where to cut a step into ubatches, and whether to (vLLM's `maybe_create_ubatch_slices`,
`check_ubatch_thresholds`, `is_last_ubatch_empty`; `slices_at_split_points` is the cut itself,
named apart from vLLM V2's `create_ubatch_slices(input_batch, num_ubatches)`).

The split point is q = num_tokens_padded // N and cut k falls at k * q. A ubatch holds the
requests whose tokens overlap its range: it starts at the request holding its first token and
stops before the first request starting at or after its end, so a request the cut passes
through is in both neighbours. The unpadded last slice ends at the real token count; the
padded one runs to `num_tokens_padded` and takes the padding requests up to `num_reqs_padded`.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import numpy as np
import torch

from dbo.split.checks import (
    as_bool,
    as_count,
    as_num_scheduled_tokens,
    as_num_ubatches,
    as_query_start_loc,
    brief,
)
from dbo.split.records import UBatchSlice, UBatchSlices, UBatchThresholds

__all__ = [
    "check_ubatch_thresholds",
    "slices_at_split_points",
    "is_last_ubatch_empty",
    "maybe_create_ubatch_slices",
    "should_ubatch",
    "split_batch",
    "ubatch_cut_points",
]


def ubatch_cut_points(num_tokens_padded: int, num_ubatches: int) -> list[int]:
    """The N - 1 token positions where ubatches start: k * (num_tokens_padded // N), vLLM's
    default split points."""
    padded = as_count("num_tokens_padded", num_tokens_padded)
    n = as_num_ubatches(num_ubatches)
    return [k * (padded // n) for k in range(1, n)]


def is_last_ubatch_empty(orig_num_tokens: int, padded_num_tokens: int, num_ubatches: int) -> bool:
    """True when cutting `padded_num_tokens` into `num_ubatches` at multiples of
    padded // N leaves the last ubatch without any of the `orig_num_tokens` real tokens.

    The last ubatch empties first (its start (N - 1) * q is the largest). Unlike vLLM's
    formula this is also True when q == 0, where every ubatch but the last would be empty.
    """
    real = as_count("orig_num_tokens", orig_num_tokens)
    padded = as_count("padded_num_tokens", padded_num_tokens)
    n = as_num_ubatches(num_ubatches)
    if padded < real:
        raise ValueError(f"padded_num_tokens ({padded}) is smaller than orig_num_tokens ({real})")
    width = padded // n
    return width == 0 or (n - 1) * width >= real


def check_ubatch_thresholds(config: Any, num_tokens: int, uniform_decode: bool) -> bool:
    """Whether a step of `num_tokens` is big enough to split: uniform-decode steps from
    `config.dbo_decode_token_threshold`, others from `config.dbo_prefill_token_threshold`;
    never when `config.use_ubatching` is False. `config` is a `DBOConfig`, a
    `UBatchThresholds` or a vLLM `ParallelConfig`. A config that splits (`use_ubatching`,
    `num_ubatches` >= 2) with a threshold below its ubatch count is refused (ValueError): a
    step that small would leave a ubatch empty."""
    tokens = as_count("num_tokens", num_tokens)
    decode = as_bool("uniform_decode", uniform_decode)
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
    n = getattr(config, "num_ubatches", 0)
    if enabled and isinstance(n, int) and n >= 2 and threshold < n:
        kind = "decode" if decode else "prefill"
        raise ValueError(
            f"dbo_{kind}_token_threshold ({threshold}) is below num_ubatches ({n}): a step of "
            f"fewer tokens than ubatches leaves a ubatch empty; use a threshold >= {n}"
        )
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
    n = as_num_ubatches(num_ubatches)
    decode = as_bool("is_decode_only", is_decode_only)
    big_enough = check_ubatch_thresholds(thresholds, num_tokens, decode)
    empty = is_last_ubatch_empty(num_tokens, padded, n)
    return big_enough and not empty


def _request_range(cu: list[int], start: int, end: int) -> slice:
    """vLLM's rule: from the request holding token `start` (skipping zero-token requests
    sitting at it) to the first request starting at or after `end`; positions past the real
    tokens count as the real end."""
    total = cu[-1]
    start, end = min(start, total), min(end, total)
    return slice(bisect.bisect_right(cu, start) - 1, bisect.bisect_left(cu, end))


def slices_at_split_points(
    num_scheduled_tokens: Sequence[int] | np.ndarray | torch.Tensor,
    token_split_points: Sequence[int],
) -> UBatchSlices:
    """One slice per ubatch, cut at `token_split_points` (ascending); the last slice ends at
    the real token count (or is empty if its cut lies past it).

        >>> [s.token_slice for s in slices_at_split_points([5, 4, 1], [3, 6])]
        [slice(0, 3, None), slice(3, 6, None), slice(6, 10, None)]
    """
    counts = as_num_scheduled_tokens(num_scheduled_tokens)
    points = [as_count(f"token_split_points[{i}]", p) for i, p in enumerate(token_split_points)]
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


def _split_points(split_point: Sequence[int] | int | None, padded: int, n: int) -> list[int]:
    if split_point is None:
        return ubatch_cut_points(padded, n)
    if isinstance(split_point, Sequence):
        points = [as_count("split_point", p) for p in split_point]
        if len(points) != n - 1:
            raise ValueError(f"split_point lists {len(points)} cuts; {n} ubatches need {n - 1}")
        return points
    q = as_count("split_point", split_point)
    return [k * q for k in range(1, n)]


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
    `num_tokens_padded` and takes the requests up to `num_reqs_padded`. With DBO not
    configured (`num_ubatches` 0 or 1, what vLLM's `ParallelConfig.num_ubatches` is then)
    there is nothing to cut: (None, None), as for a step that does not split.
    """
    wants = as_bool("should_ubatch", should_ubatch)
    if not wants or as_count("num_ubatches", num_ubatches) < 2:
        return None, None
    counts = as_num_scheduled_tokens(num_scheduled_tokens)
    padded = as_count("num_tokens_padded", num_tokens_padded)
    reqs_padded = as_count("num_reqs_padded", num_reqs_padded)
    n = as_num_ubatches(num_ubatches)
    if padded < sum(counts):
        raise ValueError(f"num_tokens_padded ({padded}) is below the {sum(counts)} tokens")
    if reqs_padded < len(counts):
        raise ValueError(f"num_reqs_padded ({reqs_padded}) is below the {len(counts)} requests")
    points = _split_points(split_point, padded, n)
    if points and points[-1] > padded:
        raise ValueError(f"split points {points} run past num_tokens_padded ({padded})")
    slices = slices_at_split_points(counts, points)
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
    qsl = as_query_start_loc(query_start_loc)
    n = as_num_ubatches(num_ubatches)
    padded = as_count("num_tokens_padded", num_tokens_padded)
    real = qsl[-1]
    if padded < real:
        raise ValueError(
            f"num_tokens_padded ({padded}) is smaller than the real token count "
            f"query_start_loc[-1] ({real})"
        )
    if is_last_ubatch_empty(real, padded, n):
        raise ValueError(
            f"cannot split {real} real tokens (padded to {padded}) into {n} ubatches at "
            f"{brief(ubatch_cut_points(padded, n))}: a ubatch would hold no real tokens; "
            "check is_last_ubatch_empty first"
        )
    counts = [b - a for a, b in pairwise(qsl)]
    slices, _ = maybe_create_ubatch_slices(True, counts, padded, len(counts), n)
    assert slices is not None
    return slices
