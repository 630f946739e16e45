"""Dispatch and combine across processes: the data movement of `EPGroup.dispatch` and
`EPGroup.combine` when the group spans torch.distributed ranks (inside their comm regions),
and how a failure is told apart from a peer's.
"""

from __future__ import annotations

import torch

from dbo.comm.collectives import Collectives
from dbo.comm.records import EPHandle, EPPeerFailedError

__all__ = ["as_bytes", "caused_by_peer", "combine_across", "dispatch_across"]


def as_bytes(t: torch.Tensor, name: str) -> torch.Tensor:
    """Rows as raw bytes: the collective then needs no support for the dtype (bf16, fp8)."""
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous to be sent across processes")
    return t.view(torch.uint8)


def dispatch_across(
    collectives: Collectives,
    x: torch.Tensor,
    handle: EPHandle,
    out: torch.Tensor,
    arrived_ids: torch.Tensor,
    arrived: torch.Tensor,
) -> torch.Tensor:
    """Dispatch's data movement between processes, inside its comm region: the rows and their
    expert ids out to their owners (into `arrived`, `arrived_ids`), then what arrived
    reordered expert-major into `out`. Returns the received rows' expert ids
    (non-decreasing); sets `handle.recv_order`."""
    plan = handle.plan
    rows = x.index_select(0, plan.token_of_row)
    splits = (plan.recv_counts, plan.send_counts)  # (output, input) rows per rank
    collectives.all_to_all(arrived_ids, plan.row_expert, *splits, "dispatch expert ids")
    collectives.all_to_all(
        as_bytes(arrived, "receive buffer"), as_bytes(rows, "x rows"), *splits, "dispatch"
    )
    handle.recv_order = arrived_ids.argsort(stable=True)
    torch.index_select(arrived, 0, handle.recv_order, out=out)
    return arrived_ids[handle.recv_order]


def combine_across(
    collectives: Collectives,
    expert_out: torch.Tensor,
    handle: EPHandle,
    out: torch.Tensor,
    staged: torch.Tensor,
    back: torch.Tensor,
) -> None:
    """Combine's data movement between processes, inside its comm region: the expert outputs
    (through `staged`) back to their tokens' ranks (into `back`), scatter-added there,
    weighted, into `out`."""
    plan = handle.plan
    assert handle.recv_order is not None  # checked by combine
    # Back to arrival order, so each source rank gets its rows in the order it sent them: its
    # expert-major send order, and the scatter-add below is then the in-process one, row for
    # row.
    staged.index_copy_(0, handle.recv_order, expert_out)
    collectives.all_to_all(
        as_bytes(back, "combine buffer"),
        as_bytes(staged, "expert_out"),
        plan.send_counts,
        plan.recv_counts,
        "combine",
    )
    out.index_add_(0, plan.token_of_row, back * plan.row_weight)


def caused_by_peer(error: BaseException) -> bool:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, EPPeerFailedError):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False
