"""Splitting one step's batch into N ubatches: where to cut, whether to, and agreeing across DP.

A step's scheduled tokens are laid out request after request; `query_start_loc` (length
num_requests + 1, starting at 0) gives where each request's tokens start. The batch may be
padded (for CUDA graphs, or to match other data-parallel ranks) to `num_tokens_padded`.

Cutting. With q = num_tokens_padded // N, cut k falls at token k * q; ubatch k owns tokens
[k * q, (k + 1) * q) and the last one owns the remainder, so uneven splits give the last ubatch
the extra tokens. Padding tokens belong to no request: the last ubatch's real tokens end at the
real token count. A request that a cut passes through appears in both ubatches, each with only
its own part of that request's tokens, and every ubatch's `query_start_loc` is rebased to 0.

    >>> qsl = [0, 3, 10, 12]            # three requests of 3, 7 and 2 tokens
    >>> a, b = split_batch(qsl, num_tokens_padded=16, num_ubatches=2)
    >>> a.token_slice, a.request_slice  # cut at 16 // 2 = 8 passes through request 1
    (slice(0, 8, None), slice(0, 2, None))
    >>> b.token_slice, b.request_slice  # ends at the 12 real tokens, not at 16
    (slice(8, 12, None), slice(1, 3, None))
    >>> slice_query_start_loc(qsl, a).tolist(), slice_query_start_loc(qsl, b).tolist()
    ([0, 3, 8], [0, 2, 4])

Deciding. `should_ubatch` applies the size thresholds (decode-only steps from 32 tokens,
prefill or mixed steps from 512) and refuses any split that would leave a ubatch with no real
tokens. Agreeing. `coordinate_ubatching` makes every data-parallel rank take the same decision
with one all_gather: split only if every rank can, all padded to the largest padded count.

Decisions where vLLM's reference leaves room:
- zero-token requests (padding requests at the end of `query_start_loc`) go to the ubatch whose
  half-open token range contains their position; those at the real end go to the last ubatch;
- `split_batch` refuses (ValueError) a split with an empty ubatch instead of returning one;
- the agreement also exchanges real token counts and refuses a split whose padding to the
  cross-rank maximum would leave some rank's last ubatch empty (vLLM's `_post_process_ubatch`);
- a rank's bad arguments still take part in the exchange (flagged), so its peers raise
  `UBatchAgreementError` instead of waiting forever in the collective.
"""

from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import numpy as np

from dbo._checks import as_int
import torch
import torch.distributed as dist

__all__ = [
    "UBatchSlice",
    "UBatchBatch",
    "UBatchThresholds",
    "UBatchProposal",
    "UBatchDecision",
    "UBatchAgreementError",
    "ubatch_cut_points",
    "has_empty_ubatch",
    "should_ubatch",
    "split_batch",
    "slice_query_start_loc",
    "make_ubatch_batches",
    "decide_ubatching",
    "coordinate_ubatching",
]


class UBatchAgreementError(ValueError):
    """The data-parallel ranks cannot agree on ubatching (different ubatch counts, or a rank
    passed bad arguments). Raised on every rank of the group, with the same message."""


# --------------------------------------------------------------------------------------------
# Records


