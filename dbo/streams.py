"""Streams and events: one small interface, two devices (real CUDA and the simulated GPU).

The ubatch runtime speaks only to `Device`, `Stream` and `Event` below. `CudaDevice` wraps
`torch.cuda`; `dbo.sim.SimDevice` places the same calls on a virtual-time timeline. This
module is the interface and knows no implementation but CUDA's; `dbo.devices`, which knows
both, decides which device a thread uses.

Semantics follow CUDA: work issued to one stream runs in issue order; `stream.wait_event(e)`
makes later work on that stream wait for the work recorded before `e`; `synchronize()` blocks
the host. The *current stream* is per thread, as in torch.cuda.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "Event",
    "Stream",
    "Device",
    "CommHandle",
    "GraphCapture",
    "CudaDevice",
    "stream_context",
]


class Event(ABC):
    """A marker in a stream's work; `record` captures everything issued before it."""

    device: Device

    @abstractmethod
    def record(self, stream: Stream | None = None) -> None:
        """Capture the work issued so far on `stream` (default: the thread's current one)."""

    def wait(self, stream: Stream | None = None) -> None:
        """Make `stream` (default: current) wait for this event."""
        (stream or self.device.current_stream()).wait_event(self)

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until the recorded work is done."""

    @abstractmethod
    def query(self) -> bool:
        """True when the recorded work is done (never blocks)."""


class Stream(ABC):
    """An in-order queue of device work."""

    device: Device
    name: str

    @abstractmethod
    def wait_event(self, event: Event) -> None:
        """Later work on this stream waits for `event`'s recorded work."""

    def wait_stream(self, other: Stream) -> None:
        """Later work on this stream waits for everything issued on `other` so far."""
        self.wait_event(other.record_event())

    def record_event(self, event: Event | None = None) -> Event:
        event = event if event is not None else self.device.Event()
        event.record(self)
        return event

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until all work issued on this stream is done."""

    @abstractmethod
    def query(self) -> bool:
        """True when all work issued on this stream is done."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} on {self.device.kind}>"


@dataclass
class CommHandle:
    """What a `comm_region` gives back: `event` marks when the data is usable."""

    kind: str
    nbytes: int
    mode: str
    event: Event


class Device(ABC):
    """Where ubatch work runs: a factory of streams and events, and the per-thread current stream.

    `thread_scope` is entered by every thread that issues device work (each ubatch thread and
    the serial runner); the simulated device attributes ops there, CUDA needs nothing.
    `on_handoff` is called once per baton pass, so the simulator can charge its host cost.
    """

    kind: str
    torch_device: torch.device

    @abstractmethod
    def Stream(self, name: str = "") -> Stream: ...

    @abstractmethod
    def Event(self) -> Event: ...

    @abstractmethod
    def default_stream(self) -> Stream: ...

    @abstractmethod
    def current_stream(self) -> Stream:
        """The calling thread's current stream on this device."""

    @abstractmethod
    def set_stream(self, stream: Stream) -> None:
        """Make `stream` the calling thread's current stream."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until all work on every stream is done."""

    @contextmanager
    def thread_scope(self, ubatch_id: int | None = None) -> Iterator[None]:
        """Entered around the work of one thread (`ubatch_id` None for a serial run)."""
        yield

    def on_handoff(self) -> None:  # noqa: B027 - an optional hook, a no-op for most devices
        """One baton pass between ubatch threads happened."""

    @contextmanager
    def comm_region(
        self,
        kind: str,
        *,
        nbytes: int,
        mode: str = "ht",
        ep_size: int = 1,
        link: str | None = None,
        peers: Any = None,
    ) -> Iterator[CommHandle]:
        """Mark the block as one communication op (dispatch, combine, all-to-all, ...).

        The block does the real data movement with ordinary torch ops (or torch.distributed);
        the simulated device costs the whole block by its communication model instead of by
        its ops. mode "ht" (high-throughput) runs on the current stream, normally the comm
        stream, and occupies SMs; mode "ll" (low-latency) is sent from the current stream and
        arrives later: `handle.event` marks arrival, and a recv hook must wait on it before
        reading the data. On CUDA the block simply runs; `handle.event` is recorded after it.
        `peers` (an EP all-to-all across processes, `dbo.comm.PeerTraffic`) lets a simulated
        device end the op when every peer's rows have arrived in virtual time; a real
        collective waits for its peers by itself.
        """
        handle = CommHandle(kind=kind, nbytes=nbytes, mode=mode, event=self.Event())
        yield handle
        handle.event.record(self.current_stream())

    def ubatch_streams(self) -> tuple[Stream, Stream]:
        """The (compute, comm) pair that ubatched steps share, made on first use.

        Created once per device, as an engine creates them once per worker: every step then
        issues to the same two streams (and traces show one compute and one comm track).
        """
        pair = getattr(self, "_ubatch_streams", None)
        if pair is None:
            pair = (self.Stream("compute"), self.Stream("comm"))
            self._ubatch_streams = pair
        return pair

    def graph(self) -> GraphCapture:
        """A capture of device work: enter it, issue work, exit; then `replay()` it."""
        raise NotImplementedError(f"{type(self).__name__} cannot capture graphs")

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        """`tensor` is used on `stream`: when it is freed, the caching allocator must not hand
        its memory on before the work issued on `stream` by then is done. The default does
        nothing: a device without a caching allocator frees nothing early."""
        self.check_stream(stream)

    def check_stream(self, stream: Stream, what: str = "stream") -> Stream:
        if not isinstance(stream, Stream) or stream.device is not self:
            raise TypeError(
                f"{what} must be a Stream of {self!r}, got {stream!r}; create it with "
                f"device.Stream()"
            )
        return stream

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.torch_device}>"


