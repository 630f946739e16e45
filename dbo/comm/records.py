"""The EP group's records and errors: what a dispatch plan, a handle and a dispatch result
hold, and the ways a collective of the group can fail."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dbo.split import UBatchAgreementError
from dbo.streams import Event

__all__ = [
    "EPError",
    "EPPeerFailedError",
    "EPTimeoutError",
    "EPStepMismatchError",
    "DispatchPlan",
    "EPHandle",
    "DispatchResult",
    "PeerTraffic",
    "checked_counts",
]


# --------------------------------------------------------------------------------------------
# Errors


class EPError(RuntimeError):
    """A collective of the EP group did not complete; the group is unusable afterwards."""


class EPPeerFailedError(EPError):
    """Another EP rank's step failed (`rank`, a global rank; `reason`, its error)."""

    def __init__(self, message: str, *, rank: int, reason: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.reason = reason


class EPTimeoutError(EPError):
    """A collective did not complete within the group's `timeout_s`; `what` names it."""

    def __init__(self, message: str, *, what: str) -> None:
        super().__init__(message)
        self.what = what


class EPStepMismatchError(UBatchAgreementError):
    """EP ranks entered a step with different ubatch counts or at different steps. Raised on
    every rank with the same message, before any of the step's data moves; the group stays
    usable. `ubatch_counts` and `steps` are keyed by global rank."""

    def __init__(
        self, message: str, *, ubatch_counts: dict[int, int], steps: dict[int, int]
    ) -> None:
        super().__init__(message)
        self.ubatch_counts = ubatch_counts
        self.steps = steps


# --------------------------------------------------------------------------------------------
# Records


@dataclass(frozen=True, eq=False)
class DispatchPlan:
    """Where each routed (token, top-k slot) row goes: the layout of one dispatch.

    Send rows are expert-major (stable, so ties keep token order): row i carries token
    `token_of_row[i]` to expert `row_expert[i]`, weighted by `row_weight[i]` on the way back.
    `send_counts[r]` / `recv_counts[r]` are the rows sent to / received from EP rank r (empty in
    one process, where no counts are needed and reading them would cost a host sync).
    """

    num_tokens: int
    top_k: int
    order: torch.Tensor  # (T*k,) flat index (token * k + slot) of each send row
    token_of_row: torch.Tensor  # (T*k,)
    row_expert: torch.Tensor  # (T*k,), non-decreasing
    row_weight: torch.Tensor  # (T*k, 1)
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    num_recv_rows: int

    @property
    def num_rows(self) -> int:
        """Rows this rank sends: one per (token, top-k slot)."""
        return self.num_tokens * self.top_k


@dataclass(eq=False)
class EPHandle:
    """What combine needs from a dispatch (DeepEP's `handle`), and the arrival events: each
    transfer's `comm_region` event, for a low-latency recv hook to wait on. `recv_order[i]`
    is the arrival position of received row i (None in one process, where rows arrive in
    expert-major order already)."""

    plan: DispatchPlan
    recv_order: torch.Tensor | None = None
    dispatch_event: Event | None = None
    combine_event: Event | None = None


@dataclass(frozen=True, eq=False)
class DispatchResult:
    """This rank's received rows (`recv_x`, expert-major), the global expert id of each
    (non-decreasing), and the handle."""

    recv_x: torch.Tensor
    recv_expert_ids: torch.Tensor
    handle: EPHandle

    @property
    def event(self) -> Event | None:
        """Arrival of the dispatch (what a low-latency recv hook waits for)."""
        return self.handle.dispatch_event


@dataclass(frozen=True, eq=False)
class PeerTraffic:
    """What a simulated device needs to couple one all-to-all's virtual time across processes
    (`Device.comm_region(peers=...)`): this EP rank, the bytes it sends each EP rank (as the
    cost model charges them), and `exchange`, an all_gather over the EP group of a few floats
    per rank (every rank's list, in EP rank order)."""

    rank: int
    send_bytes: tuple[float, ...]
    exchange: Callable[[Sequence[float]], list[list[float]]]


def checked_counts(counts: Any, ep_size: int, rows: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(send, recv) row counts per EP rank given to `EPGroup.prepare`, checked on the host."""
    send, recv = (tuple(int(c) for c in side) for side in counts)
    if len(send) != ep_size or len(recv) != ep_size or min(send + recv) < 0:
        raise ValueError(f"counts must be two lists of {ep_size} non-negative row counts")
    if sum(send) != rows:
        raise ValueError(f"send counts sum to {sum(send)}, but topk_ids routes {rows} rows")
    return send, recv
