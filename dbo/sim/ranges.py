"""Named host ranges on the simulated device: `torch.profiler.record_function` and NVTX.

A user's `with torch.profiler.record_function("attn"):` reaches the interception modes as the
ops `profiler._record_function_enter_new` / `profiler._record_function_exit`; the function
mode hands them to the thread's `HostRanges`, and each closed range goes to the device's sink
(which keeps it as a `HostRange`, drawn on the host track of the trace). Ranges nest per
thread, so each thread keeps its own stack of open ones.

NVTX calls are plain functions, not ops: `torch.cuda.nvtx.range_push` / `range_pop` are
wrapped once per process, when a thread first enters a simulated device's scope (not on import:
importing `dbo` leaves torch as it was), so that a thread inside that scope records a range
instead of calling NVTX (a CPU build has none); every other thread calls the original.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["ENTER", "EXIT", "HostRanges", "RangeSink", "device_scope", "profiler_range_op"]

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


# A closed range goes to its device's sink: (name, start_us, end_us, ubatch, source).
RangeSink = Callable[[str, float, float, "int | None", str], None]


class HostRanges:
    """One thread's open named ranges on one device (`ThreadState.ranges`): they nest, so a
    stack; each one closed goes to `sink`, timed by `clock` (the device's host clock)."""

    __slots__ = ("_clock", "_ubatch", "_sink", "_open")

    def __init__(
        self, clock: Callable[[], float], ubatch: Callable[[], int | None], sink: RangeSink
    ) -> None:
        self._clock = clock
        self._ubatch = ubatch  # the ubatch the thread's work is attributed to now
        self._sink = sink
        self._open: list[tuple[str, float, int | None, str]] = []

    @property
    def depth(self) -> int:
        """How many ranges are open."""
        return len(self._open)

    def open(self, name: str, source: str) -> None:
        """Start a named range at the host clock."""
        self._open.append((name, self._clock(), self._ubatch(), source))

    def close(self) -> None:
        """End the innermost open range (an unmatched close is ignored)."""
        if not self._open:
            return
        name, start, ubatch, source = self._open.pop()
        self._sink(name, start, max(self._clock(), start), ubatch, source)


# The open ranges of the simulated device whose scope (`SimDevice.thread_scope`) the calling
# thread is in: NVTX calls, plain functions, find them here.
_IN_SCOPE = threading.local()
# Set once NVTX is wrapped; the lock makes two threads entering their first scope wrap it once.
_HOOKED = threading.Event()
_HOOK_LOCK = threading.Lock()


@contextmanager
def device_scope(ranges: HostRanges) -> Iterator[None]:
    """Mark the calling thread as working inside a device's scope: NVTX calls record ranges
    into `ranges` (the thread's on that device)."""
    if not _HOOKED.is_set():
        _install_nvtx_hooks()
    previous = getattr(_IN_SCOPE, "ranges", None)
    _IN_SCOPE.ranges = ranges
    try:
        yield
    finally:
        _IN_SCOPE.ranges = previous


def _ranges_in_scope() -> HostRanges | None:
    return getattr(_IN_SCOPE, "ranges", None)


def _wrap_push(original: Callable[..., Any]) -> Callable[..., Any]:
    def range_push(msg: str) -> Any:
        ranges = _ranges_in_scope()
        if ranges is None:
            return original(msg)
        ranges.open(str(msg), "nvtx")
        return ranges.depth - 1  # NVTX's answer: the depth of the range

    # Its docstring, and `__wrapped__`, which marks the function patched (and unwraps it).
    functools.update_wrapper(range_push, original, assigned=("__doc__",), updated=())
    return range_push


def _wrap_pop(original: Callable[..., Any]) -> Callable[..., Any]:
    def range_pop() -> Any:
        ranges = _ranges_in_scope()
        if ranges is None:
            return original()
        ranges.close()
        return ranges.depth

    # Its docstring, and `__wrapped__`, which marks the function patched (and unwraps it).
    functools.update_wrapper(range_pop, original, assigned=("__doc__",), updated=())
    return range_pop


def _install_nvtx_hooks() -> None:
    with _HOOK_LOCK:
        nvtx = torch.cuda.nvtx
        if not hasattr(nvtx.range_push, "__wrapped__"):  # once per process, even on re-import
            nvtx.range_push = _wrap_push(nvtx.range_push)
            nvtx.range_pop = _wrap_pop(nvtx.range_pop)
        _HOOKED.set()
