"""Ranks falling out of step, rebuilt on two real gloo ranks and caught by `dbo.verify_ranks`
with no check the step calls by hand: every collective is fingerprinted across the ranks
before it runs, so a skipped, reordered or resized one is named on both ranks instead of
hanging.

One small DP/EP MoE step serves every entry: the ranks agree on the padded token count (the
DP agreement), then each of two layers gathers every rank's rows (the EP dispatch), runs the
experts and gathers the outputs back (the EP combine). Rank 0 holds 6 tokens; rank 1 is idle
and runs the engine's dummy batch of 0 tokens, which must still run every collective. Each
entry's buggy variant is one rebuilt mistake of an engine's; its fixed variant is the step
as the fix wrote it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

import dbo
from dbo.split import coordinate_ubatching
from scenarios.bugs.registry import Verdict, bug

HIDDEN = 4
LAYERS = 2
TIMEOUT_S = 30.0
_BY = "dbo.verify_ranks (every collective fingerprinted across 2 gloo ranks)"


@dataclass(frozen=True)
class Mistake:
    """Which rebuilt mistake the idle rank's step makes (all False: the fixed step)."""

    returns_early: bool = False  # vllm#51984: no dummy forward on a zero-token rank
    own_count: bool = False  # vllm#25906: the dummy run sized from its own token count
    skips_combine: bool = False  # sgl-kernel-npu#69: no combine on a rank that got no tokens
    idle_sync_crash: bool = False  # sglang#25404: the DP sync reads an idle batch's None field


def _local_tokens(num_tokens: int, mistake: Mistake) -> int:
    """The count a rank brings to the DP sync. An idle batch has no extend lengths (None)."""
    extend_lens = None if num_tokens == 0 else [num_tokens]
    if mistake.idle_sync_crash or extend_lens is not None:
        return sum(extend_lens)  # an idle batch: TypeError, and this rank never syncs
    return 0


def _layer(hidden: torch.Tensor, layer: int, skip_combine: bool) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = [torch.empty_like(hidden) for _ in range(world)]
    with dbo.collective_kind("ep dispatch"):
        dist.all_gather(rows, hidden)
    expert_out = torch.stack(rows) * (layer + 2)  # every rank's experts see every rank's rows
    if skip_combine:
        return hidden
    back = [torch.empty_like(hidden) for _ in range(world)]
    with dbo.collective_kind("ep combine"):
        dist.all_gather(back, expert_out[rank])
    return back[rank]


def moe_step(batch: torch.Tensor, mistake: Mistake) -> torch.Tensor:
    """One DP/EP step over `batch` (rows = tokens); the idle rank's batch has 0 rows."""
    num_tokens = batch.shape[0]
    idle = num_tokens == 0
    if idle and mistake.returns_early:
        return batch
    decision = coordinate_ubatching(False, _local_tokens(num_tokens, mistake), 2)
    padded = decision.num_tokens_padded
    if idle and mistake.own_count:
        padded = max(num_tokens, 1)  # a 1-token dummy batch, as the dummy run sizes it alone
    hidden = torch.zeros(padded, HIDDEN, dtype=batch.dtype)
    hidden[:num_tokens] = batch
    for layer in range(LAYERS):
        hidden = _layer(hidden, layer, skip_combine=idle and mistake.skips_combine)
    return hidden[:num_tokens]


def dp_batches(rank: int, world_size: int) -> torch.Tensor:
    """Rank 0 holds 6 tokens; every other rank is idle (the engine's 0-token dummy batch)."""
    return (
        torch.arange(6 * HIDDEN, dtype=torch.float64).reshape(6, HIDDEN)
        if rank == 0
        else (torch.zeros(0, HIDDEN, dtype=torch.float64))
    )


def verdict(mistake: Mistake) -> Verdict:
    """Verify the step on two ranks; caught when the group report is not ok, its message the
    report's first finding and each failed rank's verdict."""
    report = dbo.verify_ranks(
        lambda batch: moe_step(batch, mistake), dp_batches, num_ranks=2, timeout=TIMEOUT_S
    )
    return report_verdict(report, _BY)


def report_verdict(report: dbo.RanksReport, by: str) -> Verdict:
    """A group report as a verdict: caught when not ok, its message the collectives' finding
    (the ranks out of step, or the hang) and each failed rank's headline."""
    if report.ok:
        return Verdict(False, by, "ok: every rank ran the same collectives and matched")
    finding = report.out_of_step or "\n".join(report.hang or [])
    ranks = [v.headline() for v in report.ranks if not v.ok]
    return Verdict(True, by, " | ".join(p for p in [finding.replace("\n", " "), *ranks] if p))


@bug(
    "vllm-51984-idle-rank-returns-early",
    engine="vLLM",
    ref="vllm#51984",
    cause="a DP rank with zero scheduled tokens returns early from execute_model instead of "
    "running the dummy forward, so it skips every collective of the step and the busy rank "
    "waits in the EP exchange",
    caught_by=_BY,
    ranks=2,
    evidence="rank 1 has begun step 2 (DBO) while rank 0 still calls all_gather "
    "('dp-agreement') in step 1: rank 1 skipped that collective",
)
def idle_rank_returns_early(buggy: bool) -> Verdict:
    return verdict(Mistake(returns_early=buggy))


@bug(
    "vllm-25906-dummy-run-sized-by-own-count",
    engine="vLLM",
    ref="vllm#25906",
    cause="the idle rank's dummy run sizes its batch (and CUDA graph) from its own token count "
    "instead of the DP-agreed one, so its collectives have other shapes than its peers'",
    caught_by=_BY,
    ranks=2,
    evidence="a rank sized it from its own token count instead of the agreed one",
)
def dummy_run_own_count(buggy: bool) -> Verdict:
    return verdict(Mistake(own_count=buggy))


@bug(
    "sgl-kernel-npu-69-zero-token-rank-skips-combine",
    engine="SGLang",
    ref="sgl-kernel-npu#69",
    cause="a rank that received zero tokens skips the combine's exchange and moves on, so its "
    "next layer's dispatch pairs with its peers' combine: same op, same shape, another meaning",
    caught_by=_BY,
    ranks=2,
    evidence="rank 0 calls all_gather ('ep combine') where rank 1 calls all_gather ('ep dispatch')",
)
def zero_token_rank_skips_combine(buggy: bool) -> Verdict:
    return verdict(Mistake(skips_combine=buggy))


@bug(
    "sglang-25404-idle-batch-crashes-dp-sync",
    engine="SGLang",
    ref="sglang#25404",
    cause="an idle DP rank's batch falls through to the extend path of the MLP sync and reads "
    "a None field, so the rank raises before the sync's all_gather and every peer waits in it",
    caught_by=_BY,
    ranks=2,
    evidence="rank 1 has finished every step while rank 0 still calls all_gather ('dp-agreement')",
)
def idle_batch_crashes_dp_sync(buggy: bool) -> Verdict:
    return verdict(Mistake(idle_sync_crash=buggy))
