"""What one rank's collective is, as its fingerprint carries it, and why two do not pair.

`CollectiveCall` is one rank's collective (or step boundary) as `dbo.fingerprint`'s tracker
records, exchanges and logs it; `explain` says in words why the calls of the ranks of a group,
one each, cannot be the same collective; `user_site` finds the line of the user's code that
issued it. No communication happens here: these are the records and the words.
"""

from __future__ import annotations

import inspect
import json
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import torch

__all__ = [
    "BOUNDARY_OP",
    "CollectiveCall",
    "CollectiveMismatchError",
    "as_shape",
    "explain",
    "read_log",
    "user_site",
]

BOUNDARY_OP = "step boundary"
_OWN_DIRS = (
    str(Path(__file__).resolve().parent),  # dbo/
    str(Path(torch.__file__).resolve().parent),
    str(Path(threading.__file__).resolve().parent),  # the standard library
)


def user_site(frame: FrameType | None = None, stop: CodeType | None = None) -> str:
    """`file.py:line:function` of the innermost frame of the user's code (outside dbo/, torch
    and the standard library) in the stack of `frame` (default: the caller's), looking no
    further out than a frame running `stop`; "unknown" when none is the user's."""
    frame = frame or inspect.currentframe()
    while frame is not None and frame.f_code is not stop:
        path = str(Path(frame.f_code.co_filename).resolve())
        if not path.startswith(_OWN_DIRS):
            return f"{Path(path).name}:{frame.f_lineno}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "unknown"


@dataclass(frozen=True)
class CollectiveCall:
    """One rank's collective (or step boundary), as fingerprinted and logged."""

    rank: int
    group: str
    seq: int  # this rank's count of fingerprinted calls on the group
    op: str
    kind: str
    step: int
    step_label: str
    index: int  # 1 for the step's first collective of this kind on this group
    ubatch: int  # -1 outside a ubatch
    shape: tuple[int, ...] | None  # compared only for ops whose shapes must agree
    site: str

    def describe(self) -> str:
        if self.op == BOUNDARY_OP:
            return f"rank {self.rank}: {self.kind}"
        ubatch = f", ubatch {self.ubatch}" if self.ubatch >= 0 else ""
        shape = f", shape {list(self.shape)}" if self.shape is not None else ""
        return (
            f"rank {self.rank}: {self.op}, kind '{self.kind}', step {self.step} "
            f"({self.step_label}) #{self.index} of its kind{ubatch}{shape}, at {self.site}"
        )

    def row(self) -> list[int]:
        """The fingerprint on the wire: every field the ranks must agree on, as int64."""
        shape = zlib.crc32(repr(self.shape).encode()) if self.shape is not None else 0
        return [
            int(self.op == BOUNDARY_OP),
            zlib.crc32(self.op.encode()),
            zlib.crc32(self.kind.encode()),
            self.step,
            self.index,
            self.ubatch,
            shape,
        ]


class CollectiveMismatchError(RuntimeError):
    """Ranks were about to run collectives that do not pair. Raised on every rank of the
    group with the same message; `calls` holds each rank's `CollectiveCall` as a dict."""

    def __init__(self, message: str, calls: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.calls = calls


def explain(calls: list[CollectiveCall]) -> str:
    """Why these calls, one per rank, do not pair: the cause in words, then each rank."""
    first = calls[0]
    odd = [c for c in calls if c.row() != first.row()]
    other = odd[0] if odd else first
    cause = _cause(first, other)
    lines = [f"ranks out of step on group {first.group}: {cause}"]
    lines += [f"  {c.describe()}" for c in calls]
    return "\n".join(lines)


def _cause(a: CollectiveCall, b: CollectiveCall) -> str:
    if (a.op == BOUNDARY_OP) != (b.op == BOUNDARY_OP):
        done, busy = (a, b) if a.op == BOUNDARY_OP else (b, a)
        return (
            f"rank {done.rank} {done.kind} while rank {busy.rank} still calls {busy.op} "
            f"('{busy.kind}') in step {busy.step}: rank {done.rank} skipped that collective "
            f"(an idle rank that returned early, a dummy run missing a layer's collective) or "
            f"rank {busy.rank} issued one too many"
        )
    if a.kind == b.kind and a.op == b.op and a.step != b.step:
        behind, ahead = (a, b) if a.step < b.step else (b, a)
        return (
            f"rank {behind.rank} is in step {behind.step} while rank {ahead.rank} is in step "
            f"{ahead.step} for the same '{a.kind}': rank {ahead.rank} skipped it in step "
            f"{behind.step} (typically a rank with no tokens that skipped the step's "
            f"{a.kind})"
        )
    if (a.op, a.kind, a.step, a.ubatch) == (b.op, b.kind, b.step, b.ubatch) and a.index == b.index:
        return (
            f"the same {a.op} ('{a.kind}') with other shapes ({list(a.shape or ())} on rank "
            f"{a.rank}, {list(b.shape or ())} on rank {b.rank}): a rank sized it from its own "
            f"token count instead of the agreed one (a dummy run's padding, its graph size)"
        )
    if a.kind == b.kind and a.op == b.op and a.index != b.index:
        return (
            f"rank {a.rank} is at its #{a.index} '{a.kind}' of step {a.step}, rank {b.rank} at "
            f"#{b.index}: one of them skipped or repeated one"
        )
    if a.ubatch != b.ubatch and (a.op, a.kind) == (b.op, b.kind):
        return f"ubatch {a.ubatch} on rank {a.rank} pairs with ubatch {b.ubatch} on rank {b.rank}"
    return (
        f"rank {a.rank} calls {a.op} ('{a.kind}') where rank {b.rank} calls {b.op} "
        f"('{b.kind}'): a rank skipped or reordered a collective"
    )


def as_shape(value: Any) -> tuple[int, ...] | None:
    """A shape as JSON or pickle brought it back (a list), as a tuple again."""
    return None if value is None else tuple(value)


def read_log(path: str | Path) -> Iterator[dict[str, Any]]:
    """The events of one rank's log, oldest first (a torn last line is skipped)."""
    text = Path(path).read_text() if Path(path).exists() else ""
    for line in text.splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue
