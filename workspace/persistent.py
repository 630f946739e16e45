"""Persistent resources (vLLM's `get_persistent_resource` and `get_persistent`): one object
per key for each (ubatch, lane), kept for the manager's lifetime apart from the scratch slots,
so growth never moves them; once the manager is locked, a key not made during warmup is
refused.

A mixin of `WorkspaceManager`, which builds the state named below.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar, cast

import numpy as np
import torch

from dbo.ubatching import dbo_current_ubatch_id

from .diagnostics import caller_info
from .errors import WorkspaceLockedError
from .lanes import current_workspace_lane
from .layout import plan_layout

__all__ = ["PersistentResources"]

T = TypeVar("T")


class PersistentResources:
    """The persistent-resource half of `WorkspaceManager`'s API."""

    _device: torch.device
    _persistent: list[dict[Hashable, Any]]  # by slot id, as the scratch slots
    _locked: bool
    _mutex: threading.RLock
    _slot_id: Callable[[Any, int], int]

    def get_persistent_resource(self, key: Hashable, factory: Callable[[], T]) -> T:
        """The object kept under `key` for the caller's (ubatch, lane), made by `factory()`
        on first request and returned as is afterwards.

        Every (ubatch, lane) has its own; they live apart from the scratch slots, so growth
        never moves them. Once locked, a key this (ubatch, lane) did not create during warmup
        raises `WorkspaceLockedError`. If `factory` raises, nothing is stored.
        """
        if not callable(factory):
            raise TypeError(
                f"get_persistent_resource: factory must be callable, got "
                f"{type(factory).__name__} {factory!r:.100}"
            )
        try:
            hash(key)
        except TypeError:
            raise TypeError(
                f"get_persistent_resource: key must be hashable, got {type(key).__name__}"
            ) from None
        ubatch, lane = dbo_current_ubatch_id(), current_workspace_lane()
        resources = self._persistent[self._slot_id(ubatch, lane)]
        try:
            return cast(T, resources[key])
        except KeyError:
            pass
        with self._mutex:
            if key in resources:  # made by another thread while we waited
                return cast(T, resources[key])
            if self._locked:
                raise WorkspaceLockedError(
                    f"Workspace is locked but persistent resource {key!r:.200} requested from "
                    f"'{caller_info()}' was not allocated during warmup for ubatch {ubatch}, "
                    f"lane {lane}; create it in every ubatch and lane before "
                    f"lock_workspace() (or unlock_workspace() to re-warm)"
                )
            value = factory()
            resources[key] = value
            return value

    def get_persistent(
        self,
        key: Hashable,
        shape: Sequence[int],
        dtype: torch.dtype,
        *,
        zero_init: bool = False,
    ) -> torch.Tensor:
        """A fixed-shape tensor kept under `key` for the caller's (ubatch, lane); zeroed on
        its first allocation only if `zero_init`. Asking again with another shape or dtype
        raises ValueError (use a new key)."""
        layout = plan_layout(((shape, dtype),), "get_persistent")
        dims, dtype = layout.key[0]
        if not isinstance(zero_init, (bool, np.bool_)):
            raise TypeError(
                f"get_persistent: zero_init must be a bool, got {type(zero_init).__name__}"
            )
        device = self._device

        def make() -> torch.Tensor:
            with torch.inference_mode(False):  # usable in place outside inference mode too
                if zero_init:
                    return torch.zeros(dims, dtype=dtype, device=device)
                return torch.empty(dims, dtype=dtype, device=device)

        tensor = self.get_persistent_resource((torch.Tensor, key), make)
        if tuple(tensor.shape) != dims or tensor.dtype != dtype:
            raise ValueError(
                f"get_persistent: persistent tensor {key!r:.200} has shape="
                f"{tuple(tensor.shape)}, dtype={tensor.dtype}; requested shape={dims}, "
                f"dtype={dtype} (a key names one fixed shape and dtype: use a new key)"
            )
        return tensor
