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

Failure. Every wait for a collective is bounded (`timeout_s`) and, when the group has a `store`,
watches an abort key in it: a rank whose step fails writes its error there (`step()` does this)
and its peers stop waiting within `abort_poll_s`, each raising `EPPeerFailedError` naming the
failed rank. Bad routing (expert ids out of range) travels in the count exchange as -1 counts,
so every rank raises instead of one raising and the rest waiting. After an abort or a timeout a
collective is left half-done, so the group refuses further use: destroy and re-create the
process group. On NCCL a wait is stream-ordered (`work.wait()`), not a host poll, so there the
process group's own timeout bounds a hang. Constructing an `EPGroup` whose `ep_size` is smaller
than its group is itself collective over the whole world (it creates the EP subgroups).

    ep = EPGroup(num_experts=8, ep_size=8)                          # in one process
    plan = ep.prepare(topk_ids, topk_weights, dtype=x.dtype)
    recv = torch.empty(plan.num_recv_rows, hidden)                   # or from the workspace
    d = ep.dispatch(x, topk_ids, topk_weights, plan=plan, out=recv)
    y = ep.combine(experts(d.recv_x, d.recv_expert_ids), d.handle)
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dbo.checks import as_int
from dbo.devices import current_device
from dbo.split import UBatchAgreementError
from dbo.streams import Event
from dbo.ubatching import dbo_current_ubatch_id

__all__ = [
    "MODES",
    "EPError",
    "EPPeerFailedError",
    "EPTimeoutError",
    "EPStepMismatchError",
    "DispatchPlan",
    "EPHandle",
    "DispatchResult",
    "EPGroup",
    "current_ep_group",
    "set_ep_group",
    "use_ep_group",
    "ep_group_for",
]

MODES = ("ht", "ll")


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


# --------------------------------------------------------------------------------------------
# Argument checks


def _as_positive(name: str, value: Any) -> int:
    return as_int(name, value, minimum=1)


def _check_mode(mode: Any) -> str:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return mode


