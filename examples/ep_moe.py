"""A user's MoE layer whose all-to-all is the in-process `dbo.comm.EPGroup`: dispatch and
combine are `comm_region`s inside it, so the simulated device prices them as communication
and DBO has something to overlap. `dbo-sim verify examples.ep_moe:forward --inputs
examples.ep_moe:make_batch` checks it; `hand_rolled_forward` is the same layer with the token
exchange written as plain torch ops, which `verify` reports as a step with no communication.

`forward_at_size` is where DBO pays on the simulated H200: four such layers, 16 experts over
16 EP ranks (two nodes, so half of every all-to-all crosses RDMA), 16384 tokens in bf16. The
all-to-all then takes as long as the expert GEMMs, enough to hide a ubatch's communication
behind the other's compute and to pay for the baton passes. It runs on meta tensors (shapes
only: the simulator prices every op, nothing is computed), since computing it on a CPU would
take minutes; `make_batch` at 128 tokens is the same layer with real values, too small to
gain."""

from __future__ import annotations

import torch

import dbo
from dbo.comm import EPGroup

__all__ = [
    "EPMoE",
    "forward",
    "forward_at_size",
    "hand_rolled_forward",
    "make_batch",
    "make_batch_at_size",
]

TOP_K = 2


class EPMoE:
    """Router, dispatch, one GEMM per expert, combine: one MoE layer over `ep_size` EP ranks
    simulated in this process."""

    def __init__(
        self,
        hidden: int = 256,
        ep_size: int = 8,
        dtype: torch.dtype = torch.float64,
        *,
        num_experts: int = 8,
        device: str = "cpu",
    ):
        if device == "meta":  # shapes only: no values to draw
            self.router = torch.empty(hidden, num_experts, dtype=dtype, device=device)
            self.experts = torch.empty(num_experts, hidden, hidden, dtype=dtype, device=device)
        else:
            g = torch.Generator().manual_seed(0)
            self.router = torch.randn(hidden, num_experts, generator=g, dtype=dtype)
            self.experts = torch.randn(num_experts, hidden, hidden, generator=g, dtype=dtype)
            self.experts /= hidden**0.5
        self.ep = EPGroup(num_experts=num_experts, ep_size=ep_size)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = torch.topk(torch.softmax(x @ self.router, dim=-1), TOP_K, dim=-1)
        return ids, weights

    def run_experts(self, rows: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        # Every expert on every row, then each row's own: one GEMM instead of a ragged loop
        # (and its host sync for the counts), at num_experts / TOP_K times the FLOPs.
        every = torch.einsum("rh,ehk->rek", rows, self.experts)
        return every[torch.arange(rows.shape[0]), expert_ids]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        dbo.dbo_yield_and_switch_from_compute_to_comm()  # the comm stream waits for x
        sent = self.ep.dispatch(x, ids, weights)  # a comm_region: priced as all-to-all
        dbo.dbo_yield_and_switch_from_comm_to_compute()
        y = self.run_experts(sent.recv_x, sent.recv_expert_ids)
        dbo.dbo_yield_and_switch_from_compute_to_comm()
        out = self.ep.combine(y, sent.handle)  # allocated on the comm stream
        dbo.dbo_switch_to_compute_sync()
        result = x + out
        # `out` is freed on return while compute may still read it: without this, the next
        # ubatch's combine is handed its memory on the comm stream (a race verify reports).
        dbo.record_stream(out, dbo.current_stream())
        return result

    def hand_rolled_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The same values with the exchange as plain ops: nothing marks it as communication."""
        ids, weights = self.route(x)
        dbo.dbo_yield()
        y = self.run_experts(x.repeat_interleave(TOP_K, 0), ids.reshape(-1))
        out = (y.view(x.shape[0], TOP_K, -1) * weights.unsqueeze(-1)).sum(1)
        dbo.dbo_yield()
        return x + out


_MODEL = EPMoE()


def forward(batch: torch.Tensor) -> torch.Tensor:
    """The step `dbo-sim verify` calls."""
    return _MODEL.forward(batch)


def hand_rolled_forward(batch: torch.Tensor) -> torch.Tensor:
    return _MODEL.hand_rolled_forward(batch)


def make_batch() -> torch.Tensor:
    """128 tokens of hidden size 256."""
    return torch.randn(128, 256, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


AT_SIZE_LAYERS, AT_SIZE_HIDDEN, AT_SIZE_TOKENS = 4, 1024, 16384
_AT_SIZE: list[EPMoE] = []


def forward_at_size(batch: torch.Tensor) -> torch.Tensor:
    """Four layers at the size where DBO pays (shapes only)."""
    if not _AT_SIZE:  # built on first use: importing the module stays cheap
        _AT_SIZE.extend(
            EPMoE(AT_SIZE_HIDDEN, 16, torch.bfloat16, num_experts=16, device="meta")
            for _ in range(AT_SIZE_LAYERS)
        )
    for layer in _AT_SIZE:
        batch = layer.forward(batch)
    return batch


def make_batch_at_size() -> torch.Tensor:
    """16384 tokens of hidden size 1024 in bf16, on the meta device (shapes only)."""
    return torch.empty(AT_SIZE_TOKENS, AT_SIZE_HIDDEN, dtype=torch.bfloat16, device="meta")