# --------------------------------------------------------------------------------------------
# CUDA


class _CudaEvent(Event):
    def __init__(self, device: CudaDevice) -> None:
        self.device = device
        self.raw = torch.cuda.Event()

    def record(self, stream: Stream | None = None) -> None:
        stream = stream or self.device.current_stream()
        self.raw.record(stream.raw)  # type: ignore[attr-defined]

    def synchronize(self) -> None:
        self.raw.synchronize()

    def query(self) -> bool:
        return self.raw.query()


class _CudaStream(Stream):
    def __init__(self, device: CudaDevice, raw: torch.cuda.Stream, name: str) -> None:
        self.device = device
        self.raw = raw
        self.name = name

    def wait_event(self, event: Event) -> None:
        self.raw.wait_event(event.raw)  # type: ignore[attr-defined]

    def synchronize(self) -> None:
        self.raw.synchronize()

    def query(self) -> bool:
        return self.raw.query()


class CudaDevice(Device):
    """Real CUDA streams and events on one GPU."""

    kind = "cuda"

    def __init__(self, index: int | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "CudaDevice needs a CUDA GPU and a CUDA build of torch; none is present here. "
                "Use the simulated device (device='sim') instead."
            )
        self.index = torch.cuda.current_device() if index is None else index
        self.torch_device = torch.device("cuda", self.index)
        # Wrappers keyed by the raw stream so `current_stream()` returns the same object that
        # was set (the runtime compares streams by identity, as vLLM does).
        self._wrappers: dict[int, _CudaStream] = {}
        self._lock = threading.Lock()

    def _wrap(self, raw: torch.cuda.Stream, name: str = "") -> _CudaStream:
        key = raw.cuda_stream
        with self._lock:
            wrapper = self._wrappers.get(key)
            if wrapper is None:
                wrapper = _CudaStream(self, raw, name or f"cuda-stream-{key:#x}")
                self._wrappers[key] = wrapper
            return wrapper

    def Stream(self, name: str = "") -> Stream:
        return self._wrap(torch.cuda.Stream(device=self.torch_device), name)

    def Event(self) -> Event:
        return _CudaEvent(self)

    def default_stream(self) -> Stream:
        return self._wrap(torch.cuda.default_stream(self.torch_device), "default")

    def current_stream(self) -> Stream:
        return self._wrap(torch.cuda.current_stream(self.torch_device))

    def set_stream(self, stream: Stream) -> None:
        torch.cuda.set_stream(stream.raw)  # type: ignore[attr-defined]

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        tensor.record_stream(self.check_stream(stream).raw)  # type: ignore[attr-defined]

    def graph(self) -> GraphCapture:
        return _CudaGraphCapture(self)


class GraphCapture(ABC):
    """Records the device work issued while it is entered; `replay()` issues it again.

    `capture_stream` is the stream the capture begins on (the runner sets its compute stream);
    other streams join the capture by waiting on events recorded there, as on CUDA.
    """

    capture_stream: Stream | None = None
    # Set by `refuse_replay`: the capture holds only part of a step that failed.
    refused: str | None = None

    def refuse_replay(self, reason: str) -> None:
        """From now on `replay()` raises: the capture holds only part of a step (it failed
        while captured), and replaying it would run that part silently."""
        self.refused = reason

    def check_replayable(self) -> None:
        """What every `replay()` does first."""
        if self.refused is not None:
            raise RuntimeError(
                f"this graph captured a ubatched step that failed ({self.refused}); it holds "
                f"only part of the step and cannot be replayed: capture the step again with a "
                f"new graph"
            )

    @abstractmethod
    def __enter__(self) -> GraphCapture: ...

    @abstractmethod
    def __exit__(self, *exc: Any) -> None: ...

    @abstractmethod
    def replay(self) -> None: ...


class _CudaGraphCapture(GraphCapture):
    def __init__(self, device: CudaDevice) -> None:
        self.device = device
        self.graph = torch.cuda.CUDAGraph()
        self._ctx: Any = None

    def __enter__(self) -> GraphCapture:
        stream = self.capture_stream or self.device.current_stream()
        self._ctx = torch.cuda.graph(self.graph, stream=stream.raw)  # type: ignore[attr-defined]
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)

    def replay(self) -> None:
        self.check_replayable()
        self.graph.replay()


# --------------------------------------------------------------------------------------------
# The current stream


@contextmanager
def stream_context(stream: Stream) -> Iterator[Stream]:
    """Issue the block's work on `stream`, then restore the thread's previous stream."""
    device = stream.device
    previous = device.current_stream()
    device.set_stream(stream)
    try:
        yield stream
    finally:
        device.set_stream(previous)
