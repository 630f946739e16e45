"""Expert-parallel communication: `EPGroup` (dispatch and combine, in one process or across
torch.distributed ranks), its records and errors, and the process's EP group.

ep_group (`EPGroup`: prepare, dispatch, combine), across (the data movement between
processes), collectives (EP subgroups, abort keys, bounded collectives), records (plans,
handles, results, the `EP*Error`s), checks (the argument checks), registry
(`current_ep_group`, `use_ep_group`, ...).
"""

from dbo.comm.ep_group import MODES, EPGroup
from dbo.comm.records import (
    DispatchPlan,
    DispatchResult,
    EPError,
    EPHandle,
    EPPeerFailedError,
    EPStepMismatchError,
    EPTimeoutError,
    PeerTraffic,
)
from dbo.comm.registry import current_ep_group, ep_group_for, set_ep_group, use_ep_group

__all__ = [
    "MODES",
    "EPError",
    "EPPeerFailedError",
    "EPTimeoutError",
    "EPStepMismatchError",
    "DispatchPlan",
    "EPHandle",
    "DispatchResult",
    "EPGroup",
    "PeerTraffic",
    "current_ep_group",
    "set_ep_group",
    "use_ep_group",
    "ep_group_for",
]