def _check_rows(name: str, t: Any, rows: int | None, cols: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D (rows, hidden), got shape {tuple(t.shape)}")
    if rows is not None and t.shape[0] != rows:
        raise ValueError(f"{name} must have {rows} rows, got shape {tuple(t.shape)}")
    if cols is not None and t.shape[1] != cols:
        raise ValueError(f"{name} must have {cols} columns, got shape {tuple(t.shape)}")
    return t


def _as_bytes(t: torch.Tensor, name: str) -> torch.Tensor:
    """Rows as raw bytes: the collective then needs no support for the dtype (bf16, fp8)."""
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous to be sent across processes")
    return t.view(torch.uint8)


# Abort-key generations, counted per process group (by its name, which every member agrees on).
_GENERATIONS: dict[str, Iterator[int]] = {}
_GENERATIONS_LOCK = threading.Lock()


def _abort_key(pg: Any, members: tuple[int, ...]) -> str:
    """The store key this EP group's aborts go under: its process group's name and how many
    EPGroups this process has built over that group before. The members of a group build their
    EPGroups over it at the same points, so the key agrees across them; a rank outside the
    group is refused before drawing one, and groups it is not in keep their own counts (one
    process-wide count went out of step when a non-member's construction failed)."""
    name = str(getattr(pg, "group_name", "") or ",".join(map(str, members)))
    with _GENERATIONS_LOCK:
        generation = next(_GENERATIONS.setdefault(name, itertools.count()))
    return f"dbo-ep-abort/{name}/{generation}"


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
        self.num_experts = _as_positive("num_experts", num_experts)
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if not (isinstance(abort_poll_s, (int, float)) and abort_poll_s > 0):
            raise ValueError(
                f"abort_poll_s must be a positive number of seconds, got {abort_poll_s!r}"
            )
        self.timeout_s = float(timeout_s)
        self.abort_poll_s = float(abort_poll_s)
        self._store = store
        self._lock = threading.Lock()
        self._step = 0
        self._issued = 0  # collectives issued in the current step
        self._broken: str | None = None
        if group is None:
            self._pg: Any = None
            self.ep_size = 1 if ep_size is None else _as_positive("ep_size", ep_size)
            self.rank = 0
            self._members: tuple[int, ...] = (0,)
            self.backend = "local"
        else:
            self._pg = self._ep_subgroup(group, ep_size)
            self.ep_size = dist.get_world_size(self._pg)
            self.rank = dist.get_rank(self._pg)
            self._members = tuple(dist.get_process_group_ranks(self._pg))
            self.backend = str(dist.get_backend(self._pg))
        if self.num_experts % self.ep_size:
            raise ValueError(
                f"num_experts ({self.num_experts}) must be divisible by ep_size ({self.ep_size}): "
                f"each EP rank owns the same number of experts"
            )
        self.experts_per_rank = self.num_experts // self.ep_size
        # A later EPGroup over the same process group gets a fresh key, so an old abort stays
        # with the group it ended.
        self._abort_key = _abort_key(self._pg, self._members) if self._pg is not None else ""
        # A host poll would turn NCCL's stream-ordered collectives into host syncs.
        self._poll = self._pg is not None and "nccl" not in self.backend

    @staticmethod
    def _ep_subgroup(group: Any, ep_size: int | None) -> Any:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "EPGroup(group=...) needs torch.distributed initialised: call "
                "dist.init_process_group(...) first, or pass group=None to keep every expert in "
                "this process"
            )
        members = dist.get_process_group_ranks(group)
        size = len(members)
        if dist.get_rank(group) < 0:
            raise ValueError("this process is not a member of the given process group")
        ep = size if ep_size is None else _as_positive("ep_size", ep_size)
        if ep > size or size % ep:
            raise ValueError(
                f"ep_size ({ep}) must divide the process group's size ({size}): the group is cut "
                f"into DP x EP blocks of ep_size consecutive ranks"
            )
        if ep == size:
            return group
        backend = dist.get_backend(group)
        mine = None
        me = dist.get_rank()
        # new_group is collective over the world: every process creates every block, in order.
        for start in range(0, size, ep):
            block = members[start : start + ep]
            sub = dist.new_group(block, backend=backend)
            if me in block:
                mine = sub
        return mine

    # ------------------------------------------------------------------------------ facts

    @property
    def is_distributed(self) -> bool:
        return self._pg is not None

    @property
    def global_ranks(self) -> tuple[int, ...]:
        """The world ranks of this EP group's members, in EP rank order."""
        return self._members

    @property
    def local_experts(self) -> range:
        """The experts this rank computes (all of them in one process)."""
        if self._pg is None:
            return range(self.num_experts)
        lo = self.rank * self.experts_per_rank
        return range(lo, lo + self.experts_per_rank)

    def __repr__(self) -> str:
        where = "in-process" if self._pg is None else f"{self.backend} rank {self.rank}"
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
            if not _caused_by_peer(error):  # echoing a peer's failure back would only hide it
                self.abort(f"{type(error).__name__}: {error}")
            raise

    def begin_step(self, num_ubatches: int) -> None:
        """Check that every EP rank runs this step with the same ubatch count (1: no DBO)."""
        n = _as_positive("num_ubatches", num_ubatches)
        self._check_usable()
        with self._lock:
            self._step += 1
            self._issued = 0
        if self._pg is None:
            return
        mine = torch.tensor([n, self._step], dtype=torch.int64, device=self._small_device())
        rows = [torch.empty_like(mine) for _ in range(self.ep_size)]
        work = dist.all_gather(rows, mine, group=self._pg, async_op=True)
        self._wait(work, f"step {self._step}'s handshake")
        table = [row.tolist() for row in rows]
        counts = {self._members[r]: v[0] for r, v in enumerate(table)}
        steps = {self._members[r]: v[1] for r, v in enumerate(table)}
        if len(set(counts.values())) > 1:
            listing = ", ".join(
                f"rank {r}: {c} ubatch{'es' if c != 1 else ''}" for r, c in counts.items()
            )
            most, least = max(counts.values()), min(counts.values())
            raise EPStepMismatchError(
                f"EP ranks disagree on step {self._step}'s ubatching ({listing}). Each ubatch "
                f"issues its own dispatch and combine per layer, so a rank running {most} "
                f"would issue {most} of each per layer where a rank running {least} issues "
                f"{least}, and wait forever for collectives no peer issues; agree first "
                f"(dbo.split.coordinate_ubatching): split on every rank, or on none",
                ubatch_counts=counts,
                steps=steps,
            )
        if len(set(steps.values())) > 1:
            listing = ", ".join(f"rank {r}: step {s}" for r, s in steps.items())
            raise EPStepMismatchError(
                f"EP ranks are at different steps ({listing}): a rank skipped or repeated a "
                f"step, so its collectives would pair with another step's",
                ubatch_counts=counts,
                steps=steps,
            )

    def abort(self, reason: str) -> None:
        """Mark the group failed here and, with a store, tell every peer (first failure wins).
        In one process nothing was left half-done, so the group stays usable."""
        if self._pg is None:
            return
        global_rank = self._members[self.rank]
        self._broken = self._broken or f"rank {global_rank} aborted: {reason}"
        if self._store is not None:
            try:
                self._store.compare_set(self._abort_key, "", f"{global_rank}\n{reason}")
            except Exception:  # noqa: BLE001 - a dead store must not mask the error being raised
                pass

    # ---------------------------------------------------------------------- data movement

    def prepare(
        self,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        dtype: torch.dtype | None = None,
        mode: str = "ht",
    ) -> DispatchPlan:
        """The dispatch layout of `topk_ids` (tokens x top_k expert ids) and, across processes,
        the row counts every rank will send and receive (a collective and one host sync: the
        receive buffer's size depends on them, as in DeepEP's normal mode).

        `dtype` is the dtype the combine weights are applied in (the activations'; default the
        weights' own). Run it where the routing was computed (the compute stream).
        """
        _check_mode(mode)
        if not isinstance(topk_ids, torch.Tensor) or not isinstance(topk_weights, torch.Tensor):
            raise TypeError(
                f"topk_ids and topk_weights must be tensors, got {type(topk_ids).__name__} and "
                f"{type(topk_weights).__name__}"
            )
        if topk_ids.dim() != 2:
            raise ValueError(
                f"topk_ids must be 2-D (tokens, top_k), got shape {tuple(topk_ids.shape)}"
            )
        if topk_ids.is_floating_point() or topk_ids.is_complex() or topk_ids.dtype == torch.bool:
            raise TypeError(f"topk_ids must hold integer expert ids, got dtype {topk_ids.dtype}")
        if topk_weights.shape != topk_ids.shape:
            raise ValueError(
                f"topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}, got "
                f"{tuple(topk_weights.shape)}"
            )
        if not topk_weights.is_floating_point():
            raise TypeError(f"topk_weights must be floating point, got dtype {topk_weights.dtype}")
        t, k = topk_ids.shape
        flat = topk_ids.reshape(-1)
        order = flat.argsort(stable=True)
        token_of_row = order // k
        row_expert = flat[order]
        row_weight = topk_weights.reshape(-1)[order].unsqueeze(1).to(dtype or topk_weights.dtype)
        if self._pg is None:
            return DispatchPlan(t, k, order, token_of_row, row_expert, row_weight, (), (), t * k)
        if topk_ids.is_meta:
            raise ValueError(
                "an EPGroup over a process group moves real data, and meta tensors have none; "
                "run shape-only models with an in-process EPGroup (group=None)"
            )
        send, recv = self._exchange_counts(flat, mode)
        return DispatchPlan(
            t, k, order, token_of_row, row_expert, row_weight, send, recv, sum(recv)
        )

    def _exchange_counts(
        self, flat: torch.Tensor, mode: str
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        w = self.ep_size
        bad = (flat < 0) | (flat >= self.num_experts)
        dest = flat.clamp(0, self.num_experts - 1) // self.experts_per_rank
        send = torch.bincount(dest, minlength=w).to(torch.int64)
        # Bad routing is announced, not raised here: raising before the exchange would leave
        # every peer waiting in it. A -1 count tells each peer to raise as well.
        send = torch.where(bad.any(), torch.full_like(send, -1), send)
        recv = torch.empty_like(send)
        with current_device().comm_region(
            "dispatch_counts", nbytes=2 * w * send.element_size(), mode=mode, ep_size=w
        ) as exchanged:
            self._all_to_all(recv, send, None, None, "dispatch count exchange")
        # The host sizes the receive buffer from these counts, so it waits for them.
        exchanged.event.synchronize()
        values = torch.cat([send, recv]).tolist()
        send_counts, recv_counts = tuple(values[:w]), tuple(values[w:])
        if send_counts[0] < 0:
            raise ValueError(
                f"topk_ids holds expert ids outside [0, {self.num_experts}) on rank "
                f"{self._members[self.rank]}"
            )
        bad_peers = [self._members[r] for r, c in enumerate(recv_counts) if c < 0]
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
        _check_mode(mode)
        _check_rows("x", x, None)
        if plan is None:
            plan = self.prepare(topk_ids, topk_weights, dtype=x.dtype, mode=mode)
        elif not isinstance(plan, DispatchPlan):
            raise TypeError(
                f"plan must be a DispatchPlan from prepare(), got {type(plan).__name__}"
            )
        elif tuple(topk_ids.shape) != (plan.num_tokens, plan.top_k):
            raise ValueError(
                f"topk_ids has shape {tuple(topk_ids.shape)} but the plan was prepared for "
                f"{(plan.num_tokens, plan.top_k)}"
            )
        _check_rows("x", x, plan.num_tokens)
        hidden = x.shape[1]
        if out is None:
            out = torch.empty(plan.num_recv_rows, hidden, dtype=x.dtype, device=x.device)
        else:
            _check_rows("out", out, plan.num_recv_rows, hidden)
            if out.dtype != x.dtype:
                raise TypeError(f"out must have x's dtype {x.dtype}, got {out.dtype}")
        bpe = x.element_size() if bytes_per_elem is None else bytes_per_elem
        handle = EPHandle(plan)
        device = current_device()
        if self._pg is None:
            nbytes = int(plan.num_rows * hidden * bpe * self._remote_share)
            with device.comm_region(
                "dispatch", nbytes=nbytes, mode=mode, ep_size=self.ep_size
            ) as sent:
                torch.index_select(x, 0, plan.token_of_row, out=out)
            recv_ids = plan.row_expert
        else:
            nbytes = int((plan.num_rows - plan.send_counts[self.rank]) * hidden * bpe)
            arrived_ids = torch.empty(
                plan.num_recv_rows, dtype=plan.row_expert.dtype, device=x.device
            )
            arrived = torch.empty(plan.num_recv_rows, hidden, dtype=x.dtype, device=x.device)
            with device.comm_region(
                "dispatch", nbytes=nbytes, mode=mode, ep_size=self.ep_size
            ) as sent:
                rows = x.index_select(0, plan.token_of_row)
                splits = (plan.recv_counts, plan.send_counts)  # (output, input) rows per rank
                self._all_to_all(arrived_ids, plan.row_expert, *splits, "dispatch expert ids")
                self._all_to_all(
                    _as_bytes(arrived, "receive buffer"),
                    _as_bytes(rows, "x rows"),
                    *splits,
                    "dispatch",
                )
                handle.recv_order = arrived_ids.argsort(stable=True)
                recv_ids = arrived_ids[handle.recv_order]
                torch.index_select(arrived, 0, handle.recv_order, out=out)
        handle.dispatch_event = sent.event
        return DispatchResult(out, recv_ids, handle)

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
        _check_mode(mode)
        if not isinstance(handle, EPHandle):
            raise TypeError(
                f"handle must be the EPHandle of a dispatch, got {type(handle).__name__}"
            )
        plan = handle.plan
        _check_rows("expert_out", expert_out, plan.num_recv_rows)
        hidden = expert_out.shape[1]
        if out is None:
            out = torch.zeros(
                plan.num_tokens, hidden, dtype=expert_out.dtype, device=expert_out.device
            )
        else:
            _check_rows("out", out, plan.num_tokens, hidden)
        bpe = expert_out.element_size() if bytes_per_elem is None else bytes_per_elem
        device = current_device()
        if self._pg is None:
            nbytes = int(plan.num_rows * hidden * bpe * self._remote_share)
            with device.comm_region(
                "combine", nbytes=nbytes, mode=mode, ep_size=self.ep_size
            ) as sent:
                out.index_add_(0, plan.token_of_row, expert_out * plan.row_weight)
        else:
            nbytes = int((plan.num_recv_rows - plan.recv_counts[self.rank]) * hidden * bpe)
            if handle.recv_order is None:
                raise ValueError("handle comes from an in-process dispatch, not from this group's")
            staged = torch.empty_like(expert_out, memory_format=torch.contiguous_format)
            back = torch.empty(
                plan.num_rows, hidden, dtype=expert_out.dtype, device=expert_out.device
            )
            with device.comm_region(
                "combine", nbytes=nbytes, mode=mode, ep_size=self.ep_size
            ) as sent:
                # Back to arrival order, so each source rank gets its rows in the order it sent
                # them: its expert-major send order, and the scatter-add below is then the
                # in-process one, row for row.
                staged.index_copy_(0, handle.recv_order, expert_out)
                self._all_to_all(
                    _as_bytes(back, "combine buffer"),
                    _as_bytes(staged, "expert_out"),
                    plan.send_counts,
                    plan.recv_counts,
                    "combine",
                )
                out.index_add_(0, plan.token_of_row, back * plan.row_weight)
        handle.combine_event = sent.event
        return out

    @property
    def _remote_share(self) -> float:
        # In one process the cost model charges the share of rows that would leave the rank.
        return (self.ep_size - 1) / self.ep_size

    # ------------------------------------------------------------------------ collectives

    def _small_device(self) -> torch.device:
        if "nccl" in self.backend:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _all_to_all(
        self,
        output: torch.Tensor,
        inp: torch.Tensor,
        output_splits: Sequence[int] | None,
        input_splits: Sequence[int] | None,
        what: str,
    ) -> None:
        self._check_usable()
        with self._lock:
            self._issued += 1
            where = (
                f"{what} (collective {self._issued} of step {self._step}, ubatch "
                f"{dbo_current_ubatch_id()}) on rank {self._members[self.rank]}"
            )
        # Issued by the ubatch holding the baton and waited for before it yields: this keeps
        # the k-th collective the same on every rank (module docstring, "Ordering").
        try:
            work = dist.all_to_all_single(
                output,
                inp,
                list(output_splits) if output_splits is not None else None,
                list(input_splits) if input_splits is not None else None,
                group=self._pg,
                async_op=True,
            )
        except Exception as error:
            self._broken = f"{where} could not be issued: {error}"
            raise EPError(self._broken) from error
        self._wait(work, where)

    def _wait(self, work: Any, what: str) -> None:
        if not self._poll:
            work.wait()
            return
        start = time.monotonic()
        deadline = start + self.timeout_s
        next_abort_check = start + self.abort_poll_s
        delay = 1e-5
        while not work.is_completed():
            now = time.monotonic()
            if now >= next_abort_check:
                self._raise_if_aborted(what)
                next_abort_check = now + self.abort_poll_s
            if now >= deadline:
                self._raise_if_aborted(what)
                self._broken = f"{what} timed out after {self.timeout_s:g} s"
                raise EPTimeoutError(
                    f"{what} did not complete within {self.timeout_s:g} s: a peer never issued "
                    f"the matching collective (it failed without a store to report it, hangs, "
                    f"or runs a different ubatch count or layer sequence)",
                    what=what,
                )
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
        try:
            work.wait()
        except Exception as error:
            self._raise_if_aborted(what)  # a peer's reported failure explains this one best
            self._broken = f"{what} failed: {error}"
            raise EPError(f"{what} failed: {error}") from error

    def _raise_if_aborted(self, what: str) -> None:
        if self._store is None:
            return
        try:
            if not self._store.check([self._abort_key]):
                return
            payload = self._store.get(self._abort_key).decode(errors="replace")
        except Exception:  # noqa: BLE001 - an unreachable store cannot report an abort
            return
        rank_text, _, reason = payload.partition("\n")
        rank = int(rank_text) if rank_text.lstrip("-").isdigit() else -1
        self._broken = f"peer rank {rank} failed: {reason}"
        raise EPPeerFailedError(
            f"EP rank {rank} failed during the step ({reason}); rank "
            f"{self._members[self.rank]} stopped waiting in {what}",
            rank=rank,
            reason=reason,
        )

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise EPError(
                f"this EP group is unusable after a failed collective ({self._broken}); a "
                f"collective was left half-done, so destroy and re-create the process group"
            )


def _caused_by_peer(error: BaseException) -> bool:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, EPPeerFailedError):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


