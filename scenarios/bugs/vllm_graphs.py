"""vLLM and vLLM-ascend bugs in how a step picks its CUDA graph: a graph keyed by token count
only replayed for a batch of another kind (#25625), and a DP dummy run replaying a graph of
another size than the DP-agreed one (its own count, vLLM #25906; mRoPE positions' first dim,
vLLM-ascend #4393). Each engine captures its graphs per
dispatcher key on the simulated device (`dbo.graph_runner`) and serves the step through them;
the runner's checks name the graph that does not describe the batch."""

from __future__ import annotations

import itertools

import torch

import dbo
from dbo.graph_dispatch import BatchDescriptor, CudagraphDispatcher, CUDAGraphMode
from dbo.graph_runner import CUDAGraphRunner, describe_batch
from dbo.sim import SimDevice
from dbo.split import CommonAttentionMetadata
from scenarios.bugs.attention import verify_verdict
from scenarios.bugs.registry import Verdict, bug

__all__ = ["attention", "decode_batch", "dispatcher", "graph_runner", "mixed_batch"]

CAPTURE_SIZES = (1, 2, 4, 8)
BLOCK = 16


def attention(batch: dict) -> torch.Tensor:
    """A decode kernel (one query per request) or a prefill kernel (causal within each
    request), picked on the host from the request layout as an attention backend picks its
    kernel: a captured graph keeps the kernel of the batch it was captured on."""
    q, m = batch["q"], batch["attn"]
    qsl = m.query_start_loc_cpu.tolist()
    dbo.dbo_yield()
    if max((b - a for a, b in itertools.pairwise(qsl)), default=0) <= 1:
        return q * m.seq_lens[: q.shape[0]].to(q.dtype)[:, None]
    out = torch.zeros_like(q)
    for i, (a, b) in enumerate(itertools.pairwise(qsl)):
        if b > a:
            out[a:b] = q[a:b].cumsum(0) * m.seq_lens[i].to(q.dtype)
    return out


def _batch(query_lens: list[int], seq_lens: list[int], num_reqs_padded: int | None = None):
    meta = CommonAttentionMetadata.make(
        query_lens, seq_lens, block_size=BLOCK, num_reqs_padded=num_reqs_padded
    )
    q = torch.linspace(-1.0, 1.0, meta.num_actual_tokens * 4, dtype=torch.float64)
    return {"q": q.reshape(-1, 4), "attn": meta}


def decode_batch(num_tokens: int) -> dict:
    """A uniform decode batch of `num_tokens` one-token requests (the engine's dummy run)."""
    return _batch([1] * num_tokens, [3 + r % 5 for r in range(num_tokens)])


def dispatcher() -> CudagraphDispatcher:
    """FULL graphs for uniform decode batches only (`FULL_DECODE_ONLY`)."""
    return CudagraphDispatcher(CUDAGraphMode.FULL_DECODE_ONLY, CAPTURE_SIZES)


def mixed_batch() -> dict:
    """One prefill of 5 tokens and three decodes, padded to the 8 request rows the decode
    graph's buffers hold."""
    return _batch([5, 1, 1, 1], [5, 9, 7, 12], num_reqs_padded=8)


def graph_runner(key=None, num_tokens_across_dp=None) -> CUDAGraphRunner:
    """The engine's graphs, captured on its dummy decode batches."""
    runner = CUDAGraphRunner(
        attention,
        dispatcher(),
        device=SimDevice(),
        key=key,
        num_tokens_across_dp=num_tokens_across_dp,
    )
    runner.capture_all(lambda k: decode_batch(k.num_tokens))
    return runner


def _by_token_count(batch: dict, num_ubatches: int) -> BatchDescriptor:
    """The buggy key: the graph for this many tokens, whatever the batch's kind."""
    n = describe_batch(batch).num_tokens
    return BatchDescriptor(n, n, True, num_ubatches)


