"""SM control while ubatches overlap (vLLM 0.33's `SMControlContextManager` and
`create_sm_control_context`): reserve `VLLM_DBO_COMM_SMS` SMs for the communication kernels
and give the compute kernels the rest, for the length of a ubatched step.

On the simulated device the setters are the device's own (`dbo.sim.sm_control`): comm kernels
then hold the reserved share of the GPU and a ubatch's GEMMs run on the remaining SMs,
never stretched by comm. On a real GPU dbo-sim drives neither DeepEP nor DeepGEMM, so the
setters do nothing there, as vLLM's do when neither library is in use.

Differences from vLLM, each a refusal where vLLM asserts or reads past a bad value: a comm SM
count out of [0, total) and a `VLLM_DBO_COMM_SMS` that is not an integer are refused with one
line; vLLM's cap by the all-to-all manager's `max_sms_used()` has no counterpart (dbo-sim has
no such manager), and its ROCm DeepEP exception does not apply.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from dbo.devices import resolve_device
from dbo.streams import Device

__all__ = [
    "DEFAULT_DBO_COMM_SMS",
    "SMControlContextManager",
    "create_sm_control_context",
    "device_num_sms",
    "env_comm_sms",
]

DEFAULT_DBO_COMM_SMS = 20  # vLLM 0.33's default for VLLM_DBO_COMM_SMS


def device_num_sms(device: Device) -> int:
    """The SM count of `device` (vLLM's `num_compute_units`)."""
    profile = getattr(device, "profile", None)
    if profile is not None:
        return int(profile.num_sms)
    index = getattr(device, "index", None)
    return torch.cuda.get_device_properties(index or 0).multi_processor_count


class SMControlContextManager:
    """On enter: `comm_sms` SMs for communication, the rest for computation; on exit, every
    SM for both (vLLM's behaviour and signature; `device`: where to count the SMs, default
    the calling thread's)."""

    def __init__(
        self,
        comm_sms: int,
        set_comm_sms: Callable[[int], None],
        set_compute_sms: Callable[[int], None],
        *,
        device: Device | str | None = None,
    ) -> None:
        total = device_num_sms(resolve_device(device))
        if isinstance(comm_sms, bool) or not isinstance(comm_sms, int):
            raise TypeError(f"comm_sms must be an int, got {type(comm_sms).__name__}")
        if not 0 <= comm_sms < total:
            raise ValueError(
                f"comm_sms must be in [0, {total}) (the device's SMs; compute needs at least "
                f"one), got {comm_sms}"
            )
        self.total_sms = total
        self.compute_sms = total - comm_sms
        self.comm_sms = comm_sms
        self.set_comm_sms = set_comm_sms
        self.set_compute_sms = set_compute_sms

    def __enter__(self) -> None:
        self.set_comm_sms(self.comm_sms)
        self.set_compute_sms(self.compute_sms)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        self.set_comm_sms(self.total_sms)
        self.set_compute_sms(self.total_sms)
        return False


def _no_op(sms: int) -> None:
    """A setter for a kernel library that is not in use."""


def env_comm_sms() -> int:
    """`VLLM_DBO_COMM_SMS` as an int (vLLM's default when unset)."""
    text = os.environ.get("VLLM_DBO_COMM_SMS")
    if text is None:
        return DEFAULT_DBO_COMM_SMS
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"VLLM_DBO_COMM_SMS must be an integer, got {text!r}") from None


def create_sm_control_context(
    parallel_config: Any,
    *,
    device: Device | str | None = None,
    comm_sms: int | None = None,
) -> SMControlContextManager:
    """Reserve SMs for communication kernels while ubatches overlap (vLLM's, reading
    `VLLM_DBO_COMM_SMS` unless `comm_sms` is given). As in vLLM, only an expert-parallel
    config (`enable_expert_parallel`, taken as True for a config without the field, such as
    `DBOConfig`) reserves comm SMs, and nothing is set when the count is 0."""
    dev = resolve_device(device)
    sms = env_comm_sms() if comm_sms is None else comm_sms
    expert_parallel = bool(getattr(parallel_config, "enable_expert_parallel", True))
    set_comm = getattr(dev, "set_comm_sms", _no_op) if expert_parallel and sms > 0 else _no_op
    set_compute = getattr(dev, "set_compute_sms", _no_op) if sms > 0 else _no_op
    return SMControlContextManager(sms, set_comm, set_compute, device=dev)
