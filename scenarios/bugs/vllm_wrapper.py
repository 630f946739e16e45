"""vLLM's ubatch wrapper counting a step's tokens over the first two ubatches only
(#33694; the same sum keyed its CUDA graphs, #43145): with three ubatches the static output
buffer it picks by that count is too small, and the third ubatch's write fails."""

from __future__ import annotations

from typing import Any

import torch

from dbo.split import split_batch
from scenarios.bugs.attention import verify_verdict
from scenarios.bugs.registry import Verdict, bug

TOKENS, HIDDEN, UBATCHES = 24, 8, 3


class UBatchWrapper:
    """Keeps one static output buffer per token count, as a CUDA-graph wrapper keeps one
    captured graph (and its output) per count."""

    def __init__(self, buggy: bool) -> None:
        self.buggy = buggy
        self.buffers: dict[int, torch.Tensor] = {}

    def num_tokens(self, slices: list) -> int:
        if self.buggy:
            return slices[0].num_tokens + slices[1].num_tokens
        return sum(s.num_tokens for s in slices)

    def buffer(self, num_tokens: int) -> torch.Tensor:
        if num_tokens not in self.buffers:
            self.buffers[num_tokens] = torch.zeros(num_tokens, HIDDEN, dtype=torch.float64)
        return self.buffers[num_tokens]


@bug(
    "vllm-33694-two-ubatch-token-count",
    engine="vLLM",
    ref="vllm#33694 / vllm#43145",
    cause="the wrapper sums the token counts (and the CUDA-graph key) of ubatches 0 and 1 "
    "only, so with three ubatches its buffer misses the third ubatch's tokens",
    caught_by="dbo.verify (the runner's ubatch error)",
    evidence="ubatch 2",
)
def two_ubatch_token_count(buggy: bool) -> Verdict:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(TOKENS, HIDDEN, generator=gen, dtype=torch.float64)
    weight = torch.randn(HIDDEN, HIDDEN, generator=gen, dtype=torch.float64)
    wrapper = UBatchWrapper(buggy)

    def forward(inputs: dict[str, Any]) -> torch.Tensor:
        y = inputs["x"] @ weight
        inputs["out"][inputs["rows"]].copy_(y)  # into the wrapper's static output
        return y

    def split(inputs: dict[str, Any], n: int) -> list[dict[str, Any]]:
        slices = split_batch(list(range(TOKENS + 1)), TOKENS, n)
        out = wrapper.buffer(wrapper.num_tokens(slices))
        return [
            {"x": inputs["x"][s.token_slice], "out": out, "rows": s.token_slice} for s in slices
        ]

    whole = {
        "x": x,
        "out": torch.zeros(TOKENS, HIDDEN, dtype=torch.float64),
        "rows": slice(0, TOKENS),
    }
    return verify_verdict(forward, whole, split, num_ubatches=UBATCHES)