@dataclass(frozen=True)
class UBatchSlice:
    """The requests and tokens of one ubatch, as half-open slices of the step's batch.

    `token_slice` holds only real tokens (never padding). `request_slice` holds every request
    with tokens in `token_slice`; a request cut by a ubatch boundary is in both neighbours.
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
        return self.num_tokens == 0 or self.num_requests == 0


# eq=False: a tensor field makes field-wise == ambiguous, so records compare by identity.
@dataclass(frozen=True, eq=False)
class UBatchBatch:
    """One ubatch as a model runs it.

    `query_start_loc` is rebased to this ubatch (starts at 0, ends at `num_tokens`), one entry
    per request in `request_ids` plus one. `num_tokens_padded` is the size the ubatch runs at:
    the cut width q for all but the last ubatch, which also takes the padding tail.
    """

    ubatch_id: int
    ubatch_slice: UBatchSlice
    query_start_loc: torch.Tensor
    num_tokens: int
    num_tokens_padded: int
    request_ids: tuple[Hashable, ...]


@dataclass(frozen=True)
class UBatchThresholds:
    """The smallest steps worth splitting: below these the overlap gains less than the split
    costs (a decode step of a few tokens is launch-bound, not communication-bound)."""

    decode_min_tokens: int = 32
    prefill_min_tokens: int = 512

    def __post_init__(self) -> None:
        _as_count("decode_min_tokens", self.decode_min_tokens)
        _as_count("prefill_min_tokens", self.prefill_min_tokens)

    def min_tokens(self, is_decode_only: bool) -> int:
        return self.decode_min_tokens if is_decode_only else self.prefill_min_tokens


@dataclass(frozen=True)
class UBatchProposal:
    """What one data-parallel rank brings to the agreement. `num_tokens` is its real token
    count, `num_tokens_padded` what it would run at alone."""

    rank: int
    should_split: bool
    num_tokens: int
    num_tokens_padded: int
    num_ubatches: int

    def __post_init__(self) -> None:
        _as_count("rank", self.rank)
        _as_bool("should_split", self.should_split)
        _as_count("num_tokens", self.num_tokens)
        _as_count("num_tokens_padded", self.num_tokens_padded)
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

    `num_tokens_padded` is the largest padded count across ranks whether or not the step
    splits: DP ranks run collectives of one shape. `per_rank[r]` is rank r's proposal (group
    ranks). `reason` says why the step does not split ("" when it does).
    """

    split: bool
    num_tokens_padded: int
    num_ubatches: int
    per_rank: tuple[UBatchProposal, ...]
    reason: str = ""


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


def _as_query_start_loc(query_start_loc: Any) -> list[int]:
    """Validated prefix sums as Python ints (one host copy, so a device tensor syncs once)."""
    name = "query_start_loc"
    if isinstance(query_start_loc, torch.Tensor):
        if query_start_loc.is_floating_point() or query_start_loc.is_complex() or (
            query_start_loc.dtype == torch.bool
        ):
            raise TypeError(f"{name} must hold integers, got dtype {query_start_loc.dtype}")
        arr = query_start_loc.detach().cpu().numpy()
    else:
        arr = np.asarray(query_start_loc)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(arr.shape)}")
    if arr.size == 0:
        raise ValueError(f"{name} must have at least one entry (num_requests + 1), got none")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    values = [int(v) for v in arr.tolist()]
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    for i in range(len(values) - 1):
        if values[i + 1] < values[i]:
            raise ValueError(
                f"{name} must be non-decreasing, but entry {i + 1} ({values[i + 1]}) is "
                f"less than entry {i} ({values[i]})"
            )
    return values


# --------------------------------------------------------------------------------------------
# Where to cut, and whether to


def ubatch_cut_points(num_tokens_padded: int, num_ubatches: int) -> list[int]:
    """The N - 1 token positions where ubatches start: k * (num_tokens_padded // N)."""
    padded = _as_count("num_tokens_padded", num_tokens_padded)
    n = _as_num_ubatches(num_ubatches)
    width = padded // n
    return [k * width for k in range(1, n)]


def _brief(values: Sequence[int], keep: int = 3) -> str:
    """A list for an error message, its middle elided when long, so the message stays
    readable for any ubatch count."""
    if len(values) <= 2 * keep + 1:
        return str(list(values))
    head = ", ".join(map(str, values[:keep]))
    tail = ", ".join(map(str, values[-keep:]))
    return f"[{head}, ... {len(values) - 2 * keep} more ..., {tail}]"


def has_empty_ubatch(num_tokens: int, num_tokens_padded: int, num_ubatches: int) -> bool:
    """True when cutting at the padded positions leaves some ubatch without real tokens.

    The last ubatch empties first (its start (N - 1) * q is the largest), so this is
    `q == 0 or num_tokens <= (N - 1) * q` with q = num_tokens_padded // N. It covers
    num_tokens < N too.
    """
    real = _as_count("num_tokens", num_tokens)
    padded = _as_count("num_tokens_padded", num_tokens_padded)
    n = _as_num_ubatches(num_ubatches)
    if padded < real:
        raise ValueError(
            f"num_tokens_padded ({padded}) is smaller than num_tokens ({real})"
        )
    width = padded // n
    return width == 0 or real <= (n - 1) * width


