"""The torch.distributed path of an EP group: its EP subgroup, its abort key, the step
handshake, and collectives whose every wait is bounded and watches for a peer's abort.

`Collectives` is what an `EPGroup` over a process group holds (one in a single process holds
none). Every wait for a collective is bounded (`timeout_s`) and, when the group has a `store`,
watches an abort key in it: a rank whose step fails writes its error there (`abort`) and its
peers stop waiting within `abort_poll_s`, each raising `EPPeerFailedError` naming the failed
rank. After an abort or a timeout a collective is left half-done, so the collectives refuse
further use (`check_usable`). On NCCL a wait is stream-ordered (`work.wait()`), not a host
poll (which would turn stream-ordered collectives into host syncs), so there the process
group's own timeout bounds a hang.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from dbo.checks import as_int
from dbo.comm.records import EPError, EPPeerFailedError, EPStepMismatchError, EPTimeoutError
from dbo.fingerprint import collective_kind, while_waiting
from dbo.ubatching import dbo_current_ubatch_id

__all__ = ["Collectives", "abort_key", "ep_subgroup"]

# Abort-key generations, counted per process group (by its name, which every member agrees on).
_GENERATIONS: dict[str, Iterator[int]] = {}
_GENERATIONS_LOCK = threading.Lock()


def abort_key(pg: Any, members: tuple[int, ...]) -> str:
    """The store key an EP group's aborts go under: its process group's name and how many
    EPGroups this process has built over that group before. The members of a group build their
    EPGroups over it at the same points, so the key agrees across them; a rank outside the
    group is refused before drawing one, and groups it is not in keep their own counts (one
    process-wide count went out of step when a non-member's construction failed)."""
    name = str(getattr(pg, "group_name", "") or ",".join(map(str, members)))
    with _GENERATIONS_LOCK:
        generation = next(_GENERATIONS.setdefault(name, itertools.count()))
    return f"dbo-ep-abort/{name}/{generation}"


def ep_subgroup(group: Any, ep_size: int | None) -> Any:
    """This rank's EP group within `group`: `group` itself, or, with `ep_size` smaller than
    it, this rank's block of `ep_size` consecutive ranks (world = DP x EP). Creating the
    blocks is collective over the whole world."""
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
    ep = size if ep_size is None else as_int("ep_size", ep_size, minimum=1)
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


class Collectives:
    """The collectives of one EP group over a process group `pg`: `members` are its global
    ranks in EP rank order, `rank` this process's EP rank, `key` its abort key in `store`."""

    def __init__(
        self,
        pg: Any,
        *,
        members: tuple[int, ...],
        rank: int,
        backend: str,
        store: Any,
        timeout_s: float,
        abort_poll_s: float,
        key: str,
    ) -> None:
        self.pg = pg
        self.members = members
        self.rank = rank
        self.backend = backend
        self.store = store
        self.timeout_s = timeout_s
        self.abort_poll_s = abort_poll_s
        self.key = key
        self.poll = "nccl" not in backend  # see the module docstring
        self.broken: str | None = None  # why the group is unusable, once it is
        self.step = 0
        self.issued = 0  # collectives issued in the current step
        self._lock = threading.Lock()

    @classmethod
    def over(cls, pg: Any, *, store: Any, timeout_s: float, abort_poll_s: float) -> Collectives:
        """The collectives of the EP group `pg` (an EP subgroup, see `ep_subgroup`)."""
        members = tuple(dist.get_process_group_ranks(pg))
        return cls(
            pg,
            members=members,
            rank=dist.get_rank(pg),
            backend=str(dist.get_backend(pg)),
            store=store,
            timeout_s=timeout_s,
            abort_poll_s=abort_poll_s,
            # A later EPGroup over the same process group gets a fresh key, so an old abort
            # stays with the group it ended.
            key=abort_key(pg, members),
        )

    @property
    def global_rank(self) -> int:
        return self.members[self.rank]

    def small_device(self) -> torch.device:
        """Where small control tensors (counts, the handshake) live for this backend."""
        if "nccl" in self.backend:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # ---------------------------------------------------------------- steps

    def begin_step(self, num_ubatches: int) -> None:
        """Count a new step, then the handshake: every rank's ubatch count and step number,
        checked on every rank (`EPStepMismatchError`, the same on each, if they differ)."""
        self.check_usable()
        with self._lock:
            self.step += 1
            self.issued = 0
        mine = torch.tensor(
            [num_ubatches, self.step], dtype=torch.int64, device=self.small_device()
        )
        rows = [torch.empty_like(mine) for _ in self.members]
        where = f"step {self.step}'s handshake"
        with self._issuing("ep-handshake", where):
            work = dist.all_gather(rows, mine, group=self.pg, async_op=True)
        self.wait(work, where)
        table = [row.tolist() for row in rows]
        counts = {self.members[r]: v[0] for r, v in enumerate(table)}
        steps = {self.members[r]: v[1] for r, v in enumerate(table)}
        if len(set(counts.values())) > 1:
            listing = ", ".join(
                f"rank {r}: {c} ubatch{'es' if c != 1 else ''}" for r, c in counts.items()
            )
            most, least = max(counts.values()), min(counts.values())
            raise EPStepMismatchError(
                f"EP ranks disagree on step {self.step}'s ubatching ({listing}). Each ubatch "
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
        """Mark the group failed here and, with a store, tell every peer (first failure
        wins)."""
        self.broken = self.broken or f"rank {self.global_rank} aborted: {reason}"
        if self.store is not None:
            try:
                self.store.compare_set(self.key, "", f"{self.global_rank}\n{reason}")
            except Exception:  # noqa: BLE001 - a dead store must not mask the error being raised
                pass

    def check_usable(self) -> None:
        if self.broken is not None:
            raise EPError(
                f"this EP group is unusable after a failed collective ({self.broken}); a "
                f"collective was left half-done, so destroy and re-create the process group"
            )

    # ---------------------------------------------------------------- collectives

    def all_to_all(
        self,
        output: torch.Tensor,
        inp: torch.Tensor,
        output_splits: Sequence[int] | None,
        input_splits: Sequence[int] | None,
        what: str,
    ) -> None:
        """`all_to_all_single` over the group, waited for (bounded) before returning."""
        self.check_usable()
        with self._lock:
            self.issued += 1
            where = (
                f"{what} (collective {self.issued} of step {self.step}, ubatch "
                f"{dbo_current_ubatch_id()}) on rank {self.global_rank}"
            )
        # Issued by the ubatch holding the baton and waited for before it yields: this keeps
        # the k-th collective the same on every rank (dbo.comm's docstring, "Ordering").
        with self._issuing(f"ep {what}", where):
            work = dist.all_to_all_single(
                output,
                inp,
                list(output_splits) if output_splits is not None else None,
                list(input_splits) if input_splits is not None else None,
                group=self.pg,
                async_op=True,
            )
        self.wait(work, where)

    def all_gather_floats(self, values: Sequence[float], what: str) -> list[list[float]]:
        """Every EP rank's `values` (the same length on each), in EP rank order: one bounded
        all_gather of a small float64 tensor on the backend's control device."""
        self.check_usable()
        mine = torch.tensor(list(values), dtype=torch.float64, device=self.small_device())
        rows = [torch.empty_like(mine) for _ in self.members]
        where = f"{what} on rank {self.global_rank}"
        with self._issuing(f"ep {what}", where):
            work = dist.all_gather(rows, mine, group=self.pg, async_op=True)
        self.wait(work, where)
        return [row.tolist() for row in rows]

    @contextmanager
    def _issuing(self, kind: str, where: str) -> Iterator[None]:
        """Issue a collective: named `kind` for the cross-rank fingerprint (`dbo.fingerprint`,
        in runs that install it), whose wait also watches this group's abort key; an issue
        that fails marks the group broken and raises EPError (a peer's reported failure as
        itself)."""
        try:
            with collective_kind(kind), while_waiting(self._watch(where)):
                yield
        except EPError:
            raise  # EPPeerFailedError from the abort key: raise_if_aborted marked the group
        except Exception as error:
            self.broken = f"{where} could not be issued: {error}"
            raise EPError(self.broken) from error

    def _watch(self, what: str) -> Callable[[], None]:
        """What a wait for `what` checks while it waits, as `wait` does: the abort key every
        `abort_poll_s`, and the `timeout_s` bound."""
        start = time.monotonic()
        next_abort_check = [start + self.abort_poll_s]

        def check() -> None:
            now = time.monotonic()
            if now >= next_abort_check[0]:
                self.raise_if_aborted(what)
                next_abort_check[0] = now + self.abort_poll_s
            if now - start >= self.timeout_s:
                self._time_out(what)

        return check

    def wait(self, work: Any, what: str) -> None:
        """Wait for `work` (a collective's handle), at most `timeout_s`, checking the abort
        key every `abort_poll_s`; `what` names the collective in the errors."""
        if not self.poll:
            work.wait()
            return
        start = time.monotonic()
        deadline = start + self.timeout_s
        next_abort_check = start + self.abort_poll_s
        delay = 1e-5
        while not work.is_completed():
            now = time.monotonic()
            if now >= next_abort_check:
                self.raise_if_aborted(what)
                next_abort_check = now + self.abort_poll_s
            if now >= deadline:
                self._time_out(what)
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
        try:
            work.wait()
        except Exception as error:
            self.raise_if_aborted(what)  # a peer's reported failure explains this one best
            self.broken = f"{what} failed: {error}"
            raise EPError(f"{what} failed: {error}") from error

    def _time_out(self, what: str) -> None:
        self.raise_if_aborted(what)
        self.broken = f"{what} timed out after {self.timeout_s:g} s"
        raise EPTimeoutError(
            f"{what} did not complete within {self.timeout_s:g} s: a peer never issued the "
            f"matching collective (it failed without a store to report it, hangs, or runs a "
            f"different ubatch count or layer sequence)",
            what=what,
        )

    def raise_if_aborted(self, what: str) -> None:
        """Raise `EPPeerFailedError` if a peer has written its failure under the abort key."""
        if self.store is None:
            return
        try:
            if not self.store.check([self.key]):
                return
            payload = self.store.get(self.key).decode(errors="replace")
        except Exception:  # noqa: BLE001 - an unreachable store cannot report an abort
            return
        rank_text, _, reason = payload.partition("\n")
        rank = int(rank_text) if rank_text.lstrip("-").isdigit() else -1
        self.broken = f"peer rank {rank} failed: {reason}"
        raise EPPeerFailedError(
            f"EP rank {rank} failed during the step ({reason}); rank {self.global_rank} "
            f"stopped waiting in {what}",
            rank=rank,
            reason=reason,
        )
