"""The CUDA facade: torch's and vLLM's stream and event calls answered by a simulated device.

Inside `cuda_facade(device)`, `torch.cuda.Stream(...)`, `torch.Event(...)` and
`torch.cuda.Event(...)` make the device's streams and events, `torch.cuda.set_stream`,
`torch.cuda.stream(...)`, `torch.cuda.current_stream()` and vLLM's own `current_stream()` move
the calling thread's current stream on it, and `torch.accelerator.set_device_index` /
`empty_cache` / `current_device_index` answer for it. So code written against CUDA, vLLM's
`vllm/v1/worker/ubatching.py` first, runs unmodified on the simulated GPU: its ops are placed
on the right stream, its events order them, and the race checker, timeline and trace see it.

The patch is process-wide (torch's attributes are module attributes) and exact: the first
entry saves every original, the last exit puts each back, and entries nest (a reference
count under a lock, so threads may enter and leave in any order). Entering with a second
device while one is active is refused: one process simulates one GPU at a time here.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from dbo.sim.device import SimDevice
from dbo.sim.handles import SimEvent, SimStream
from dbo.streams import stream_context

__all__ = ["cuda_facade", "facade_active", "VLLM_CURRENT_STREAM_MODULES"]

# Modules that bind vLLM's `current_stream` by name at import: each binding is patched too
# (when the module is loaded), or the ring would still ask the real torch.cuda.
VLLM_CURRENT_STREAM_MODULES = (
    "vllm.utils.torch_utils",
    "vllm.v1.worker.ubatching",
    "vllm.v1.worker.gpu.ubatch_utils",
)

_LOCK = threading.Lock()
_ACTIVE: dict[str, Any] = {"device": None, "depth": 0, "saved": []}


class _StreamMeta(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, SimStream)


class _EventMeta(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, SimEvent)


def _device() -> SimDevice:
    device = _ACTIVE["device"]
    if device is None:
        raise RuntimeError("the CUDA facade was left while this thread still used it")
    return device


class FacadeStream(metaclass=_StreamMeta):
    """`torch.cuda.Stream` inside the facade: a new stream of the simulated device
    (`device` and `priority` are accepted and ignored: there is one device)."""

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> Any:
        return _device().Stream()


class FacadeEvent(metaclass=_EventMeta):
    """`torch.Event` / `torch.cuda.Event` inside the facade: an event of the simulated device
    (timing and IPC flags are accepted and ignored)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return _device().Event()


def _set_stream(stream: Any) -> None:
    _device().set_stream(stream)


def _current_stream(device: Any = None) -> SimStream:
    return _device().current_stream()


def _stream(stream: Any) -> Any:
    return nullcontext() if stream is None else stream_context(stream)


def _set_device_index(index: Any) -> None:
    if index not in (None, 0, -1) and int(index) != 0:
        raise ValueError(f"the simulated device has index 0, got set_device_index({index})")


def _replacements() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, stand-in) for every name the facade answers."""
    pairs: list[tuple[Any, str, Any]] = [
        (torch.cuda, "Stream", FacadeStream),
        (torch.cuda, "Event", FacadeEvent),
        (torch, "Event", FacadeEvent),
        (torch.cuda, "set_stream", _set_stream),
        (torch.cuda, "current_stream", _current_stream),
        (torch.cuda, "stream", _stream),
        (torch.accelerator, "set_device_index", _set_device_index),
        (torch.accelerator, "empty_cache", lambda: None),
        (torch.accelerator, "current_device_index", lambda: 0),
    ]
    for name in VLLM_CURRENT_STREAM_MODULES:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "current_stream"):
            pairs.append((module, "current_stream", _current_stream))
    return pairs


def _patch() -> None:
    saved = []
    for owner, name, stand_in in _replacements():
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, stand_in)
    _ACTIVE["saved"] = saved


def _restore() -> None:
    for owner, name, original in reversed(_ACTIVE["saved"]):
        setattr(owner, name, original)
    _ACTIVE["saved"] = []


def facade_active() -> SimDevice | None:
    """The device the facade answers for, or None outside it."""
    return _ACTIVE["device"]


@contextmanager
def cuda_facade(device: SimDevice) -> Iterator[SimDevice]:
    """Answer torch's and vLLM's CUDA stream and event calls with `device` for the block.

    Import vLLM's modules before entering (their `current_stream` bindings are patched only
    if loaded). Nested entries with the same device are free; another device is refused."""
    if not isinstance(device, SimDevice):
        raise TypeError(
            f"cuda_facade needs a dbo.sim.SimDevice, got {type(device).__name__}; on a real "
            f"GPU torch.cuda is already the device"
        )
    with _LOCK:
        if _ACTIVE["device"] is not None and _ACTIVE["device"] is not device:
            raise RuntimeError(
                f"the CUDA facade already answers for {_ACTIVE['device']!r}; leave it before "
                f"entering it for {device!r} (one simulated GPU per process at a time)"
            )
        if _ACTIVE["depth"] == 0:
            _ACTIVE["device"] = device
            _patch()
        _ACTIVE["depth"] += 1
    try:
        yield device
    finally:
        with _LOCK:
            _ACTIVE["depth"] -= 1
            if _ACTIVE["depth"] == 0:
                _restore()
                _ACTIVE["device"] = None
