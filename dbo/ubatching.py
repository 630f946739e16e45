"""Ubatch thread registry and the dbo_* helpers (filled in by the runtime work)."""

from __future__ import annotations

import threading

# thread ident -> ubatch id, for every live ubatch thread of the running step
_THREAD_ID_TO_CONTEXT: dict[int, int] = {}


def dbo_current_ubatch_id() -> int:
    """The calling thread's ubatch id; 0 for a thread that is not a ubatch thread."""
    return _THREAD_ID_TO_CONTEXT.get(threading.get_ident(), 0)
