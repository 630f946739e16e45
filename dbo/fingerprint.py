"""Collectives fingerprinted across ranks: each rank says what it is about to run, before it runs.

PyTorch's own check (`TORCH_DISTRIBUTED_DEBUG=DETAIL`, which the rank processes of
`dbo.verify_ranks` set) compares each collective's op, shapes and dtypes across ranks. It
cannot tell apart two exchanges of the same shape that mean different things: this step's DP
agreement and the next step's, a padding check and an EP handshake, a user's all_gather and
the runtime's. So in a run this project starts, every `torch.distributed` collective goes
through `CollectiveTracker`, which first exchanges a small fingerprint on the same group (the
collective's op, its *kind*, the step it belongs to, its index among that step's collectives
of that kind, the ubatch issuing it, its shape where shapes must agree) and compares them on
every rank. A rank that is one step behind, skipped a collective or issues another one in its
place is then named on every rank, with each rank's collective, kind, step and the line of
the user's code that called it, as `CollectiveMismatchError`, before anything is left waiting.

A kind is the innermost `collective_kind(...)` around the call (the runtime names its own:
"dp-agreement", "dp-padding-check", "ep-handshake", "ep dispatch", ...) or else the op's name.
Step boundaries (`begin_step`, `finish`) are fingerprinted on the world group too, so a rank
that returned early pairs its next step's start with a peer's collective and is named.

The fingerprint's exchange waits like the collective it precedes: inside `while_waiting(check)`
(`EPGroup` passes its abort-key and timeout check) a failed or missing peer ends it promptly.
`dbo.verify_ranks` and the rank processes of `dbo-sim run --ranks` install a tracker.

Each rank also appends every collective's start and end to its own log file (one JSON object a
line, written at once), so a hung rank's history survives it: `dbo.verification.rank_history` reads
the logs after a timeout and names the first collective where the ranks diverge.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ContextDecorator, contextmanager, nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dbo.collective_calls import (
    BOUNDARY_OP,
    CollectiveCall,
    CollectiveMismatchError,
    as_shape,
    explain,
    user_site,
)
from dbo.devices import current_device
from dbo.ubatching import dbo_current_ubatch_id, dbo_enabled

__all__ = [
    "WRAPPED_OPS",
    "CollectiveTracker",
    "collective_kind",
    "current_tracker",
    "while_waiting",
]

# The torch.distributed collectives a tracker wraps. Point-to-point ops pair by peer, not by
# group order, and are left alone.
WRAPPED_OPS = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
)
# Ops whose input shape must be the same on every rank (all_to_all may split unevenly).
_SAME_SHAPE_OPS = frozenset({"all_reduce", "all_gather", "all_gather_into_tensor", "broadcast"})

_KIND: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "dbo_collective_kind", default=None
)
_ON_WAIT: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar(
    "dbo_fingerprint_on_wait", default=None
)
_POLL_S = 0.001  # the longest sleep between two looks at a waiting exchange
_TRACKER: CollectiveTracker | None = None


class collective_kind(ContextDecorator):  # noqa: N801 - used like a function, as contextlib's are
    """Name what the collectives inside mean, so ranks compare kinds as well as shapes:

        with dbo.collective_kind("moe-allreduce"):
            dist.all_reduce(hidden)

    or `@dbo.collective_kind("dp-agreement")` on a function. Outside a run of
    `dbo.verify_ranks` it only sets a context variable (no communication)."""

    def __init__(self, kind: str) -> None:
        if not isinstance(kind, str) or not kind.strip():
            raise ValueError(f"collective_kind needs a non-empty name, got {kind!r}")
        self.kind = kind
        self._tokens: list[contextvars.Token] = []

    def __enter__(self) -> collective_kind:
        self._tokens.append(_KIND.set(self.kind))
        return self

    def __exit__(self, *exc: object) -> None:
        _KIND.reset(self._tokens.pop())


@contextmanager
def while_waiting(check: Callable[[], None]) -> Iterator[None]:
    """Run `check()` (it raises to stop the wait) while a fingerprint exchange inside waits
    for the peers: a runtime layer with an abort signal of its own keeps it prompt."""
    token = _ON_WAIT.set(check)
    try:
        yield
    finally:
        _ON_WAIT.reset(token)


def current_tracker() -> CollectiveTracker | None:
    """The tracker installed in this process (a rank of `verify_ranks`), or None."""
    return _TRACKER


def _shape(op: str, bound: inspect.BoundArguments) -> tuple[int, ...] | None:
    if op not in _SAME_SHAPE_OPS:
        return None
    name = "input_tensor" if op == "all_gather_into_tensor" else "tensor"
    value = bound.arguments.get(name)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _bookkeeping() -> AbstractContextManager:
    """The fingerprint is no part of the step's device work: on a simulated device its
    tensor ops run unplaced, so that the step's timeline is the same with or without it."""
    suspended = getattr(current_device(), "suspended", None)
    return suspended() if suspended is not None else nullcontext()


