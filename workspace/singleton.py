"""The process-wide WorkspaceManager: the package's one documented module-level registry.

Engine code calls `init_workspace_manager(device, num_ubatches)` once at worker start (num
ubatches = 2 with DBO, else 1), warms up, `lock_workspace()`s, and every consumer reaches the
manager through `current_workspace_manager()`.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

from .errors import WorkspaceNotInitializedError
from .manager import WorkspaceManager

__all__ = [
    "init_workspace_manager",
    "current_workspace_manager",
    "lock_workspace",
    "unlock_workspace",
    "reset_workspace_manager",
    "is_workspace_manager_initialized",
]

_manager: WorkspaceManager | None = None
_registry_lock = threading.Lock()


def init_workspace_manager(device: Any, num_ubatches: int | None = None) -> WorkspaceManager:
    """Create the process-wide manager (re-initialising warns and replaces the old one)."""
    global _manager
    manager = WorkspaceManager(device, num_ubatches)  # validate before replacing anything
    with _registry_lock:
        previous, _manager = _manager, manager
    if previous is not None:
        warnings.warn(
            f"init_workspace_manager called again: replacing {previous!r} with {manager!r}; "
            f"views into the old manager's slots stay valid but are no longer managed",
            RuntimeWarning,
            stacklevel=2,
        )
    return manager


def current_workspace_manager() -> WorkspaceManager:
    """The process-wide manager; raises WorkspaceNotInitializedError before init."""
    manager = _manager
    if manager is None:
        raise WorkspaceNotInitializedError(
            "the workspace manager is not initialised: call "
            "init_workspace_manager(device, num_ubatches) first (once per worker, before any "
            "get_simultaneous)"
        )
    return manager


def lock_workspace() -> None:
    """Freeze growth after warmup/graph capture."""
    current_workspace_manager().lock()


def unlock_workspace() -> None:
    """Allow growth again (elastic EP re-warmup), then lock_workspace() again."""
    current_workspace_manager().unlock()


def reset_workspace_manager() -> None:
    """Forget the process-wide manager (tests; a fresh init follows)."""
    global _manager
    with _registry_lock:
        _manager = None


def is_workspace_manager_initialized() -> bool:
    return _manager is not None