def should_ubatch(
    num_tokens: int,
    is_decode_only: bool,
    num_ubatches: int,
    thresholds: UBatchThresholds | None = None,
    *,
    num_tokens_padded: int | None = None,
) -> bool:
    """Whether this rank's step is worth splitting and can be split without an empty ubatch.

    `num_tokens` is the real (unpadded) count the thresholds apply to; `num_tokens_padded`
    (default: `num_tokens`) is where the cuts are placed from.

        >>> should_ubatch(32, True, 2), should_ubatch(511, False, 2)
        (True, False)
        >>> should_ubatch(600, False, 2, num_tokens_padded=1200)  # cut at 600: ubatch 1 empty
        False
    """
    real = _as_count("num_tokens", num_tokens)
    decode_only = _as_bool("is_decode_only", is_decode_only)
    n = _as_num_ubatches(num_ubatches)
    if thresholds is None:
        thresholds = UBatchThresholds()
    elif not isinstance(thresholds, UBatchThresholds):
        raise TypeError(
            f"thresholds must be a UBatchThresholds, got {type(thresholds).__name__}"
        )
    padded = real if num_tokens_padded is None else num_tokens_padded
    if real < thresholds.min_tokens(decode_only):
        return False
    return not has_empty_ubatch(real, padded, n)


# --------------------------------------------------------------------------------------------
# Slicing


def _first_request_at(qsl: list[int], position: int) -> int:
    """The first request not entirely before `position`: the one holding that token, or a
    zero-token request sitting exactly at it."""
    left = bisect.bisect_left(qsl, position)
    return left if qsl[left] == position else left - 1


def split_batch(
    query_start_loc: Sequence[int] | np.ndarray | torch.Tensor,
    num_tokens_padded: int,
    num_ubatches: int,
) -> list[UBatchSlice]:
    """Cut a batch into `num_ubatches` slices at k * (num_tokens_padded // num_ubatches).

    The real token count is `query_start_loc[-1]`; the last slice ends there (padding is
    nobody's). Raises ValueError if any slice would hold no real tokens: check
    `should_ubatch` (or the agreed `UBatchDecision.split`) first.

        >>> [s.token_slice for s in split_batch([0, 5, 9, 10], 10, 3)]
        [slice(0, 3, None), slice(3, 6, None), slice(6, 10, None)]
    """
    qsl = _as_query_start_loc(query_start_loc)
    real = qsl[-1]
    n = _as_num_ubatches(num_ubatches)
    padded = _as_count("num_tokens_padded", num_tokens_padded)
    if padded < real:
        raise ValueError(
            f"num_tokens_padded ({padded}) is smaller than the real token count "
            f"query_start_loc[-1] ({real})"
        )
    cuts = ubatch_cut_points(padded, n)
    if has_empty_ubatch(real, padded, n):
        raise ValueError(
            f"cannot split {real} real tokens (padded to {padded}) into {n} ubatches at "
            f"{_brief(cuts)}: a ubatch would hold no real tokens; check should_ubatch first"
        )
    bounds = [0, *cuts, real]
    num_requests = len(qsl) - 1
    slices = []
    for k in range(n):
        start, stop = bounds[k], bounds[k + 1]
        req_start = _first_request_at(qsl, start)
        # Requests starting before `stop`; the last ubatch also keeps zero-token requests
        # sitting at the real end (padding requests).
        req_stop = num_requests if k == n - 1 else bisect.bisect_left(qsl, stop)
        slices.append(UBatchSlice(slice(req_start, req_stop), slice(start, stop)))
    return slices