# --------------------------------------------------------------------------------------------
# The process's EP group (vLLM's get_ep_group())

_CURRENT: EPGroup | None = None
_LOCAL: dict[tuple[int, int], EPGroup] = {}
_REGISTRY_LOCK = threading.Lock()


def current_ep_group() -> EPGroup | None:
    """The EP group set for this process, if any."""
    return _CURRENT


def set_ep_group(ep: EPGroup | None) -> None:
    """Set the process-wide EP group (process-wide: every ubatch thread of a step uses it)."""
    global _CURRENT
    if ep is not None and not isinstance(ep, EPGroup):
        raise TypeError(f"expected an EPGroup or None, got {type(ep).__name__}")
    _CURRENT = ep


@contextmanager
def use_ep_group(ep: EPGroup) -> Iterator[EPGroup]:
    """Make `ep` the process's EP group for the duration of the block."""
    if not isinstance(ep, EPGroup):
        raise TypeError(f"expected an EPGroup, got {type(ep).__name__}")
    previous = _CURRENT
    set_ep_group(ep)
    try:
        yield ep
    finally:
        set_ep_group(previous)


def ep_group_for(num_experts: int, ep_size: int) -> EPGroup:
    """The group a model layer with `num_experts` experts and EP size `ep_size` runs on: the
    process's EP group when one is set (it must match), else an in-process group."""
    ep = _CURRENT
    if ep is not None:
        if ep.num_experts != num_experts or ep.ep_size != ep_size:
            raise ValueError(
                f"the model has {num_experts} experts at ep_size {ep_size}, but the process's EP "
                f"group has {ep.num_experts} experts over {ep.ep_size} ranks; build the model "
                f"config with the group's ep_size"
            )
        return ep
    key = (num_experts, ep_size)
    with _REGISTRY_LOCK:
        local = _LOCAL.get(key)
        if local is None:
            local = _LOCAL[key] = EPGroup(num_experts=num_experts, ep_size=ep_size)
    return local
