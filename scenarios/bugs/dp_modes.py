"""Ranks taking different paths through one step, rebuilt on two real gloo ranks and caught by
`dbo.verify_ranks` with no check the step calls by hand: each rank decides something that
must be decided the same on every rank (the EP dispatch mode, whether to microbatch) from its
own batch instead of from what the ranks agreed, so their collectives stop pairing.

SGLang #7222: under DP attention, DeepEP's auto mode picks the normal dispatch (a handshake of
per-rank counts, then the exchange) for an extend batch and the low-latency one (fixed-size
buffers, no handshake) for a decode batch. Resolved from a rank's own forward mode, a rank
that extends and a rank that decodes run different exchanges; the fix resolves it from the
batch's `is_extend_in_batch`, which the DP sync (SGLang's `prepare_mlp_sync_batch`) gathers
from every rank.

vLLM #50945 (review thread): in the V2 runner's DBO, every rank deduces every rank's
microbatching vote from the token counts the DP agreement carries, so a rank running a dummy
batch cannot opt out on its own. An earlier revision let the dummy run skip the microbatched
path: it runs its whole dummy forward once, in the first ubatch, while its peer runs one per
ubatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

import dbo
from dbo.split import coordinate_ubatching
from scenarios.bugs.dp_steps import report_verdict
from scenarios.bugs.registry import Verdict, bug

HIDDEN = 4
LAYERS = 2
LOW_LATENCY_TOKENS = 8  # DeepEP low-latency's num_max_dispatch_tokens_per_rank: fixed buffers
TIMEOUT_S = 30.0
_BY = "dbo.verify_ranks (every collective fingerprinted across 2 gloo ranks)"


def mlp_sync(num_tokens: int, is_extend: bool) -> tuple[list[int], bool]:
    """SGLang's DP sync before the MLP: every rank's token count and forward mode gathered;
    the batch extends where any rank does (`is_extend_in_batch`)."""
    mine = torch.tensor([num_tokens, int(is_extend)], dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    with dbo.collective_kind("dp-agreement"):
        dist.all_gather(rows, mine)
    return [int(r[0]) for r in rows], any(bool(r[1]) for r in rows)


def _exchange(rows: torch.Tensor, kind: str) -> list[torch.Tensor]:
    gathered = [torch.empty_like(rows) for _ in range(dist.get_world_size())]
    with dbo.collective_kind(kind):
        dist.all_gather(gathered, rows)
    return gathered


def _normal_dispatch(hidden: torch.Tensor, layer: int) -> torch.Tensor:
    """DeepEP's normal mode: a handshake of every rank's count sizes the exchange."""
    count = torch.tensor([hidden.shape[0]], dtype=torch.int64)
    counts = _exchange(count, "ep-handshake")
    most = max(int(c) for c in counts)
    padded = torch.zeros(most, HIDDEN, dtype=hidden.dtype)
    padded[: hidden.shape[0]] = hidden
    expert_out = torch.stack(_exchange(padded, "ep dispatch (normal)")) * (layer + 2)
    return expert_out[dist.get_rank(), : hidden.shape[0]]


def _low_latency_dispatch(hidden: torch.Tensor, layer: int) -> torch.Tensor:
    """DeepEP's low-latency mode: no handshake, every rank sends a buffer of fixed size."""
    buffer = torch.zeros(LOW_LATENCY_TOKENS, HIDDEN, dtype=hidden.dtype)
    buffer[: hidden.shape[0]] = hidden
    expert_out = torch.stack(_exchange(buffer, "ep dispatch (low_latency)")) * (layer + 2)
    return expert_out[dist.get_rank(), : hidden.shape[0]]


def deepep_auto_step(batch: dict, local_mode: bool) -> torch.Tensor:
    """One DP-attention MoE step with DeepEP's auto mode; `local_mode`: the mode resolved from
    this rank's own forward mode (the bug) instead of `is_extend_in_batch`."""
    hidden, is_extend = batch["hidden"], bool(batch["extend"].any())
    _, extend_in_batch = mlp_sync(hidden.shape[0], is_extend)
    normal = is_extend if local_mode else extend_in_batch
    for layer in range(LAYERS):
        hidden = (_normal_dispatch if normal else _low_latency_dispatch)(hidden, layer)
    return hidden


