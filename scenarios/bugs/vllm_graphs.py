"""vLLM's bug in how a step picks its CUDA graph kind: a graph keyed by token count only replayed
for a batch of another kind (#25625). The engine captures its graphs per dispatcher key on the
simulated device (`dbo.verification.graph_runner`) and serves the step through them; the
runner's checks name the graph that does not describe the batch. The pieces (the attention
whose kernel a graph keeps, the decode batches, the dispatcher) also serve the DP graph-size
entries, which run on real ranks (`scenarios.bugs.dp_graphs`)."""

from __future__ import annotations

import itertools

import torch

import dbo
from dbo.graph_dispatch import BatchDescriptor, CudagraphDispatcher, CUDAGraphMode
from dbo.sim import SimDevice
from dbo.split import CommonAttentionMetadata
from dbo.verification.graph_runner import CUDAGraphRunner, describe_batch
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


def graph_runner(key=None) -> CUDAGraphRunner:
    """The engine's graphs, captured on its dummy decode batches."""
    runner = CUDAGraphRunner(attention, dispatcher(), device=SimDevice(), key=key)
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
