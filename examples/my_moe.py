"""A user's MoE block with DBO yields where vLLM's DeepEP high-throughput kernels put them (three
per layer): what `dbo-sim verify examples.my_moe:forward --inputs examples.my_moe:make_batch`
and `dbo.verify(MyMoE().forward, make_batch())` check. Scratch comes from the ubatch's own
workspace slot; dispatch and combine run on the comm stream inside `comm_region`s."""

from __future__ import annotations

import torch

import dbo
from workspace import current_workspace_manager

__all__ = ["MyMoE", "forward", "make_batch"]


class MyMoE:
    """`layers` x (a GEMM, dispatch to the comm stream, an expert GEMM, combine back)."""

    def __init__(self, hidden: int = 512, layers: int = 2, dtype: torch.dtype = torch.float64):
        g = torch.Generator().manual_seed(0)
        self.weights = [
            (
                torch.randn(hidden, hidden, generator=g, dtype=dtype) / hidden**0.5,
                torch.randn(hidden, hidden, generator=g, dtype=dtype) / hidden**0.5,
            )
            for _ in range(layers)
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = dbo.current_device()
        for w_attn, w_expert in self.weights:
            h = torch.tanh(x @ w_attn)
            (recv,) = current_workspace_manager().get_simultaneous((h.shape, h.dtype))
            dbo.dbo_yield_and_switch_from_compute_to_comm()  # comm waits for h
            with device.comm_region("dispatch", nbytes=h.numel() * h.element_size()):
                recv.copy_(h)
            dbo.dbo_yield_and_switch_from_comm_to_compute()  # compute waits for recv
            expert_out = recv @ w_expert
            out = torch.empty_like(expert_out)
            dbo.dbo_yield_and_switch_from_compute_to_comm()
            with device.comm_region("combine", nbytes=out.numel() * out.element_size()):
                out.copy_(expert_out)
            dbo.dbo_switch_to_compute_sync()
            x = x + out
        return x


_MODEL = MyMoE()


def forward(batch: torch.Tensor) -> torch.Tensor:
    """The step `dbo-sim verify` calls."""
    return _MODEL.forward(batch)


def make_batch() -> torch.Tensor:
    """64 tokens of hidden size 512."""
    return torch.randn(64, 512, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