def slice_query_start_loc(
    query_start_loc: Sequence[int] | np.ndarray | torch.Tensor, ubatch_slice: UBatchSlice
) -> torch.Tensor:
    """`query_start_loc` of one ubatch: its requests' starts, clipped to its tokens and rebased.

    A request cut at the ubatch's start begins at 0; one cut at its end stops at
    `ubatch_slice.num_tokens`. A tensor input keeps its dtype and device; a sequence gives
    an int32 CPU tensor (the dtype attention metadata uses).

        >>> s = UBatchSlice(request_slice=slice(1, 3), token_slice=slice(8, 12))
        >>> slice_query_start_loc([0, 3, 10, 12], s).tolist()
        [0, 2, 4]
    """
    qsl = _as_query_start_loc(query_start_loc)
    if not isinstance(ubatch_slice, UBatchSlice):
        raise TypeError(f"ubatch_slice must be a UBatchSlice, got {type(ubatch_slice).__name__}")
    reqs, toks = ubatch_slice.request_slice, ubatch_slice.token_slice
    num_requests = len(qsl) - 1
    bounds = (reqs.start, reqs.stop, toks.start, toks.stop)
    if reqs.step not in (None, 1) or toks.step not in (None, 1) or None in bounds:
        raise ValueError(
            f"ubatch_slice must use contiguous slices with explicit bounds, got {ubatch_slice}"
        )
    if not 0 <= reqs.start <= reqs.stop <= num_requests:
        raise ValueError(
            f"ubatch_slice.request_slice {reqs} is outside the {num_requests} requests"
        )
    if not 0 <= toks.start <= toks.stop <= qsl[-1]:
        raise ValueError(f"ubatch_slice.token_slice {toks} is outside the {qsl[-1]} tokens")
    covered = qsl[reqs.start] <= toks.start and toks.stop <= qsl[reqs.stop]
    if reqs.stop > reqs.start and not covered:
        raise ValueError(
            f"ubatch_slice {ubatch_slice} does not match query_start_loc: its requests hold "
            f"tokens [{qsl[reqs.start]}, {qsl[reqs.stop]})"
        )
    if isinstance(query_start_loc, torch.Tensor):
        source = query_start_loc
    elif isinstance(query_start_loc, np.ndarray):
        # A copy: from_numpy shares memory and warns on a read-only array.
        source = torch.from_numpy(np.array(query_start_loc))
    else:
        source = torch.tensor(qsl, dtype=torch.int32)
    part = source[reqs.start : reqs.stop + 1]
    return part.clamp(toks.start, toks.stop) - toks.start


def make_ubatch_batches(
    query_start_loc: Sequence[int] | np.ndarray | torch.Tensor,
    num_tokens_padded: int,
    num_ubatches: int,
    request_ids: Sequence[Hashable] | None = None,
) -> list[UBatchBatch]:
    """`split_batch` plus each ubatch's rebased `query_start_loc`, ids and padded size.

    `request_ids` (default: request indices) names the batch's requests in order.

        >>> a, b = make_ubatch_batches([0, 3, 10, 12], 16, 2, request_ids=["x", "y", "z"])
        >>> a.request_ids, a.query_start_loc.tolist(), a.num_tokens, a.num_tokens_padded
        (('x', 'y'), [0, 3, 8], 8, 8)
        >>> b.request_ids, b.query_start_loc.tolist(), b.num_tokens, b.num_tokens_padded
        (('y', 'z'), [0, 2, 4], 4, 8)
    """
    slices = split_batch(query_start_loc, num_tokens_padded, num_ubatches)
    num_requests = slices[-1].request_slice.stop
    if request_ids is None:
        ids: tuple[Hashable, ...] = tuple(range(num_requests))
    else:
        ids = tuple(request_ids)
        if len(ids) != num_requests:
            raise ValueError(
                f"request_ids has {len(ids)} entries but query_start_loc describes "
                f"{num_requests} requests"
            )
    padded = operator.index(num_tokens_padded)
    width = padded // len(slices)
    batches = []
    for k, s in enumerate(slices):
        last = k == len(slices) - 1
        batches.append(
            UBatchBatch(
                ubatch_id=k,
                ubatch_slice=s,
                query_start_loc=slice_query_start_loc(query_start_loc, s),
                num_tokens=s.num_tokens,
                num_tokens_padded=padded - k * width if last else width,
                request_ids=ids[s.request_slice],
            )
        )
    return batches


