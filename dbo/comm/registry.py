"""The process's EP group (vLLM's `get_ep_group()`): set once for every ubatch thread of a
step, or, when none is set, one in-process group per (experts, EP size) for the model layers.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from dbo.comm.ep_group import EPGroup

__all__ = ["current_ep_group", "ep_group_for", "set_ep_group", "use_ep_group"]

_CURRENT: EPGroup | None = None
_LOCAL: dict[tuple[int, int], EPGroup] = {}
_REGISTRY_LOCK = threading.Lock()


def current_ep_group() -> EPGroup | None:
    """The EP group set for this process, if any."""
    return _CURRENT


def set_ep_group(ep: EPGroup | None) -> None:
    """Set the process-wide EP group (process-wide: every ubatch thread of a step uses it)."""
    global _CURRENT
    if ep is not None and not isinstance(ep, EPGroup):
        raise TypeError(f"expected an EPGroup or None, got {type(ep).__name__}")
    _CURRENT = ep


@contextmanager
def use_ep_group(ep: EPGroup) -> Iterator[EPGroup]:
    """Make `ep` the process's EP group for the duration of the block."""
    if not isinstance(ep, EPGroup):
        raise TypeError(f"expected an EPGroup, got {type(ep).__name__}")
    previous = _CURRENT
    set_ep_group(ep)
    try:
        yield ep
    finally:
        set_ep_group(previous)


def ep_group_for(num_experts: int, ep_size: int) -> EPGroup:
    """The group a model layer with `num_experts` experts and EP size `ep_size` runs on: the
    process's EP group when one is set (it must match), else an in-process group."""
    ep = _CURRENT
    if ep is not None:
        if ep.num_experts != num_experts or ep.ep_size != ep_size:
            raise ValueError(
                f"the model has {num_experts} experts at ep_size {ep_size}, but the process's EP "
                f"group has {ep.num_experts} experts over {ep.ep_size} ranks; build the model "
                f"config with the group's ep_size"
            )
        return ep
    key = (num_experts, ep_size)
    with _REGISTRY_LOCK:
        local = _LOCAL.get(key)
        if local is None:
            local = _LOCAL[key] = EPGroup(num_experts=num_experts, ep_size=ep_size)
    return local
