"""What `dbo.verify` compares: snapshots of outputs and batches, and the comparison itself.

A snapshot is a deep copy into memory no later run can write (tensors copied to the CPU, or
kept as meta tensors where there are no values): a forward may return a view of a module
buffer or a workspace slot that the next run overwrites, and a comparison of that view with
the ubatched output would compare the ubatched output with itself.

Two outputs match when they have the same structure (the same container types, keys and
lengths, the same Python types of scalars) and every tensor has the same dtype, device type
and shape and values within `atol + rtol * |serial|` (NaN where both are NaN). Complex values
are compared whole (the magnitude of the difference); integers and booleans exactly unless a
tolerance is given.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Comparison", "compare", "copy_batch", "same_values", "snapshot"]


def snapshot(value: Any) -> Any:
    """A deep copy of `value` whose tensors live in fresh CPU memory (meta stays meta)."""
    return _map_tensors(value, _to_cpu)


def copy_batch(value: Any) -> Any:
    """A deep copy of a batch on its own device: each run gets one, so a forward that writes
    its input cannot change what a later run sees."""
    return _map_tensors(value, lambda t: t.detach().clone())


def _to_cpu(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "meta":
        return t.detach().clone()
    return t.detach().to("cpu", copy=True)


def _map_tensors(value: Any, fn: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_map_tensors(v, fn) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(v, fn) for v in value)
    if isinstance(value, Mapping):
        try:
            return type(value)({k: _map_tensors(v, fn) for k, v in value.items()})
        except TypeError:  # a mapping type that cannot be built from a dict
            return {k: _map_tensors(v, fn) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # vLLM's IntermediateTensors and the like: each field snapshotted as it is.
        copied = copy.copy(value)
        for f in dataclasses.fields(value):
            object.__setattr__(copied, f.name, _map_tensors(getattr(value, f.name), fn))
        return copied
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - an uncopyable object is compared as it is
        return value


def same_values(a: Any, b: Any) -> bool:
    """Whether two snapshots are identical (NaN equal to NaN): did a run write its input?
    Parts that cannot be compared (objects without `==`) count as unchanged."""
    try:
        return compare(a, b, 0.0, 0.0).match
    except TypeError:
        return True


@dataclass(frozen=True)
class Comparison:
    max_abs_diff: float
    mismatch: str | None  # why the two differ, None when they match

    @property
    def match(self) -> bool:
        return self.mismatch is None


def compare(expected: Any, got: Any, atol: float, rtol: float, where: str = "output") -> Comparison:
    """Compare the serial output `expected` with the ubatched one `got`."""
    diff, why = _compare(expected, got, atol, rtol, where)
    return Comparison(diff, why)


def _compare(
    expected: Any, got: Any, atol: float, rtol: float, where: str
) -> tuple[float, str | None]:
    if isinstance(expected, torch.Tensor) or isinstance(got, torch.Tensor):
        return _compare_tensors(expected, got, atol, rtol, where)
    if type(expected) is not type(got):
        return math.inf, (
            f"{where}: a {type(got).__name__} under DBO, a {type(expected).__name__} serially"
        )
    if isinstance(expected, (tuple, list)):
        if len(got) != len(expected):
            return math.inf, (f"{where}: {len(got)} items under DBO, {len(expected)} serially")
        return _worst(
            _compare(e, g, atol, rtol, f"{where}[{i}]")
            for i, (e, g) in enumerate(zip(expected, got))
        )
    if isinstance(expected, Mapping):
        if set(got) != set(expected):
            return math.inf, (
                f"{where}: keys {sorted(map(str, got))} under DBO, "
                f"{sorted(map(str, expected))} serially"
            )
        return _worst(
            _compare(expected[k], got[k], atol, rtol, f"{where}[{k!r}]") for k in expected
        )
    if dataclasses.is_dataclass(expected) and not isinstance(expected, type):
        return _worst(
            _compare(
                getattr(expected, f.name), getattr(got, f.name), atol, rtol, f"{where}.{f.name}"
            )
            for f in dataclasses.fields(expected)
        )
    return _compare_plain(expected, got, where)


def _compare_plain(expected: Any, got: Any, where: str) -> tuple[float, str | None]:
    """Two values that are neither tensors nor containers: equal by `==`, or refused."""
    if type(expected).__eq__ is object.__eq__ and expected is not None:
        raise TypeError(
            f"{where}: cannot compare {type(expected).__name__} values (the class defines no "
            f"==, so two runs' outputs always differ); return tensors, containers of them or "
            f"dataclasses, or pass merge= to build one"
        )
    try:
        if expected == got or (_is_nan(expected) and _is_nan(got)):
            return 0.0, None
    except Exception as error:  # noqa: BLE001 - an `==` that cannot answer is a refusal
        raise TypeError(
            f"{where}: cannot compare {type(expected).__name__} values ({error}); return "
            f"tensors, containers of them or dataclasses, or pass merge= to build one"
        ) from None
    return math.inf, f"{where}: {got!r:.200} under DBO, {expected!r:.200} serially"


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def _compare_tensors(
    expected: Any, got: Any, atol: float, rtol: float, where: str
) -> tuple[float, str | None]:
    if not (isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor)):
        return math.inf, (
            f"{where}: a {type(got).__name__} under DBO, a {type(expected).__name__} serially"
        )
    for what, e, g in (
        ("dtype", expected.dtype, got.dtype),
        ("device", expected.device.type, got.device.type),
        ("shape", tuple(expected.shape), tuple(got.shape)),
    ):
        if e != g:
            return math.inf, f"{where}: {what} {_plain(g)} under DBO, {_plain(e)} serially"
    if expected.device.type == "meta" or expected.numel() == 0:
        return 0.0, None  # shapes only: no values to compare
    return _compare_values(expected, got, atol, rtol, where)


def _plain(value: Any) -> str:
    return str(value).replace("torch.", "")


def _compare_values(
    expected: torch.Tensor, got: torch.Tensor, atol: float, rtol: float, where: str
) -> tuple[float, str | None]:
    wide = torch.complex128 if expected.is_complex() else torch.float64
    a = expected.detach().to("cpu").to(wide)
    b = got.detach().to("cpu").to(wide)
    if expected.is_floating_point() or expected.is_complex() or atol or rtol:
        close = torch.isclose(b, a, atol=atol, rtol=rtol, equal_nan=True)
    else:  # integers and booleans: exact, without the float rounding of large int64 values
        close = expected.detach().to("cpu") == got.detach().to("cpu")
    same = (a == b) | (a.isnan() & b.isnan())  # inf == inf contributes 0, not inf - inf
    diff = (a - b).abs().masked_fill(same, 0.0).nan_to_num(nan=math.inf)
    worst = diff.max().item()
    if bool(close.all()):
        return worst, None
    bad = int((~close).sum().item())
    return worst, f"{where}: {bad} of {a.numel()} values differ (max abs diff {worst:.3g})"


def _worst(results: Any) -> tuple[float, str | None]:
    worst, why = 0.0, None
    for diff, reason in results:
        worst = max(worst, diff)
        why = why or reason
    return worst, why