# --------------------------------------------------------------------------------------------
# Agreement across data-parallel ranks


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
    refusing = [p.rank for p in proposals if not p.should_split]
    if refusing:
        reason = f"rank(s) {refusing} cannot split"
    else:
        fewest = min(proposals, key=lambda p: p.num_tokens)
        reason = ""
        if has_empty_ubatch(fewest.num_tokens, padded, n):
            reason = (
                f"rank {fewest.rank}'s {fewest.num_tokens} real tokens, padded to {padded}, "
                f"would leave its last of {n} ubatches empty"
            )
    return UBatchDecision(
        split=not reason, num_tokens_padded=padded, num_ubatches=n, per_rank=proposals,
        reason=reason,
    )


# One int64 row per rank on the wire: ok flag, then the proposal's fields.
_WIRE_FIELDS = 5


def coordinate_ubatching(
    should_split: bool,
    num_tokens_padded: int,
    num_ubatches: int,
    group: Any = None,
    *,
    num_tokens: int | None = None,
) -> UBatchDecision:
    """Agree across the ranks of `group` (default: the world) on whether and how to split.

    Every rank calls it once per step with its own view; one all_gather of a small CPU int64
    tensor then gives every rank the same inputs and so the same `UBatchDecision`. The group
    must carry CPU tensors (gloo): make one with `dist.new_group(backend="gloo")` if the DP
    group is NCCL. `num_tokens` is this rank's real token count (default:
    `num_tokens_padded`); it lets the agreement see a rank whose last ubatch the padding would
    empty. With no process group, or a group of one, no communication happens.

    Errors are raised on every rank: different ubatch counts give each rank the same
    UBatchAgreementError; a rank with bad arguments raises its own ValueError/TypeError while
    its peers raise UBatchAgreementError naming it.

        decision = coordinate_ubatching(should_ubatch(n, decode, 2, num_tokens_padded=p),
                                        p, 2, group=dp_cpu_group, num_tokens=n)
        if decision.split:
            slices = split_batch(query_start_loc, decision.num_tokens_padded, 2)
    """
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if distributed else 1
    if world <= 1:
        rank = 0
        local = UBatchProposal(
            rank, should_split, num_tokens_padded if num_tokens is None else num_tokens,
            num_tokens_padded, num_ubatches,
        )
        return decide_ubatching([local])

    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of group")
    backend = str(dist.get_backend(group))
    # Every member sees the same backend, so this refusal is identical on all ranks.
    if "gloo" not in backend and backend != "mpi":
        raise ValueError(
            f"group uses backend {backend!r}, which cannot all_gather CPU tensors; pass a gloo "
            f"group (dist.new_group(ranks, backend='gloo'))"
        )

    # Bad arguments still travel (flagged) so no peer is left waiting in the all_gather.
    local_error: Exception | None = None
    try:
        local = UBatchProposal(
            rank, should_split, num_tokens_padded if num_tokens is None else num_tokens,
            num_tokens_padded, num_ubatches,
        )
        row = [1, int(local.should_split), local.num_tokens, local.num_tokens_padded,
               local.num_ubatches]
    except (TypeError, ValueError) as exc:
        local_error = exc
        row = [0] * _WIRE_FIELDS

    mine = torch.tensor(row, dtype=torch.int64)
    rows = [torch.empty(_WIRE_FIELDS, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    table = [r.tolist() for r in rows]

    if local_error is not None:
        raise local_error
    bad = [r for r, values in enumerate(table) if values[0] == 0]
    if bad:
        raise UBatchAgreementError(
            f"rank(s) {bad} passed invalid arguments to coordinate_ubatching (see the error "
            f"raised there)"
        )
    proposals = [
        UBatchProposal(r, bool(v[1]), v[2], v[3], v[4]) for r, v in enumerate(table)
    ]
    return decide_ubatching(proposals)
