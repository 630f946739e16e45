"""What our code is measured against: the plain per-call workspace algorithm, the request
shapes both serve, and a device whose streams and events do nothing (the runtime with no
simulator)."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from itertools import accumulate

import torch

from dbo.streams import Device, Event, Stream
from dbo.ubatching import dbo_current_ubatch_id


def _plain_nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _plain_round_up(nbytes: int, alignment: int = 256) -> int:
    return (nbytes + alignment - 1) // alignment * alignment


class PerCallWorkspace:
    """The plain per-call workspace algorithm, as the baseline for get_simultaneous.

    Per call: each tensor's byte size (numel x itemsize), each rounded up to 256, their sum,
    the running offsets; the caller's slot by `dbo_current_ubatch_id()`, grown (every slot,
    old buffer dropped first) when too small and not locked; then one slice, view(dtype) and
    reshape(shape) per tensor. Nothing is cached: that is the difference being measured.
    """

    def __init__(self, device: str | torch.device, num_ubatches: int) -> None:
        self.device = torch.device(device)
        self.slots: list[torch.Tensor | None] = [None] * num_ubatches
        self.locked = False

    def get_simultaneous(
        self, *shapes_and_dtypes: tuple[tuple[int, ...], torch.dtype]
    ) -> list[torch.Tensor]:
        actual = [_plain_nbytes(shape, dtype) for shape, dtype in shapes_and_dtypes]
        aligned = [_plain_round_up(n) for n in actual]
        offsets = list(accumulate([0] + aligned[:-1]))
        buffer = self._ensure_size(sum(aligned))
        return [
            buffer[offsets[i] : offsets[i] + actual[i]].view(dtype).reshape(shape)
            for i, (shape, dtype) in enumerate(shapes_and_dtypes)
        ]

    def _ensure_size(self, required: int) -> torch.Tensor:
        slot = dbo_current_ubatch_id()
        buffer = self.slots[slot]
        if buffer is None or buffer.numel() < required:
            if self.locked:
                raise AssertionError(f"per-call workspace is locked; {required} bytes requested")
            for k, old in enumerate(self.slots):
                if old is None or old.numel() < required:
                    self.slots[k] = None
                    del old
                    self.slots[k] = torch.empty((required,), dtype=torch.uint8, device=self.device)
            buffer = self.slots[slot]
        return buffer  # type: ignore[return-value]


# Tensor shapes of the requests: the MoE block's mix of a decode step's scratch (16 tokens,
# DeepSeek-V3 widths), cycled to make a request of any length.
_REQUEST_CYCLE: tuple[tuple[tuple[int, ...], torch.dtype], ...] = (
    ((16, 7168), torch.bfloat16),
    ((16, 8), torch.int32),
    ((16, 2048), torch.bfloat16),
    ((16, 8), torch.float32),
)


def moe_request(n: int) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """A request of `n` buffers, (shape, dtype) pairs cycling through the MoE block's mix."""
    return tuple(_REQUEST_CYCLE[i % len(_REQUEST_CYCLE)] for i in range(n))


def request_bytes(request: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> int:
    """The bytes the per-call algorithm needs for `request` (each buffer rounded up)."""
    return sum(_plain_round_up(_plain_nbytes(s, d)) for s, d in request)


class _NullEvent(Event):
    def __init__(self, device: NullDevice) -> None:
        self.device = device

    def record(self, stream: Stream | None = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _NullStream(Stream):
    def __init__(self, device: NullDevice, name: str) -> None:
        self.device = device
        self.name = name

    def wait_event(self, event: Event) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class NullDevice(Device):
    """Streams and events that do nothing, tensors on CPU or meta: the runtime and the model
    with no simulator, so what is timed is the baton or the model's own Python and torch."""

    kind = "null"

    def __init__(self, tensor_device: str = "cpu") -> None:
        self.torch_device = torch.device(tensor_device)
        self._default = _NullStream(self, "default")
        self._tls = threading.local()

    def Stream(self, name: str = "") -> Stream:
        return _NullStream(self, name or "stream")

    def Event(self) -> Event:
        return _NullEvent(self)

    def default_stream(self) -> Stream:
        return self._default

    def current_stream(self) -> Stream:
        return getattr(self._tls, "stream", self._default)

    def set_stream(self, stream: Stream) -> None:
        self._tls.stream = stream

    def synchronize(self) -> None:
        pass