def extend_and_decode(rank: int, world_size: int) -> dict:
    """Rank 0 extends (a prefill of 6 tokens); every other rank decodes 3 requests."""
    num_tokens, extend = (6, True) if rank == 0 else (3, False)
    hidden = torch.arange(num_tokens * HIDDEN, dtype=torch.float64).reshape(num_tokens, HIDDEN)
    return {"hidden": hidden + rank, "extend": torch.full((num_tokens,), extend)}


@bug(
    "sglang-7222-deepep-mode-from-local-forward-mode",
    engine="SGLang",
    ref="sglang#7222",
    cause="under DP attention, DeepEP's auto mode is resolved from each rank's own forward "
    "mode, so a rank that extends runs the normal dispatch (a handshake, then the exchange) "
    "while a rank that decodes runs the low-latency one, and the exchanges never pair",
    caught_by=_BY,
    ranks=2,
    evidence="rank 0 calls all_gather ('ep-handshake') where rank 1 calls all_gather "
    "('ep dispatch (low_latency)')",
)
def deepep_mode_from_local_forward_mode(buggy: bool) -> Verdict:
    report = dbo.verify_ranks(
        lambda batch: deepep_auto_step(batch, local_mode=buggy),
        extend_and_decode,
        num_ranks=2,
        timeout=TIMEOUT_S,
    )
    return report_verdict(report, _BY)


@dataclass(frozen=True)
class DummyRun:
    """How the idle rank's dummy run takes part in a microbatched step."""

    opts_out: bool  # the bug: not microbatched, its one forward runs in the first ubatch


def microbatched_step(batch: torch.Tensor, dummy: DummyRun) -> torch.Tensor:
    """A DP/EP step run once per ubatch under DBO: the DP agreement, then per layer an EP
    exchange of every rank's rows padded to the agreed count. A rank with no tokens runs the
    engine's dummy batch; opting out of microbatching, it runs once for the whole step."""
    idle = batch.shape[0] == 0
    if idle and dummy.opts_out and dbo.dbo_enabled() and dbo.dbo_current_ubatch_id() > 0:
        return batch  # its single dummy forward already ran in ubatch 0
    padded = coordinate_ubatching(False, batch.shape[0], 2).num_tokens_padded
    hidden = torch.zeros(padded, HIDDEN, dtype=batch.dtype)
    hidden[: batch.shape[0]] = batch
    for layer in range(LAYERS):
        gathered = _exchange(hidden, "ep dispatch")
        hidden = gathered[dist.get_rank()] * (layer + 2)
    return hidden[: batch.shape[0]]


def busy_and_idle(rank: int, world_size: int) -> torch.Tensor:
    """Rank 0 holds 6 tokens; every other rank is idle (0 tokens: a dummy run)."""
    rows = 6 if rank == 0 else 0
    return torch.arange(rows * HIDDEN, dtype=torch.float64).reshape(rows, HIDDEN)


@bug(
    "vllm-50945-dummy-run-opts-out-of-microbatching",
    engine="vLLM",
    ref="vllm#50945 (review thread)",
    cause="a rank running a dummy batch opts out of microbatching on its own while its peers, "
    "which deduce its vote from its token count, microbatch: its one dummy forward pairs with "
    "the first ubatch's collectives and the second ubatch's are left unanswered",
    caught_by=_BY,
    ranks=2,
    evidence="kind 'dp-agreement', step 2 (DBO) #2 of its kind, ubatch 1",
)
def dummy_run_opts_out_of_microbatching(buggy: bool) -> Verdict:
    report = dbo.verify_ranks(
        lambda batch: microbatched_step(batch, DummyRun(opts_out=buggy)),
        busy_and_idle,
        num_ranks=2,
        timeout=TIMEOUT_S,
    )
    return report_verdict(report, _BY)
