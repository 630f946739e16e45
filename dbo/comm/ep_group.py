"""Expert-parallel dispatch and combine: send each routed token row to the rank that owns its
expert, and bring the expert outputs back, weighted, onto their tokens.

The names are the ones engine developers know: `prepare` is DeepEP's `get_dispatch_layout`
(plus its count notification) and the first half of vLLM's prepare/finalize; `dispatch` and
`combine` are DeepEP's, and `combine` is vLLM's finalize. One `EPGroup`, two transports:

- **In one process** (`group=None`, the default): the process holds every expert and simulates
  `ep_size` EP ranks for the cost model. Dispatch is a permutation of the token rows into the
  expert-major receive buffer; combine is the weighted scatter-add of the expert outputs back
  onto their tokens.
- **Across processes** (`group=` a torch.distributed process group: gloo on CPU, NCCL on CUDA):
  experts are sharded by rank, rank r owning [r*E/W, (r+1)*E/W). `prepare` exchanges how many
  rows each rank sends each other rank (one all_to_all of a W-entry int tensor) and reads the
  counts on the host; `dispatch` moves the rows and their expert ids with `all_to_all_single`
  and those split sizes; `combine` moves the expert outputs back with the splits reversed and
  scatter-adds them, weighted, on the rank that owns the tokens.

Because experts are sharded in contiguous ranges, the expert-major order of a rank's rows is
also destination-rank-major: one `argsort` gives both the send layout and, once the outputs
come back in the same order, the combine layout. Rows arrive source-rank-major; dispatch
reorders them expert-major (stable, so source order is kept within an expert), the layout a
grouped GEMM wants, and combine undoes that before sending the outputs back. In both
transports `recv_expert_ids` is therefore non-decreasing.
Both modes, "ht" (high-throughput: issued on the current stream, normally the comm stream) and
"ll" (low-latency: sent from the current stream; the handle's event marks arrival and a recv
hook waits on it), move the same bytes and give the same values; they differ only in where the
simulated device places the transfer. Each transfer is one `device.comm_region(...)`.

Virtual time across processes: each transfer's comm region carries its peers (`PeerTraffic`);
a simulated device exchanges its start and bytes with them (one small all_gather) and ends it
when every peer's rows have arrived (`dbo.sim.alltoall`), so the ranks' clocks wait for each
other at every collective as the one-process EP group's do (`dbo.sim.cluster`).

Ordering across ranks (why nothing deadlocks). A collective pairs the k-th call on each rank of
the group, whoever issues it. Every rank runs the same ubatch ring, with the same ubatch count,
the same layers and the same yield points, and each collective is issued and completed by the
ubatch that holds the baton (no thread yields with one in flight). So the k-th collective of a
step is, on every rank, the same ubatch's same prepare/dispatch/combine of the same layer. A
rank that issued one out of that order, or ran a different ubatch count, would pair it with a
different ubatch's collective elsewhere: mismatched sizes, data silently crossing ubatches
(exchanged split sizes make many such pairings look consistent), and at the end a rank waiting
for a collective no peer will issue. Hence `step()`'s handshake: an all_gather of every rank's
ubatch count (and step number) before the step's first collective, checked on every rank.

Failure (the torch.distributed path is `dbo.comm.collectives`, its data movement
`dbo.comm.across`; the records and errors are `dbo.comm.records`, all importable from
`dbo.comm`). Every wait for a collective is bounded
(`timeout_s`) and, when the group has a `store`, watches an abort key in it: a rank whose step
fails writes its error there (`step()` does this) and its peers stop waiting within
`abort_poll_s`, each raising `EPPeerFailedError` naming the failed rank. Bad routing (expert
ids out of range) travels in the count exchange as -1 counts, so every rank raises instead of
one raising and the rest waiting. After an abort or a timeout a collective is left half-done,
so the group refuses further use: destroy and re-create the process group. On NCCL a wait is
stream-ordered (`work.wait()`), not a host poll, so there the process group's own timeout
bounds a hang. Constructing an `EPGroup` whose `ep_size` is smaller than its group is itself
collective over the whole world (it creates the EP subgroups).

    ep = EPGroup(num_experts=8, ep_size=8)                          # in one process
    plan = ep.prepare(topk_ids, topk_weights, dtype=x.dtype)
    recv = torch.empty(plan.num_recv_rows, hidden)                   # or from the workspace
    d = ep.dispatch(x, topk_ids, topk_weights, plan=plan, out=recv)
    y = ep.combine(experts(d.recv_x, d.recv_expert_ids), d.handle)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from dbo.comm.across import caused_by_peer, combine_across, dispatch_across
from dbo.comm.checks import (
    MODES,
    as_positive,
    check_mode,
    check_plan,
    check_routing,
    check_rows,
    positive_seconds,
)
from dbo.comm.collectives import Collectives, ep_subgroup
from dbo.comm.records import (
    DispatchPlan,
    DispatchResult,
    EPHandle,
    PeerTraffic,
    checked_counts,
)
from dbo.devices import current_device
from dbo.streams import CommHandle

__all__ = ["MODES", "EPGroup"]  # the records and errors: dbo.comm.records

# --------------------------------------------------------------------------------------------
# The group


class EPGroup:
    """An expert-parallel group: who owns which experts, and the dispatch/combine between them.

    `group=None` keeps everything in this process (simulating `ep_size` ranks, default 1);
    a process group (or `dist.group.WORLD`) moves data between its ranks. With `ep_size`
    smaller than the group, the group is cut into consecutive blocks of `ep_size` ranks
    (world = DP x EP) and this rank's block is its EP group. `store` (a `torch.distributed`
    Store shared by the ranks) carries aborts; `timeout_s` bounds every wait.
    """

    def __init__(
        self,
        group: Any = None,
        *,
        num_experts: int,
        ep_size: int | None = None,
        store: Any = None,
        timeout_s: float = 60.0,
        abort_poll_s: float = 0.02,
    ) -> None:
        self.num_experts = as_positive("num_experts", num_experts)
        self.timeout_s = positive_seconds("timeout_s", timeout_s)
        self.abort_poll_s = positive_seconds("abort_poll_s", abort_poll_s)
        # The torch.distributed path (None in one process): made below, once the arguments
        # are known to be good, so that a refused group draws no abort key.
        self.collectives: Collectives | None = None
        pg: Any = None
        if group is None:
            self.ep_size = 1 if ep_size is None else as_positive("ep_size", ep_size)
            self.rank = 0
            self.backend = "local"
        else:
            pg = ep_subgroup(group, ep_size)
            self.ep_size = dist.get_world_size(pg)
            self.rank = dist.get_rank(pg)
            self.backend = str(dist.get_backend(pg))
        if self.num_experts % self.ep_size:
            raise ValueError(
                f"num_experts ({self.num_experts}) must be divisible by ep_size ({self.ep_size}): "
                f"each EP rank owns the same number of experts"
            )
        self.experts_per_rank = self.num_experts // self.ep_size
        if pg is not None:
            self.collectives = Collectives.over(
                pg, store=store, timeout_s=self.timeout_s, abort_poll_s=self.abort_poll_s
            )

    # ------------------------------------------------------------------------------ facts

    @property
    def is_distributed(self) -> bool:
        return self.collectives is not None

    @property
    def global_ranks(self) -> tuple[int, ...]:
        """The world ranks of this EP group's members, in EP rank order."""
        return (0,) if self.collectives is None else self.collectives.members

    @property
    def local_experts(self) -> range:
        """The experts this rank computes (all of them in one process)."""
        if self.collectives is None:
            return range(self.num_experts)
        lo = self.rank * self.experts_per_rank
        return range(lo, lo + self.experts_per_rank)

    def __repr__(self) -> str:
        where = "in-process" if self.collectives is None else f"{self.backend} rank {self.rank}"
        return f"<EPGroup {where}, ep_size={self.ep_size}, num_experts={self.num_experts}>"

    # ------------------------------------------------------------------------------ steps

    @contextmanager
    def step(self, num_ubatches: int) -> Iterator[None]:
        """One engine step: the handshake first, then the block; if the block fails, tell peers.

        The handshake raises `EPStepMismatchError` on every rank when ubatch counts differ (it
        is symmetric, so no abort is needed). Any other failure is written to the store so that
        peers waiting in a collective end with `EPPeerFailedError` instead of hanging.
        """
        self.begin_step(num_ubatches)
        try:
            yield
        except BaseException as error:
            if not caused_by_peer(error):  # echoing a peer's failure back would only hide it
                self.abort(f"{type(error).__name__}: {error}")
            raise

    def begin_step(self, num_ubatches: int) -> None:
        """Check that every EP rank runs this step with the same ubatch count (1: no DBO)."""
        n = as_positive("num_ubatches", num_ubatches)
        if self.collectives is not None:
            self.collectives.begin_step(n)

    def abort(self, reason: str) -> None:
        """Mark the group failed here and, with a store, tell every peer (first failure wins).
        In one process nothing was left half-done, so the group stays usable."""
        if self.collectives is not None:
            self.collectives.abort(reason)

    # ---------------------------------------------------------------------- data movement

    def prepare(
        self,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        dtype: torch.dtype | None = None,
        mode: str = "ht",
        counts: tuple[Sequence[int], Sequence[int]] | None = None,
    ) -> DispatchPlan:
        """The dispatch layout of `topk_ids` (tokens x top_k expert ids) and, across processes,
        the row counts every rank will send and receive (a collective and one host sync: the
        receive buffer's size depends on them, as in DeepEP's normal mode).

        `dtype` is the dtype the combine weights are applied in (the activations'; default the
        weights' own). Run it where the routing was computed (the compute stream). `counts`
        = (rows sent to, rows received from each EP rank), when every rank knows the routing
        in advance (a seeded routing): then nothing is exchanged; wrong counts fail the
        dispatch's collective on every rank. Ignored in one process.
        """
        check_mode(mode)
        check_routing(topk_ids, topk_weights)
        # The layout: the (token, k) rows sorted by expert, so each owner's rows are one run.
        t, k = topk_ids.shape
        flat = topk_ids.reshape(-1)
        order = flat.argsort(stable=True)
        token_of_row = order // k
        row_expert = flat[order]
        row_weight = topk_weights.reshape(-1)[order].unsqueeze(1).to(dtype or topk_weights.dtype)
        if self.collectives is None:
            return DispatchPlan(t, k, order, token_of_row, row_expert, row_weight, (), (), t * k)
        send, recv = self._row_counts(self.collectives, flat, mode, counts)
        return DispatchPlan(
            t, k, order, token_of_row, row_expert, row_weight, send, recv, sum(recv)
        )

    def _row_counts(
        self,
        collectives: Collectives,
        flat: torch.Tensor,
        mode: str,
        counts: tuple[Sequence[int], Sequence[int]] | None,
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(rows sent to, rows received from) each EP rank: the caller's `counts` checked, or
        exchanged with the peers."""
        if flat.is_meta:
            raise ValueError(
                "an EPGroup over a process group moves real data, and meta tensors have none; "
                "run shape-only models with an in-process EPGroup (group=None)"
            )
        if counts is not None:
            return checked_counts(counts, self.ep_size, flat.numel())
        return self._exchange_counts(collectives, flat, mode)

    def _exchange_counts(
        self, collectives: Collectives, flat: torch.Tensor, mode: str
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        w = self.ep_size
        bad = (flat < 0) | (flat >= self.num_experts)
        dest = flat.clamp(0, self.num_experts - 1) // self.experts_per_rank
        send = torch.bincount(dest, minlength=w).to(torch.int64)
        # Bad routing is announced, not raised here: raising before the exchange would leave
        # every peer waiting in it. A -1 count tells each peer to raise as well.
        send = torch.where(bad.any(), torch.full_like(send, -1), send)
        recv = torch.empty_like(send)
        peers = self._peers([send.element_size()] * w, "dispatch count exchange")
        with current_device().comm_region(
            "dispatch_counts",
            nbytes=2 * w * send.element_size(),
            mode=mode,
            ep_size=w,
            peers=peers,
        ) as exchanged:
            collectives.all_to_all(recv, send, None, None, "dispatch count exchange")
        # The host sizes the receive buffer from these counts, so it waits for them.
        exchanged.event.synchronize()
        values = torch.cat([send, recv]).tolist()
        send_counts, recv_counts = tuple(values[:w]), tuple(values[w:])
        if send_counts[0] < 0:
            raise ValueError(
                f"topk_ids holds expert ids outside [0, {self.num_experts}) on rank "
                f"{collectives.global_rank}"
            )
        bad_peers = [collectives.members[r] for r, c in enumerate(recv_counts) if c < 0]
        if bad_peers:
            raise ValueError(
                f"EP rank(s) {bad_peers} routed tokens to expert ids outside "
                f"[0, {self.num_experts}) (see the error raised there)"
            )
        return send_counts, recv_counts

    def dispatch(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        plan: DispatchPlan | None = None,
        out: torch.Tensor | None = None,
        mode: str = "ht",
        bytes_per_elem: float | None = None,
    ) -> DispatchResult:
        """Send each token's row to the owners of its top-k experts.

        `plan` (from `prepare`) lets the caller size `out`, the receive buffer
        (`plan.num_recv_rows` x hidden), before dispatching. `bytes_per_elem` is what the
        cost model charges per element sent (DeepEP sends FP8: 1), default x's element size.
        """
        check_mode(mode)
        check_rows("x", x, None)
        if plan is None:
            plan = self.prepare(topk_ids, topk_weights, dtype=x.dtype, mode=mode)
        else:
            check_plan(plan, topk_ids)
        check_rows("x", x, plan.num_tokens)
        out = _receive_buffer(out, x, plan.num_recv_rows)
        bpe = x.element_size() if bytes_per_elem is None else bytes_per_elem
        handle = EPHandle(plan)
        if self.collectives is None:
            sent, recv_ids = self._dispatch_in_process(x, plan, out, mode, bpe)
        else:
            sent, recv_ids = self._dispatch_across(self.collectives, x, handle, out, mode, bpe)
        handle.dispatch_event = sent.event
        return DispatchResult(out, recv_ids, handle)

    def _dispatch_in_process(
        self, x: torch.Tensor, plan: DispatchPlan, out: torch.Tensor, mode: str, bpe: float
    ) -> tuple[CommHandle, torch.Tensor]:
        """Every row gathered here; the comm op is priced for the share that would leave."""
        nbytes = int(plan.num_rows * x.shape[1] * bpe * self._remote_share)
        with current_device().comm_region(
            "dispatch", nbytes=nbytes, mode=mode, ep_size=self.ep_size
        ) as sent:
            torch.index_select(x, 0, plan.token_of_row, out=out)
        return sent, plan.row_expert

    def _dispatch_across(
        self,
        collectives: Collectives,
        x: torch.Tensor,
        handle: EPHandle,
        out: torch.Tensor,
        mode: str,
        bpe: float,
    ) -> tuple[CommHandle, torch.Tensor]:
        """The rows sent to their owners over the process group (the rows a rank keeps cost
        no transfer); the received rows' expert ids come back with them."""
        plan, hidden = handle.plan, x.shape[1]
        nbytes = int((plan.num_rows - plan.send_counts[self.rank]) * hidden * bpe)
        arrived_ids = torch.empty(plan.num_recv_rows, dtype=plan.row_expert.dtype, device=x.device)
        arrived = torch.empty(plan.num_recv_rows, hidden, dtype=x.dtype, device=x.device)
        peers = self._peers([c * hidden * bpe for c in plan.send_counts], "dispatch")
        with current_device().comm_region(
            "dispatch", nbytes=nbytes, mode=mode, ep_size=self.ep_size, peers=peers
        ) as sent:
            recv_ids = dispatch_across(collectives, x, handle, out, arrived_ids, arrived)
        return sent, recv_ids

    def combine(
        self,
        expert_out: torch.Tensor,
        handle: EPHandle,
        *,
        out: torch.Tensor | None = None,
        mode: str = "ht",
        bytes_per_elem: float | None = None,
    ) -> torch.Tensor:
        """Bring the expert outputs (one row per received row, in `recv_x`'s order) back to
        their tokens and add them, each times its router weight, into `out` (default: zeros of
        tokens x hidden). Returns `out`; `handle.combine_event` marks its arrival."""
        check_mode(mode)
        if not isinstance(handle, EPHandle):
            raise TypeError(
                f"handle must be the EPHandle of a dispatch, got {type(handle).__name__}"
            )
        plan = handle.plan
        check_rows("expert_out", expert_out, plan.num_recv_rows)
        hidden = expert_out.shape[1]
        if out is None:
            out = torch.zeros(
                plan.num_tokens, hidden, dtype=expert_out.dtype, device=expert_out.device
            )
        else:
            check_rows("out", out, plan.num_tokens, hidden)
        bpe = expert_out.element_size() if bytes_per_elem is None else bytes_per_elem
        if self.collectives is None:
            sent = self._combine_in_process(expert_out, plan, out, mode, bpe)
        else:
            sent = self._combine_across(self.collectives, expert_out, handle, out, mode, bpe)
        handle.combine_event = sent.event
        return out

    def _combine_in_process(
        self, expert_out: torch.Tensor, plan: DispatchPlan, out: torch.Tensor, mode: str, bpe: float
    ) -> CommHandle:
        """Every row added back here; the comm op is priced for the share that would arrive
        from other ranks."""
        nbytes = int(plan.num_rows * expert_out.shape[1] * bpe * self._remote_share)
        with current_device().comm_region(
            "combine", nbytes=nbytes, mode=mode, ep_size=self.ep_size
        ) as sent:
            out.index_add_(0, plan.token_of_row, expert_out * plan.row_weight)
        return sent

    def _combine_across(
        self,
        collectives: Collectives,
        expert_out: torch.Tensor,
        handle: EPHandle,
        out: torch.Tensor,
        mode: str,
        bpe: float,
    ) -> CommHandle:
        """The rows sent back to their tokens' ranks over the process group and added there."""
        plan, hidden = handle.plan, expert_out.shape[1]
        nbytes = int((plan.num_recv_rows - plan.recv_counts[self.rank]) * hidden * bpe)
        if handle.recv_order is None:
            raise ValueError("handle comes from an in-process dispatch, not from this group's")
        staged = torch.empty_like(expert_out, memory_format=torch.contiguous_format)
        back = torch.empty(plan.num_rows, hidden, dtype=expert_out.dtype, device=expert_out.device)
        peers = self._peers([c * hidden * bpe for c in plan.recv_counts], "combine")
        with current_device().comm_region(
            "combine", nbytes=nbytes, mode=mode, ep_size=self.ep_size, peers=peers
        ) as sent:
            combine_across(collectives, expert_out, handle, out, staged, back)
        return sent

    def _peers(self, send_bytes: Sequence[float], what: str) -> PeerTraffic:
        """A transfer's peers, for a simulated device to couple its virtual time to theirs."""
        collectives = self.collectives
        assert collectives is not None

        def exchange(values: Sequence[float]) -> list[list[float]]:
            return collectives.all_gather_floats(values, f"{what}'s virtual-time exchange")

        return PeerTraffic(self.rank, tuple(float(b) for b in send_bytes), exchange)

    @property
    def _remote_share(self) -> float:
        # In one process the cost model charges the share of rows that would leave the rank.
        return (self.ep_size - 1) / self.ep_size


def _receive_buffer(out: torch.Tensor | None, x: torch.Tensor, rows: int) -> torch.Tensor:
    """The dispatch's receive buffer: the caller's `out` (rows x hidden, x's dtype), checked,
    or a new one."""
    hidden = x.shape[1]
    if out is None:
        return torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    check_rows("out", out, rows, hidden)
    if out.dtype != x.dtype:
        raise TypeError(f"out must have x's dtype {x.dtype}, got {out.dtype}")
    return out
