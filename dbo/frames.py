"""Which source files are the ubatch runtime's own: a documented registry of frames that user
stacks leave out.

A race report names the user's code that issued each access. The runtime's frames (ubatch
threads' loops, the yield and switch calls) are the same in every report, so a user stack shows
them only when nothing of the user's is on it. Each runtime module registers itself at import
(`register_runtime_file(__file__)`); the simulator's stack capture (`dbo.sim.stacks`) reads the
registry. It lives outside `dbo.sim` so that registering never imports the simulator.

Documented registry: the set of runtime source files, process-wide, only ever added to.
"""

from __future__ import annotations

import threading

__all__ = ["register_runtime_file", "runtime_files"]

_LOCK = threading.Lock()
_FILES: frozenset[str] = frozenset()


def register_runtime_file(path: str) -> None:
    """Mark the source file `path` (a module's `__file__`) as the runtime's: its frames are
    left out of user stacks unless nothing else is there."""
    if not isinstance(path, str) or not path:
        raise TypeError(f"register_runtime_file takes a module's __file__ (a str), got {path!r}")
    global _FILES
    with _LOCK:
        _FILES = _FILES | {path}


def runtime_files() -> frozenset[str]:
    """The registered runtime source files (a snapshot: cheap to test frames against)."""
    return _FILES
