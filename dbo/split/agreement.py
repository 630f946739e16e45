"""Agreeing on a split across data-parallel ranks (vLLM's `coordinate_batch_across_dp`).

Every DP rank must take the same decision, with one collective, by vLLM's rules: split only if
every rank can and the rank with the fewest real tokens, padded to the largest count, still
fills its last ubatch; the CUDA-graph mode is the minimum over ranks; every rank is padded to
the largest count when the agreed mode is not NONE or the step is split, and otherwise runs
its own count. `coordinate_ubatching` is the same exchange with a richer answer
(`UBatchDecision`). Unlike vLLM, the exchange also compares ubatch counts across ranks
(UBatchAgreementError naming each) and flags a rank's bad arguments, so its peers raise
instead of hanging; a rank's `cudagraph_mode` travels as an int (0 = NONE), as in vLLM's
all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dbo.fingerprint import collective_kind
from dbo.split.checks import as_bool, as_count
from dbo.split.slicing import check_ubatch_thresholds, is_last_ubatch_empty

__all__ = [
    "UBatchAgreementError",
    "UBatchDecision",
    "UBatchProposal",
    "check_dp_padding",
    "coordinate_batch_across_dp",
    "coordinate_ubatching",
    "decide_ubatching",
    "exchange_device",
]


class UBatchAgreementError(ValueError):
    """The data-parallel ranks cannot agree on ubatching (different ubatch counts, or a rank
    passed bad arguments). Raised on every rank of the group, with the same message."""


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
        as_count("rank", self.rank)
        as_bool("should_split", self.should_split)
        as_count("num_tokens", self.num_tokens)
        as_count("num_tokens_padded", self.num_tokens_padded)
        as_count("cudagraph_mode", self.cudagraph_mode)
        n = as_count("num_ubatches", self.num_ubatches)
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
    reason = _why_not_split(proposals, padded, n)
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


def _why_not_split(proposals: tuple[UBatchProposal, ...], padded: int, n: int) -> str:
    """Why the ranks do not split ("" when they do): a rank refuses, or the rank with the
    fewest real tokens would leave its last ubatch empty once padded to `padded`."""
    refusing = [p.rank for p in proposals if not p.should_split]
    if refusing:
        return f"rank(s) {refusing} cannot split"
    fewest = min(proposals, key=lambda p: p.num_tokens)
    if is_last_ubatch_empty(fewest.num_tokens, padded, n):
        return (
            f"rank {fewest.rank}'s {fewest.num_tokens} real tokens, padded to {padded}, "
            f"would leave its last of {n} ubatches empty"
        )
    return ""


def _world_size(group: Any) -> int:
    """Ranks in `group` (default: the world); 1 without a process group."""
    distributed = dist.is_available() and dist.is_initialized()
    return dist.get_world_size(group) if distributed else 1


# One int64 row per rank on the wire: ok flag, then the proposal's fields.
_WIRE_FIELDS = 6


def exchange_device(group: Any) -> torch.device:
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
    args = (should_split, real, num_tokens_padded, num_ubatches, cudagraph_mode)
    world = _world_size(group)
    if world <= 1:  # no peers: this rank's proposal decides, nothing is exchanged
        return decide_ubatching([UBatchProposal(0, *args)])
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of group")
    table = _exchange_rows(rank, world, args, group)
    proposals = [UBatchProposal(r, bool(v[1]), v[2], v[3], v[4], v[5]) for r, v in enumerate(table)]
    return decide_ubatching(proposals)


def _exchange_rows(rank: int, world: int, args: tuple, group: Any) -> list[list[int]]:
    """Every rank's proposal as one int64 row (an ok flag, then the fields), gathered on
    every rank. Bad arguments still travel, flagged, so no peer is left waiting in the
    all_gather; then this rank raises its own error and the others name it."""
    device = exchange_device(group)
    local_error: Exception | None = None
    try:
        local = UBatchProposal(rank, *args)
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
    with collective_kind("dp-agreement"):
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
    return table


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
    allow = as_bool("allow_microbatching", allow_microbatching)
    unpadded = as_count("num_tokens_unpadded", num_tokens_unpadded)
    padded = unpadded if num_tokens_padded is None else num_tokens_padded
    num_ubatches = _num_ubatches_of(parallel_config)
    attempt = False
    if allow:
        if uniform_decode is None:
            raise ValueError("uniform_decode is required when allow_microbatching is True")
        attempt = check_ubatch_thresholds(parallel_config, unpadded, uniform_decode)
    if _world_size(group) <= 1:  # no DP: nothing to agree on, no padding across ranks
        return False, None, as_count("cudagraph_mode", cudagraph_mode)
    decision = coordinate_ubatching(
        attempt, padded, num_ubatches, group, num_tokens=unpadded, cudagraph_mode=cudagraph_mode
    )
    across = torch.tensor(decision.num_tokens_across_dp, dtype=torch.int32)
    return decision.split, across, decision.cudagraph_mode


def _num_ubatches_of(parallel_config: Any) -> int:
    try:
        return parallel_config.num_ubatches
    except AttributeError:
        raise TypeError(
            f"parallel_config must have num_ubatches and the dbo thresholds (a DBOConfig or "
            f"vLLM ParallelConfig), got {type(parallel_config).__name__}"
        ) from None


def check_dp_padding(num_tokens: int, num_tokens_across_dp: Any, group: Any = None) -> None:
    """Every DP rank confirms, before the step's first fixed-size collective, that it runs the
    token count the agreement gave it (`num_tokens_across_dp[rank]`, from
    `coordinate_batch_across_dp`). One all_gather of one int per rank; a rank that skipped its
    DP padding (a dummy run with its own count) is named on every rank with the same
    UBatchAgreementError, where its peers would otherwise wait in a collective sized for the
    agreed count. Without a process group only this rank's count is checked."""
    mine = as_count("num_tokens", num_tokens)
    agreed = [int(v) for v in torch.as_tensor(num_tokens_across_dp).reshape(-1).tolist()]
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if distributed else 1
    if world <= 1:
        ran = [mine]
    else:
        device = exchange_device(group)
        rows = [torch.empty(1, dtype=torch.int64, device=device) for _ in range(world)]
        count = torch.tensor([mine], dtype=torch.int64, device=device)
        with collective_kind("dp-padding-check"):
            dist.all_gather(rows, count, group=group)
        ran = [int(r.item()) for r in rows]
    if len(agreed) != len(ran):
        raise UBatchAgreementError(
            f"num_tokens_across_dp has {len(agreed)} entries for {len(ran)} DP ranks"
        )
    wrong = [r for r, (a, b) in enumerate(zip(agreed, ran)) if a != b]
    if wrong:
        listing = ", ".join(f"rank {r} runs {ran[r]} (agreed {agreed[r]})" for r in wrong)
        raise UBatchAgreementError(
            f"DP ranks run other token counts than agreed ({listing}), so a collective sized "
            f"by the agreed counts would hang: either a rank skipped its DP padding (pad every "
            f"rank, dummy runs included, to num_tokens_across_dp) or the counts belong to "
            f"another batch (a ubatch needs its own counts, not its parent batch's)"
        )