def _group_name(group: Any) -> str:
    """The group as the reports name it; unique per group (two groups may hold the same
    ranks), the same on every member."""
    if group is None or group is dist.GroupMember.WORLD:
        return "WORLD"
    return f"{group.group_name} (ranks {dist.get_process_group_ranks(group)})"


def _exchange_device(group: Any) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class CollectiveTracker:
    """Fingerprints and logs every collective of this rank (see the module docstring).
    `install()` routes `torch.distributed`'s collectives through it; one per process."""

    def __init__(self, rank: int, log_path: str | Path | None) -> None:
        self.rank = rank
        self.log_path = None if log_path is None else Path(log_path)
        path = os.devnull if log_path is None else log_path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()
        self.originals: dict[str, Callable] = {}
        self.step, self.step_label = 0, "setup"
        self.seq: dict[str, int] = {}
        self.index: dict[tuple[str, str], int] = {}
        # The first mismatch (what the report names), and each group's: a group whose ranks
        # fell out of step runs no further collective; the others go on.
        self.broken: CollectiveMismatchError | None = None
        self.broken_groups: dict[str, CollectiveMismatchError] = {}
        self.pending_async: list[tuple[int, Any]] = []

    # ---------------------------------------------------------------- setup

    def install(self) -> CollectiveTracker:
        global _TRACKER
        for op in WRAPPED_OPS:
            original = getattr(dist, op)
            self.originals[op] = original
            setattr(dist, op, self._wrap(op, original))
        _TRACKER = self
        return self

    def _wrap(self, op: str, original: Callable) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def tracked(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            return self.run(op, original, bound)

        return tracked

    def log(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, **fields}, default=str) + "\n"
        os.write(self._fd, line.encode())  # one write per line: O_APPEND keeps lines whole

    # ---------------------------------------------------------------- collectives

    def run(self, op: str, original: Callable, bound: inspect.BoundArguments) -> Any:
        group = bound.arguments.get("group")
        if group is not None and dist.get_rank(group) < 0:
            return original(*bound.args, **bound.kwargs)  # not a member: nothing runs here
        call = self._next_call(op, group, _KIND.get() or op, _shape(op, bound))
        self.log("start", **asdict(call))
        self.check(call, group)
        try:
            result = original(*bound.args, **bound.kwargs)
        except RuntimeError as error:
            self.log("failed", seq=call.seq, group=call.group, error=str(error)[:2000])
            raise
        if bound.arguments.get("async_op"):
            with self._lock:
                self.pending_async = [*self.pending_async[-15:], (call.seq, result)]
        self.log("end", seq=call.seq, group=call.group)
        return result

    def _next_call(self, op: str, group: Any, kind: str, shape: Any) -> CollectiveCall:
        name = _group_name(group)
        with self._lock:
            self.seq[name] = self.seq.get(name, 0) + 1
            key = (name, kind)
            self.index[key] = self.index.get(key, 0) + 1
            return CollectiveCall(
                rank=self.rank,
                group=name,
                seq=self.seq[name],
                op=op,
                kind=kind,
                step=self.step,
                step_label=self.step_label,
                index=self.index[key],
                ubatch=dbo_current_ubatch_id() if dbo_enabled() else -1,
                shape=shape,
                site=user_site(),
            )

    def check(self, call: CollectiveCall, group: Any) -> None:
        """Exchange `call`'s fingerprint on `group` and raise `CollectiveMismatchError` on
        every rank when they differ (after one more exchange, of each rank's description)."""
        earlier = self.broken_groups.get(call.group)
        if earlier is not None:
            raise CollectiveMismatchError(
                f"no collective runs on group {call.group} once its ranks are out of step:"
                f"\n{earlier}",
                earlier.calls,
            )
        with _bookkeeping():
            if self._agree(call, group):
                return
            gathered: list[Any] = [None] * dist.get_world_size(group)
            self.originals["all_gather_object"](gathered, asdict(call), group=group)
        calls = [CollectiveCall(**{**c, "shape": as_shape(c["shape"])}) for c in gathered]
        error = CollectiveMismatchError(explain(calls), [asdict(c) for c in calls])
        self.broken = self.broken or error
        self.broken_groups[call.group] = error
        self.log("mismatch", message=str(error), calls=error.calls)
        raise error

    def _agree(self, call: CollectiveCall, group: Any) -> bool:
        """Exchange `call`'s fingerprint row on `group`; whether every rank's is the same."""
        device = _exchange_device(group)
        mine = torch.tensor(call.row(), dtype=torch.int64, device=device)
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        self._wait(self.originals["all_gather"](rows, mine, group=group, async_op=True), device)
        return all(torch.equal(r, rows[0]) for r in rows)

    def _wait(self, work: Any, device: torch.device) -> None:
        """Wait for the fingerprint exchange. Inside `while_waiting(check)` (a runtime layer
        with its own abort signal, such as `EPGroup`'s store key) `check()` runs while it
        waits, and once more if the exchange fails, so that a peer's reported failure ends
        the wait, and explains it, as it would the collective's own."""
        check = _ON_WAIT.get()
        if check is None or device.type == "cuda":
            work.wait()  # NCCL: stream-ordered, bounded by the group's own timeout
            return
        delay = 1e-5
        try:
            while not work.is_completed():
                check()
                time.sleep(delay)
                delay = min(2 * delay, _POLL_S)
            work.wait()
        except RuntimeError:
            check()
            raise

    # ---------------------------------------------------------------- steps

    def begin_step(self, label: str) -> None:
        """Start step `step + 1` (`label` says which run it is): a boundary fingerprinted on
        the world group, so a rank still inside the previous step is named."""
        with self._lock:
            self.step += 1
            self.step_label = label
            self.index.clear()
        self._boundary(f"has begun step {self.step} ({label})")

    def finish(self) -> None:
        """The last boundary: this rank has run every step. Skipped once the group is out of
        step (its peers have stopped communicating too)."""
        with self._lock:
            self.step += 1
            self.step_label = "finished"
        if "WORLD" not in self.broken_groups:
            try:
                self._boundary("has finished every step")
            except CollectiveMismatchError:
                pass  # recorded in broken_groups, and already raised on the peers
            except RuntimeError as error:  # a peer died: the backend's error, in the log
                self.log("failed", seq=self.seq.get("WORLD", 0), group="WORLD", error=str(error))

    def _boundary(self, what: str) -> None:
        call = self._next_call(BOUNDARY_OP, None, what, None)
        self.log("boundary", **asdict(call))
        self.check(call, None)
        self.log("end", seq=call.seq, group=call.group)

    def pending(self) -> list[int]:
        """Sequence numbers of async collectives issued and not completed yet."""
        with self._lock:
            return [seq for seq, work in self.pending_async if not work.is_completed()]
