"""workspace: per-ubatch scratch memory for DBO, grown in step across slots, frozen by lock().

Public names follow vLLM's `vllm/v1/worker/workspace.py`. See `workspace.manager` for the
contract, the hot path and the documented growth/orphan trade-off.
"""

from .errors import (
    WorkspaceAllocationError,
    WorkspaceLockedError,
    WorkspaceNotInitializedError,
    WorkspaceSlotError,
)
from .lanes import current_workspace_lane, use_workspace_lane
from .layout import ALIGNMENT
from .manager import WorkspaceManager
from .records import BufferInfo, GrowthRecord, WorkspaceStats
from .singleton import (
    current_workspace_manager,
    init_workspace_manager,
    is_workspace_manager_initialized,
    lock_workspace,
    reserve_workspace,
    reset_workspace_manager,
    unlock_workspace,
)
from .steps import WorkspaceStep, current_workspace_step, workspace_step

__all__ = [
    "ALIGNMENT",
    "WorkspaceManager",
    "WorkspaceLockedError",
    "WorkspaceNotInitializedError",
    "WorkspaceAllocationError",
    "WorkspaceSlotError",
    "GrowthRecord",
    "BufferInfo",
    "WorkspaceStats",
    "init_workspace_manager",
    "current_workspace_manager",
    "lock_workspace",
    "unlock_workspace",
    "reset_workspace_manager",
    "is_workspace_manager_initialized",
    "reserve_workspace",
    "use_workspace_lane",
    "current_workspace_lane",
    "WorkspaceStep",
    "workspace_step",
    "current_workspace_step",
]
