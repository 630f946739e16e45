"""The process-wide WorkspaceManager: the package's one documented module-level registry.

Engine code calls `init_workspace_manager(device, num_ubatches)` once at worker start (num
ubatches = 2 with DBO, else 1), warms up (or `reserve_workspace(...)`s), `lock_workspace()`s,
and every consumer reaches the manager through `current_workspace_manager()`.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from dbo.ubatching import check_not_abandoned

from .errors import WorkspaceNotInitializedError
from .manager import WorkspaceManager

__all__ = [
    "init_workspace_manager",
    "current_workspace_manager",
    "reserve_workspace",
    "lock_workspace",
    "unlock_workspace",
    "reset_workspace_manager",
    "is_workspace_manager_initialized",
]

_manager: WorkspaceManager | None = None
_registry_lock = threading.Lock()


def init_workspace_manager(
    device: Any,
    num_ubatches: int | None = None,
    num_lanes: int = 1,
    alloc_context: Callable[[], AbstractContextManager] = nullcontext,
) -> WorkspaceManager:
    """Create the process-wide manager (re-initialising warns and replaces the old one).

    `alloc_context` is entered around every slot allocation (vLLM uses it for sleep-mode
    memory pools). Returns the manager, where vLLM returns None.
    """
    global _manager
    # validate before replacing anything
    manager = WorkspaceManager(device, num_ubatches, num_lanes, alloc_context)
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
    """The process-wide manager; raises WorkspaceNotInitializedError before init.

    That error is an AssertionError (what vLLM raises) and a RuntimeError (what this project
    raised before), and unlike vLLM's bare `assert` it is still raised under `python -O`. In
    a ubatch thread the launcher abandoned it raises `dbo.UBatchAbandoned`: a later step owns
    the slots.
    """
    check_not_abandoned()
    manager = _manager
    if manager is None:
        raise WorkspaceNotInitializedError(
            "WorkspaceManager not initialized: call init_workspace_manager(device, "
            "num_ubatches) first (once per worker, before any get_simultaneous)"
        )
    return manager


def reserve_workspace(*shapes_and_dtypes: tuple[Sequence[int], torch.dtype]) -> None:
    """Size the caller's lane of the process-wide manager for this request (see `reserve`)."""
    current_workspace_manager().reserve(*shapes_and_dtypes)


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
