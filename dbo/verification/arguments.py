"""verify's arguments, checked before any work: a bad one raises here, with what was wrong
and what to pass instead, before the forward has run once."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from dbo.checks import as_int, writable_folder
from dbo.devices import resolve_device
from dbo.sim.device import SimDevice
from dbo.sim.options import SimOptions
from dbo.streams import Device
from dbo.ubatching import dbo_enabled
from dbo.verification.inputs import input_leaves
from dbo.verification.layout import SPLIT_RULES, SplitRules

__all__ = [
    "RACE_ORDERS",
    "check_adversarial",
    "check_args",
    "lookup_split_rules",
    "verify_device",
]

# "issue": the ubatched step as issued (on the simulated device ops run in issue order);
# "adversarial": also re-executed in a legal order that runs every race the other way round.
RACE_ORDERS = ("issue", "adversarial")


def check_args(
    forward: Any,
    num_ubatches: Any,
    split: Any,
    merge: Any,
    warmup: Any,
    atol: Any,
    rtol: Any,
    timeout: Any,
    artifacts: Any,
    race_order: Any = "issue",
) -> None:
    """Refuse any bad argument of `verify`, and a call from inside a ubatch, before work."""
    if not callable(forward):
        raise TypeError(
            f"forward must be callable (forward(batch) -> output), got {type(forward).__name__}"
        )
    as_int("num_ubatches (DBO needs two ubatches or more)", num_ubatches, minimum=2)
    for name, fn in (("split", split), ("merge", merge)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable or None, got {type(fn).__name__}")
    as_int("warmup (steps run before measuring)", warmup)
    for name, tol in (("atol", atol), ("rtol", rtol)):
        if (
            isinstance(tol, bool)
            or not isinstance(tol, (int, float))
            or not (math.isfinite(tol) and tol >= 0)
        ):
            raise ValueError(f"{name} must be a finite number >= 0, got {tol!r}")
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not (math.isfinite(timeout) and timeout > 0)
    ):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if artifacts is not None and not isinstance(artifacts, (str, Path)):
        raise TypeError(f"artifacts must be a folder path or None, got {type(artifacts).__name__}")
    if artifacts is not None:
        writable_folder("artifacts", artifacts)  # before the forward runs, not after
    if race_order not in RACE_ORDERS:
        raise ValueError(f"race_order must be one of {RACE_ORDERS}, got {race_order!r}")
    if dbo_enabled():
        raise RuntimeError(
            "dbo.verify was called inside a ubatch (a thread of a running ubatched step); it "
            "runs steps of its own: call it from outside run_ubatches"
        )


def verify_device(device: Any, inputs: Any = None) -> Device:
    """The device to run on; "sim" with meta inputs (shapes only) is a meta simulated device,
    whose race checker knows there are no storages, rather than one that would take every
    meta tensor for memory at one address."""
    if device == "sim" and any(
        isinstance(v, torch.Tensor) and v.device.type == "meta" for v in input_leaves(inputs)
    ):
        device = resolve_device("sim", SimOptions(tensor_device="meta"))
    wants_cuda = isinstance(device, str) and (device == "cuda" or device.startswith("cuda:"))
    if wants_cuda and not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r} but this machine has no CUDA device; use "
            f"device='sim' for the simulated one"
        )
    try:
        return resolve_device(device)
    except (TypeError, ValueError) as error:
        raise ValueError(f"verify: {error}") from None


def lookup_split_rules(split_rules: Any) -> SplitRules:
    """The engine's rules for empty ubatches, by name (`dbo.verification.layout`)."""
    if split_rules not in SPLIT_RULES:
        raise ValueError(f"split_rules must be one of {sorted(SPLIT_RULES)}, got {split_rules!r}")
    return SPLIT_RULES[split_rules]


def check_adversarial(device: Device, inputs: Any) -> None:
    """`race_order="adversarial"` needs the simulated device and real values."""
    if not isinstance(device, SimDevice):
        raise ValueError(
            "race_order='adversarial' re-executes a captured step on the simulated device; "
            "use device='sim'"
        )
    meta = any(
        isinstance(v, torch.Tensor) and v.device.type == "meta" for v in input_leaves(inputs)
    )
    if meta or device.torch_device.type == "meta":
        raise ValueError(
            "race_order='adversarial' compares values, and meta tensors have none; give "
            "inputs on the CPU"
        )
