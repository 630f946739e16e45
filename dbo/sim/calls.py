"""A captured torch call, and running it again as it ran the first time.

A re-execution (a graph replay, the adversarial order of `dbo.sim.reorder`) recomputes each
op on the very tensors it ran on, usually on another thread than the one that captured it.
Autograd's modes are thread-local, and PyTorch checks them against the tensors: an in-place
op on a view made under `torch.no_grad()` raises when grad mode is on, and one on a tensor
made under `torch.inference_mode()` raises outside it. So each call keeps the modes it ran
under (`OpModes`), and `rerun_op` restores them around the op.

An op whose output shape depends on its input values (`nonzero`, boolean-mask indexing,
`unique`) may produce another shape when it is recomputed from other values; the later
captured ops hold the captured output, whose shape cannot change. `rerun_op` refuses that
unless the caller says what to do with the fresh result (`on_shape`).

On meta tensors (a simulated device without storage) there are no values to recompute, and
a meta kernel's shapes depend on its inputs' shapes alone, which a re-execution does not
change: `rerun_op` returns at once there. Recording a decode step replays its graph, and the
meta kernels (Python decompositions for some ops) were a large share of that replay.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

__all__ = ["OpModes", "CapturedCall", "ShapeChangedError", "rerun_op"]


class ShapeChangedError(RuntimeError):
    """A re-executed op produced another shape than at capture (a data-dependent shape)."""


@dataclass(frozen=True, slots=True)
class OpModes:
    """The autograd modes a call ran under."""

    grad_enabled: bool
    inference_mode: bool

    @classmethod
    def current(cls) -> OpModes:
        """The calling thread's modes (inside inference mode grad is always off)."""
        return cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled())

    @contextmanager
    def applied(self) -> Iterator[None]:
        with torch.inference_mode(self.inference_mode), torch.set_grad_enabled(self.grad_enabled):
            yield


class CapturedCall(NamedTuple):
    """One torch call of a captured comm block: the op overload, the tensors it ran on, the
    tensors captured as its output, and the modes it ran under."""

    func: Any
    args: tuple
    kwargs: dict
    out: Any
    modes: OpModes

    def rerun(self, on_shape: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> None:
        rerun_op(self.func, self.args, self.kwargs, self.out, self.modes, on_shape)


def rerun_op(
    func: Any,
    args: tuple,
    kwargs: dict,
    out: Any,
    modes: OpModes | None = None,
    on_shape: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> None:
    """Recompute one op under `modes` (default: the caller's) and leave its result in the
    tensors captured as its output. A fresh output whose shape differs from the captured one
    goes to `on_shape(captured, fresh)`, or raises `ShapeChangedError` when that is None."""
    if _shapes_only([*args, *kwargs.values(), out]):
        return
    with modes.applied() if modes is not None else _as_is():
        new = func(*args, **kwargs)
        pairs = zip(out, new) if isinstance(out, (list, tuple)) else [(out, new)]
        for old, fresh in pairs:
            if not isinstance(old, torch.Tensor) or fresh is old:
                continue
            if old.shape == fresh.shape:
                old.copy_(fresh)
            elif on_shape is not None:
                on_shape(old, fresh)
            else:
                raise ShapeChangedError(
                    f"{func._schema.name} gave shape {tuple(fresh.shape)} when re-executed "
                    f"where the capture gave {tuple(old.shape)} (its output shape depends on "
                    f"values that changed)"
                )


def _shapes_only(values: list[Any]) -> bool:
    """Whether there is a tensor among `values` (lists and tuples nested) and every one is a
    meta tensor."""
    found = False
    while values:
        v = values.pop()
        if isinstance(v, torch.Tensor):
            if v.device.type != "meta":
                return False
            found = True
        elif isinstance(v, (list, tuple)):
            values.extend(v)
    return found


@contextmanager
def _as_is() -> Iterator[None]:
    yield
