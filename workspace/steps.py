"""Which run a workspace growth served, so a locked workspace's refusal can say which run
sized the slots and which run needs more.

An engine (or `dbo.verify`) labels each run with `workspace_step("profile run",
num_tokens=16)`; a growth records the label, and whether it ran inside a ubatch. The label
is process-wide, not a context variable: ubatch threads do not inherit context variables,
and a worker runs one step at a time.

The refusal this serves: a profile run made under DBO sizes each slot for one ubatch's share
of the batch; a later step that falls back to serial needs the whole batch in one slot, and
the locked workspace refuses it (vLLM #52176 runs the profile run without DBO for this).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from dbo.checks import as_int
from dbo.ubatching import dbo_enabled

from .diagnostics import mb
from .records import GrowthRecord

__all__ = ["WorkspaceStep", "current_workspace_step", "sizing_story", "workspace_step"]


@dataclass(frozen=True, slots=True)
class WorkspaceStep:
    """A labelled run: its name, the batch's token count, and how many ubatches it splits
    into (1: a serial run)."""

    name: str
    num_tokens: int | None = None
    num_ubatches: int = 1

    def describe(self, in_ubatch: bool | None = None) -> str:
        """ "the profile run (ubatched: 2 ubatches, 16 tokens)", as a growth saw it."""
        ubatched = self.num_ubatches > 1 if in_ubatch is None else in_ubatch
        tokens = "" if self.num_tokens is None else f", {self.num_tokens} tokens"
        if ubatched:
            n = f"{self.num_ubatches} ubatches" if self.num_ubatches > 1 else "in a ubatch"
            return f"the {self.name} (ubatched: {n}{tokens})"
        return f"the {self.name} (serial{tokens})"


_lock = threading.Lock()
_steps: list[WorkspaceStep] = []


@contextmanager
def workspace_step(
    name: str, *, num_tokens: int | None = None, num_ubatches: int = 1
) -> Iterator[WorkspaceStep]:
    """Label the runs in the block for the workspace's growth records and refusals."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"workspace_step: name must be a non-empty string, got {name!r}")
    if num_tokens is not None:
        as_int("num_tokens", num_tokens, minimum=0)
    as_int("num_ubatches", num_ubatches, minimum=1)
    step = WorkspaceStep(name, num_tokens, num_ubatches)
    with _lock:
        _steps.append(step)
    try:
        yield step
    finally:
        with _lock:
            _steps.remove(step)


def current_workspace_step() -> WorkspaceStep | None:
    """The innermost labelled run, or None."""
    with _lock:
        return _steps[-1] if _steps else None


def describe_current_step() -> str:
    """The run a growth or request happens in, as text: its label, or whether it is a
    ubatch of an unlabelled run."""
    step, in_ubatch = current_workspace_step(), dbo_enabled()
    if step is None:
        return "an unlabelled ubatched run" if in_ubatch else "an unlabelled serial run"
    return step.describe(in_ubatch)


def sizing_story(growths: Sequence[GrowthRecord], lane: int, need: int) -> str:
    """Why a locked lane is too small: which run last grew it and from where, which run asks
    for more, and, when a ubatched run sized the slots for a serial one, what to do."""
    sized = [g for g in growths if g.lane == lane]
    now = describe_current_step()
    if not sized:
        return f"; no run grew these slots before the lock, and {now} needs {mb(need)}"
    last = sized[-1]
    story = (
        f"; the slots were sized to {mb(last.new_bytes)} by {last.step or 'an unlabelled run'} "
        f"(from '{last.caller}'), and {now} needs {mb(need)}"
    )
    if "ubatched" in (last.step or "") and "serial" in now:
        story += (
            ": a step that falls back from DBO to serial runs the whole batch in one slot, "
            "but a ubatched run sized each slot for one ubatch's share; size the workspace "
            "with a serial run of the largest batch (vLLM #52176 runs its profile run "
            "without DBO)"
        )
    return story
