"""Named host ranges on the simulated device: `torch.profiler.record_function` and NVTX.

A user's `with torch.profiler.record_function("attn"):` reaches the interception modes as the
ops `profiler._record_function_enter_new` / `profiler._record_function_exit`; the function
mode hands them here, and each closed range becomes a `HostRange` on `device.host_ranges`,
drawn on the host track of the trace. Ranges nest per thread, so each thread keeps its own
stack of open ones.

NVTX calls are plain functions, not ops: `torch.cuda.nvtx.range_push` / `range_pop` are
wrapped once, on import, so that a thread working inside a simulated device's scope records a
range instead of calling NVTX (a CPU build has none); every other thread calls the original.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from dbo.sim.records import HostRange

if TYPE_CHECKING:
    from dbo.sim.device import SimDevice

__all__ = ["ENTER", "EXIT", "close_range", "open_range", "profiler_range_op"]

ENTER = "enter"
EXIT = "exit"

_OPS: dict[Any, str | None] = {}


def profiler_range_op(func: Any) -> str | None:
    """ENTER or EXIT for record_function's ops (any overload), else None; cached per func."""
    try:
        return _OPS[func]
    except KeyError:
        pass
    except TypeError:  # an unhashable callable is no profiler op
        return None
    name = str(getattr(func, "_qualified_op_name", None) or func)
    what = None
    if name.startswith(("profiler._record_function_enter", "profiler::_record_function_enter")):
        what = ENTER
    elif name.startswith(("profiler._record_function_exit", "profiler::_record_function_exit")):
        what = EXIT
    _OPS[func] = what
    return what


def _open_stack(device: SimDevice) -> list[tuple[str, float, int | None, str]]:
    tls = device.thread_state()
    stack = getattr(tls, "host_range_stack", None)
    if stack is None:
        stack = tls.host_range_stack = []
    return stack


def open_range(device: SimDevice, name: str, source: str) -> None:
    """Start a named range at the device's host clock, in the calling thread."""
    _open_stack(device).append((name, device.host_time_us, device.current_ubatch(), source))


def close_range(device: SimDevice) -> None:
    """End the calling thread's innermost open range (an unmatched close is ignored)."""
    stack = _open_stack(device)
    if not stack:
        return
    name, start, ubatch, source = stack.pop()
    end = max(device.host_time_us, start)
    if device.record_timeline:
        device.host_ranges.append(HostRange(device.rank, ubatch, name, start, end, source))


# The simulated device whose scope (`SimDevice.thread_scope`) the calling thread is in.
_IN_SCOPE = threading.local()


@contextmanager
def device_scope(device: SimDevice) -> Iterator[None]:
    """Mark the calling thread as working inside `device`'s scope (NVTX calls record ranges)."""
    previous = getattr(_IN_SCOPE, "device", None)
    _IN_SCOPE.device = device
    try:
        yield
    finally:
        _IN_SCOPE.device = previous


def _sim_device_in_scope() -> SimDevice | None:
    return getattr(_IN_SCOPE, "device", None)


def _wrap_push(original: Callable[..., Any]) -> Callable[..., Any]:
    def range_push(msg: str) -> Any:
        device = _sim_device_in_scope()
        if device is None:
            return original(msg)
        open_range(device, str(msg), "nvtx")
        return len(_open_stack(device)) - 1  # NVTX's answer: the depth of the range

    range_push.__doc__ = original.__doc__
    range_push.__wrapped__ = original  # type: ignore[attr-defined]
    return range_push


def _wrap_pop(original: Callable[..., Any]) -> Callable[..., Any]:
    def range_pop() -> Any:
        device = _sim_device_in_scope()
        if device is None:
            return original()
        close_range(device)
        return len(_open_stack(device))

    range_pop.__doc__ = original.__doc__
    range_pop.__wrapped__ = original  # type: ignore[attr-defined]
    return range_pop


def _install_nvtx_hooks() -> None:
    nvtx = torch.cuda.nvtx
    if not hasattr(nvtx.range_push, "__wrapped__"):  # once per process, even on re-import
        nvtx.range_push = _wrap_push(nvtx.range_push)
        nvtx.range_pop = _wrap_pop(nvtx.range_pop)


_install_nvtx_hooks()
