"""Which device a thread uses: the process default, a thread's own (`use_device`), and the
user's device argument turned into a `Device` (`resolve_device`).

This is the one module of the runtime that knows both implementations of the `dbo.streams`
interface: the default is the simulated H200, so a laptop with no GPU runs the same code as a
GPU node. The simulator sits below the runtime (it implements `dbo.streams` and stands on
nothing else of it); importing it changes no torch state (its NVTX hooks go in when a simulated
device is first used).

Documented registry: the process-wide default device (`set_default_device`), used by threads
that have not entered `use_device`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from dbo.sim import SimDevice, SimOptions
from dbo.streams import CudaDevice, Device, Stream

__all__ = [
    "current_device",
    "current_stream",
    "set_default_device",
    "get_default_device",
    "use_device",
    "resolve_device",
    "record_stream",
]

_DEFAULT_DEVICE: Device | None = None
_DEFAULT_LOCK = threading.Lock()
_THREAD_DEVICE = threading.local()


def set_default_device(device: Device | None) -> None:
    """Set the process-wide device used by threads outside `use_device` (None: choose again)."""
    global _DEFAULT_DEVICE
    if device is not None and not isinstance(device, Device):
        raise TypeError(f"expected a dbo.streams.Device or None, got {type(device).__name__}")
    _DEFAULT_DEVICE = device


def get_default_device() -> Device:
    """The process default: set by `set_default_device`, else the simulated H200."""
    global _DEFAULT_DEVICE
    with _DEFAULT_LOCK:
        if _DEFAULT_DEVICE is None:
            _DEFAULT_DEVICE = SimDevice()
        return _DEFAULT_DEVICE


def current_device() -> Device:
    """The calling thread's device (`use_device`), else the process default."""
    device = getattr(_THREAD_DEVICE, "device", None)
    return device if device is not None else get_default_device()


@contextmanager
def use_device(device: Device) -> Iterator[Device]:
    """Make `device` the calling thread's device for the duration of the block."""
    if not isinstance(device, Device):
        raise TypeError(f"expected a dbo.streams.Device, got {type(device).__name__}")
    previous = getattr(_THREAD_DEVICE, "device", None)
    _THREAD_DEVICE.device = device
    try:
        yield device
    finally:
        _THREAD_DEVICE.device = previous


def current_stream() -> Stream:
    """The calling thread's current stream on its device."""
    return current_device().current_stream()


def resolve_device(device: Device | str | None, sim_options: SimOptions | None = None) -> Device:
    """Turn a user's device argument into a Device.

    None -> the calling thread's device; "sim" -> a new simulated device built from
    `sim_options` (default: `SimOptions()`);
    "cuda" / "cuda:N" -> a CudaDevice; a Device passes through.
    """
    if device is None:
        return current_device()
    if isinstance(device, Device):
        return device
    if isinstance(device, str):
        if device == "sim":
            return SimDevice(sim_options)
        if device == "cuda" or device.startswith("cuda:"):
            suffix = device.split(":", 1)[1] if ":" in device else None
            if suffix is not None and not suffix.isdigit():
                raise ValueError(
                    f"device {device!r}: the GPU index after 'cuda:' must be a non-negative integer"
                )
            return CudaDevice(None if suffix is None else int(suffix))
    raise ValueError(
        f"device must be 'sim', 'cuda', 'cuda:N' or a dbo.streams.Device, got {device!r}"
    )


def record_stream(tensor: torch.Tensor, stream: Stream | None = None) -> None:
    """`Tensor.record_stream` for any device: `stream` (default: the calling thread's current
    stream) uses `tensor`, so its memory is not reused before that stream's work at the free.
    The stream's own device applies it, so the same line serves CUDA and the simulator."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"record_stream takes a torch.Tensor, got {type(tensor).__name__}")
    if stream is None:
        stream = current_stream()
    elif not isinstance(stream, Stream):
        raise TypeError(
            f"record_stream takes a dbo Stream (device.Stream()), got {type(stream).__name__}"
        )
    stream.device.record_stream(tensor, stream)
