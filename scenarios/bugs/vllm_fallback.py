"""vLLM bugs at the edges of a DBO split: a split that leaves the first ubatch empty where
the V1 rules never run one (vllm-project/afd-plugin#99), and a workspace sized by a ubatched
profile run, too small for a step that falls back to serial (#52176)."""

from __future__ import annotations

import torch

import dbo
import workspace
from dbo.split import CommonAttentionMetadata, UBatchSlice
from dbo.verification.layout import EmptyUBatchError
from scenarios.bugs.attention import verify_verdict
from scenarios.bugs.registry import Verdict, bug
from scenarios.bugs.vllm_graphs import attention

__all__ = ["request_aligned_split"]

UBATCHES = 2


def request_aligned_split(query_lens: list[int]) -> list[UBatchSlice]:
    """AFD's split: at the request boundary nearest half the tokens (the lower one on a
    tie), so one request of one token is cut at 0."""
    bounds = [0]
    for n in query_lens:
        bounds.append(bounds[-1] + n)
    total, reqs = bounds[-1], len(query_lens)
    cut = min(range(reqs + 1), key=lambda r: abs(2 * bounds[r] - total))
    return [
        UBatchSlice(slice(0, cut), slice(0, bounds[cut])),
        UBatchSlice(slice(cut, reqs), slice(bounds[cut], total)),
    ]


def _should_ubatch(num_tokens: int, slices: list[UBatchSlice], buggy: bool) -> bool:
    last_empty = slices[-1].num_tokens == 0  # vLLM's coordinated decision checks only this
    if buggy:
        return not last_empty
    return not last_empty and num_tokens >= UBATCHES  # afd-plugin#100: and the first one


@bug(
    "afd-99-empty-first-ubatch",
    engine="vLLM (afd-plugin)",
    ref="vllm-project/afd-plugin#99 / #100",
    cause="the ubatching decision only refuses a split whose last ubatch is empty, so a "
    "rank with one token splits at the request boundary 0 and runs an empty first ubatch, "
    "which vLLM's V1 runner never runs",
    caught_by="dbo.verify (split rules)",
    evidence="ubatch 0 holds no real token",
)
def empty_first_ubatch(buggy: bool) -> Verdict:
    # Two decode steps of one rank: one request of one token, then two requests.
    for query_lens in ([1], [1, 1]):
        meta = CommonAttentionMetadata.make(query_lens, [4] * len(query_lens), block_size=16)
        q = torch.linspace(-1.0, 1.0, meta.num_actual_tokens * 4, dtype=torch.float64)
        batch = {"q": q.reshape(-1, 4), "attn": meta}
        slices = request_aligned_split(query_lens)
        if not _should_ubatch(meta.num_actual_tokens, slices, buggy):
            continue  # runs serially: nothing of DBO to verify
        try:
            verdict = verify_verdict(attention, batch, None, slices=slices)
        except EmptyUBatchError as refused:
            return Verdict(True, "dbo.verify (split rules)", str(refused))
        if verdict.caught:
            return verdict
    return Verdict(False, "dbo.verify", "ok: every step it splits is clean")


MAX_NUM_TOKENS, HIDDEN = 32, 8192  # 32 KiB of scratch per token


def _moe_scratch(x: torch.Tensor) -> torch.Tensor:
    """A layer that stages its tokens in workspace scratch, as a fused-MoE kernel does."""
    (scratch,) = workspace.current_workspace_manager().get_simultaneous(
        ((x.shape[0], HIDDEN), torch.float32)
    )
    scratch.copy_(x[:, :1].expand(-1, HIDDEN))
    dbo.dbo_yield()
    return x * scratch[:, :1]


@bug(
    "vllm-52176-profile-run-under-dbo",
    engine="vLLM",
    ref="vllm#52176",
    cause="the profile run runs under DBO, so the workspace is sized and locked for one "
    "ubatch's share of max_num_tokens; a step that falls back from DBO to serial needs the "
    "whole batch in one slot and is refused",
    caught_by="dbo.verify (the workspace's locked-growth error)",
    evidence="falls back from DBO to serial",
)
def profile_run_under_dbo(buggy: bool) -> Verdict:
    x = torch.linspace(-1.0, 1.0, MAX_NUM_TOKENS * 4).reshape(MAX_NUM_TOKENS, 4)
    workspace.init_workspace_manager("cpu", UBATCHES)
    try:
        n = UBATCHES if buggy else 1  # the fix: the profile run without DBO
        with workspace.workspace_step("profile run", num_tokens=MAX_NUM_TOKENS, num_ubatches=n):
            if buggy:
                half = MAX_NUM_TOKENS // 2
                dbo.run_ubatches(_moe_scratch, [x[:half], x[half:]], device="sim")
            else:
                _moe_scratch(x)
        workspace.lock_workspace()
        # A later step of max_num_tokens (its serial run is what a fallback from DBO runs).
        return verify_verdict(_moe_scratch, x, None)
    except workspace.WorkspaceLockedError as refused:
        return Verdict(True, "dbo.verify (workspace)", str(refused))
    finally:
        workspace.reset_workspace_manager()
