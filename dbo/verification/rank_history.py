"""A hang explained: every rank's collective history, compared after the group timed out.

Each rank's `CollectiveTracker` logged every collective it started and finished (to a file, so the
log survives a rank that never returns); the launcher also asked each hung rank for its threads'
positions and PyTorch's flight-recorder entries (`dbo.verification.rank_processes`). From those
this module names the first collective where the ranks' histories diverge, which ranks wait in
what, and where each was called from.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from dbo.collective_calls import BOUNDARY_OP, CollectiveCall, read_log

__all__ = ["RankHistory", "explain_hang", "read_histories"]

_CALL_FIELDS = tuple(f.name for f in fields(CollectiveCall))


@dataclass
class RankHistory:
    """One rank's collectives in the order it issued them, which of them completed, and what
    its dump and exit code say."""

    rank: int
    calls: list[CollectiveCall]
    completed: set[tuple[str, int]]
    exit_code: int | None  # None: killed by the launcher
    dump: dict[str, Any] | None

    def waiting_in(self) -> CollectiveCall | None:
        """The collective this rank started and never finished (or whose async work is still
        pending), if any."""
        pending = set((self.dump or {}).get("pending_async", []))
        for call in reversed(self.calls):
            if (call.group, call.seq) not in self.completed or call.seq in pending:
                return call
        return None


def _call(event: dict[str, Any]) -> CollectiveCall:
    values = {k: event[k] for k in _CALL_FIELDS}
    values["shape"] = None if values["shape"] is None else tuple(values["shape"])
    return CollectiveCall(**values)


def read_histories(
    workdir: Path, exit_codes: list[int | None], dumps: dict[int, dict[str, Any]]
) -> list[RankHistory]:
    histories = []
    for rank, code in enumerate(exit_codes):
        calls, completed = [], set()
        for event in read_log(workdir / f"rank{rank}.log.jsonl"):
            if event["event"] in ("start", "boundary"):
                calls.append(_call(event))
            elif event["event"] == "end":
                completed.add((event["group"], event["seq"]))
        histories.append(RankHistory(rank, calls, completed, code, dumps.get(rank)))
    return histories


def _key(call: CollectiveCall) -> tuple:
    return (call.group, call.op, call.kind, call.step, call.index, call.ubatch, call.shape)


def first_divergence(histories: list[RankHistory]) -> int | None:
    """The index of the first collective the ranks' histories disagree on (one rank issued
    another, or none), or None when they issued the same ones."""
    longest = max(len(h.calls) for h in histories)
    for i in range(longest):
        keys = {(_key(h.calls[i]) if i < len(h.calls) else None) for h in histories}
        if len(keys) > 1:
            return i
    return None


def explain_hang(histories: list[RankHistory]) -> list[str]:
    """The hang in lines: where the histories diverge, then where each rank stands."""
    lines = []
    i = first_divergence(histories)
    if i is None:
        count = len(histories[0].calls)
        lines.append(f"every rank issued the same {count} collective(s); none diverged")
    else:
        lines.append(f"the ranks diverge at their collective #{i + 1}:")
        for h in histories:
            if i < len(h.calls):
                lines.append(f"  {h.calls[i].describe()}")
            else:
                last = (
                    f"; its last was {h.calls[-1].describe()[len(f'rank {h.rank}: ') :]}"
                    if h.calls
                    else ""
                )
                lines.append(f"  rank {h.rank}: issued no collective #{i + 1}{last}")
    lines += [_standing(h) for h in histories]
    return lines


def _standing(h: RankHistory) -> str:
    """Where one rank stands: in a collective, elsewhere (its threads), or ended."""
    if h.exit_code is not None:
        return f"rank {h.rank} ended (exit {h.exit_code})"
    waiting = h.waiting_in()
    threads = (h.dump or {}).get("threads", {})
    fr = _flight_recorder_line(h)
    if waiting is not None and waiting.op == BOUNDARY_OP:
        text = f"rank {h.rank} {waiting.kind} and waits for its peers to say so too"
    elif waiting is not None:
        text = f"rank {h.rank} waits in {waiting.op} ('{waiting.kind}', step {waiting.step}) "
        text += f"called at {waiting.site}"
    elif h.dump is None:
        text = f"rank {h.rank} is in no collective and did not answer the dump request"
    else:
        text = f"rank {h.rank} is in no collective"
    where = [f"{name} at {site}" for name, site in threads.items()]
    if where:
        text += f"; its threads in the user's code: {'; '.join(where[:3])}"
    return text + fr


def _flight_recorder_line(h: RankHistory) -> str:
    entries = (h.dump or {}).get("flight_recorder") or []
    if not entries:
        return ""
    last = entries[-1]
    done = "completed" if last.get("retired") else "not completed"
    return (
        f"; flight recorder: last {last.get('profiling_name')} "
        f"#{last.get('collective_seq_id')} {done}"
    )
