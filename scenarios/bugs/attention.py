"""A small paged attention step for the metadata bugs: real torch ops over a KV cache laid
out by a `CommonAttentionMetadata`, so a wrong field gives a wrong value, and a helper that
hands such a step to `dbo.verify`.

The cache holds every position of every request (as if an earlier op wrote it); the forward
reads, per request row, its keys through its block-table row up to `seq_lens`, places its
queries after `num_computed_tokens_cpu` tokens (causal), turns them by `positions` (a rotary
stand-in), and treats a request `is_prefilling` says is still in its prompt with full causal
attention and any other with a sparse window over its last keys, as DeepSeek's indexer does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

import dbo
from dbo.split import CommonAttentionMetadata
from scenarios.bugs.registry import Verdict

__all__ = [
    "PagedAttention",
    "first_finding",
    "verify_verdict",
    "STEP_QUERY",
    "STEP_SEQ",
    "STEP_PROMPTS",
]

# 23 tokens of four requests; the midpoint cut at 11 cuts request 1 (tokens 3..11) and leaves
# its continuation one token long. Ubatch 0 holds 2 requests, ubatch 1 holds 3.
STEP_QUERY, STEP_SEQ, STEP_PROMPTS = [3, 9, 4, 7], [40, 33, 4, 20], [40, 40, 4, 20]
_SPARSE_WINDOW = 4


class PagedAttention:
    """Attention over a paged KV cache, driven entirely by the metadata it is given."""

    def __init__(
        self,
        meta: CommonAttentionMetadata,
        *,
        block_size: int,
        heads: int = 2,
        dim: int = 8,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        num_blocks = int(meta.block_table_tensor.max()) + 1
        slots = num_blocks * block_size
        self.block_size = block_size
        self.k = torch.randn(slots, heads, dim, generator=gen, dtype=torch.float64)
        self.v = torch.randn(slots, heads, dim, generator=gen, dtype=torch.float64)
        self.q = torch.randn(meta.num_actual_tokens, heads, dim, generator=gen, dtype=torch.float64)

    def inputs(self, meta: CommonAttentionMetadata) -> dict[str, Any]:
        return {"q": self.q, "attn": meta}

    def forward(self, inputs: dict[str, Any]) -> torch.Tensor:
        q, m = inputs["q"], inputs["attn"]
        if m.positions is not None:
            q = q * (1.0 + 0.01 * m.positions.to(q.dtype))[:, None, None]
        dbo.dbo_yield()  # where a real layer hands over (its QKV projection done)
        out = torch.zeros_like(q)
        qsl = m.query_start_loc_cpu.tolist()
        for i in range(len(qsl) - 1):
            lo, hi = qsl[i], qsl[i + 1]
            if hi > lo:
                out[lo:hi] = self._request(q[lo:hi], m, i)
        return out

    def _request(self, q: torch.Tensor, m: CommonAttentionMetadata, i: int) -> torch.Tensor:
        n_keys = int(m.seq_lens[i])
        first = int(m.num_computed_tokens_cpu[i])  # position of this row's first query
        pos = torch.arange(n_keys)
        row = m.block_table_tensor[i].to(torch.int64)
        slots = row[pos // self.block_size] * self.block_size + pos % self.block_size
        keys, vals = self.k[slots], self.v[slots]
        scores = torch.einsum("qhd,khd->hqk", q, keys) / math.sqrt(q.shape[-1])
        q_pos = first + torch.arange(q.shape[0])
        visible = pos[None, :] <= q_pos[:, None]
        prefilling = q.shape[0] > 1 if m.is_prefilling is None else bool(m.is_prefilling[i])
        if not prefilling:  # decode: the indexer keeps only the last keys
            visible &= pos[None, :] > q_pos[:, None] - _SPARSE_WINDOW
        scores = scores.masked_fill(~visible[None], float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), vals)


def first_finding(report: Any) -> str:
    """The line of a verify report that says what failed: a broken split first (the cause),
    then the ubatched step's error, then a graph replay that does not fit its batch."""
    if report.metadata_error is not None:
        return f"{type(report.metadata_error).__name__}: {report.metadata_error}"
    if report.error is not None:
        return f"{type(report.error).__name__}: {report.error}"
    failed = [r for r in report.graphs if not r.ok]
    if failed:
        return f"graph replay: {failed[0].describe()}"
    if report.mismatch:
        return f"outputs differ: {report.mismatch}"
    for run in ("serial", "ubatched"):
        found = list(report.races[run])
        if found:
            return f"race ({run}): {found[0].describe()}"
    return "ok"


def verify_verdict(
    forward: Callable[[Any], Any],
    inputs: Any,
    split: Callable[[Any, int], list[Any]],
    *,
    num_ubatches: int = 2,
    merge: Callable[[list[Any]], Any] | None = None,
    **options: Any,
) -> Verdict:
    """`dbo.verify` of the step on the simulated device, as a verdict (`options`: verify's
    other arguments: slices, split_rules, graphs)."""
    report = dbo.verify(
        forward,
        inputs,
        num_ubatches=num_ubatches,
        split=split,
        merge=merge,
        timeout=30.0,
        atol=1e-9,
        **options,
    )
    return Verdict(not report.ok, "dbo.verify", first_finding(report))