@bug(
    "vllm-25625-full-graph-mixed-batch",
    engine="vLLM",
    ref="vllm#25625",
    cause="DBO replays full CUDA graphs keyed by token count only, so a mixed prefill/decode "
    "batch of 8 tokens replays the graph captured for a uniform decode of 8 requests",
    caught_by="dbo.verify (graphs)",
    evidence="graph kind: a FULL graph captured for a uniform decode batch is replayed for a "
    "mixed batch",
)
def full_graph_mixed_batch(buggy: bool) -> Verdict:
    runner = graph_runner(key=_by_token_count if buggy else None)
    layout = [slice(0, 5), slice(5, 8)]  # the DBO layout cuts at the request boundary
    return verify_verdict(attention, mixed_batch(), None, slices=layout, graphs=runner)


@bug(
    "vllm-25906-dummy-run-graph-size",
    engine="vLLM",
    ref="vllm#25906",
    cause="an idle DP rank's dummy run dispatches its CUDA graph by its own token count (1) "
    "instead of the DP-padded count the ranks agreed (8), so it replays a graph of another "
    "size than its peers and their collectives hang",
    caught_by="the graph runner (DP size check)",
    evidence="but the ranks agreed on 8 tokens",
)
def dummy_run_graph_size(buggy: bool) -> Verdict:
    own, agreed = 1, [1, 8]  # the idle rank's dummy token, and its peer's real count
    padded = dispatcher().padded_num_tokens(max(agreed))  # vLLM's num_tokens_after_padding
    # The dummy run's inputs are sized by the agreed count; the bug is in the graph key.
    num_tokens = own if buggy else padded

    def key(batch: dict, num_ubatches: int) -> BatchDescriptor:
        return BatchDescriptor(num_tokens, num_tokens, True, num_ubatches)

    runner = graph_runner(key=key, num_tokens_across_dp=agreed)
    replay = runner.run(decode_batch(padded), step="dummy run")
    message = replay.describe() if replay.problems else f"ok: {replay.describe()}"
    return Verdict(bool(replay.problems), "the graph runner", message)


MROPE_SECTIONS = 3  # mRoPE's positions: one row per section (temporal, height, width)


def _mrope_batch(num_tokens: int) -> dict:
    """A multimodal model's decode batch: mRoPE positions of shape (3, num_tokens)."""
    batch = decode_batch(num_tokens)
    row = batch["attn"].positions
    batch["positions"] = row.expand(MROPE_SECTIONS, num_tokens).clone()
    return batch


@bug(
    "vllm-ascend-4393-mrope-graph-tokens",
    engine="vLLM-ascend",
    ref="vllm-ascend#4393 / #3425",
    cause="a DP dummy run under FULL_DECODE_ONLY takes its token count for the graph from "
    "positions.shape[0], which is 3 for a multimodal model's mRoPE positions (3, num_tokens), "
    "so it replays the graph of another size than its peers and the ranks hang",
    caught_by="the graph runner (DP size check)",
    evidence="the step runs a graph of 4 tokens, but the ranks agreed on 8 tokens",
)
def mrope_graph_tokens(buggy: bool) -> Verdict:
    agreed = [8, 8]  # both ranks run 8 tokens this step (rank 0's a padded dummy run)

    def key(batch: dict, num_ubatches: int) -> BatchDescriptor:
        positions = batch["positions"]
        n = positions.shape[0] if buggy else positions.shape[-1]  # the fix: num_tokens
        return BatchDescriptor(n, n, True, num_ubatches)

    runner = CUDAGraphRunner(
        attention, dispatcher(), device=SimDevice(), key=key, num_tokens_across_dp=agreed
    )
    runner.capture_all(lambda k: _mrope_batch(k.num_tokens))  # the engine's own dummy runs
    replay = runner.run(_mrope_batch(8), step="dummy run")
    message = replay.describe() if replay.problems else f"ok: {replay.describe()}"
    return Verdict(bool(replay.problems), "the graph runner", message)
