"""Workspace lanes: independent owners of scratch inside one ubatch (vLLM's `use_workspace_lane`).

A lane is an execution context that must not alias another's scratch even within the same
ubatch, e.g. a draft model's forward interleaved with the target model's. The lane is a
context variable rather than a thread attribute, so it follows `contextvars` copies and is
restored on exit whatever the block raises. Lane 0 is the default everywhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from dbo.checks import as_int

__all__ = ["current_workspace_lane", "use_workspace_lane"]

_workspace_lane: ContextVar[int] = ContextVar("dbo_workspace_lane", default=0)

# The hot path reads the lane through this bound method: one call, no module lookups.
current_workspace_lane = _workspace_lane.get


def _check_lane(lane: Any) -> int:
    return as_int("workspace lane", lane)


@contextmanager
def use_workspace_lane(lane: int) -> Iterator[None]:
    """Serve this block's workspace calls from `lane`'s slots (validated before entering)."""
    token = _workspace_lane.set(_check_lane(lane))
    try:
        yield
    finally:
        _workspace_lane.reset(token)
