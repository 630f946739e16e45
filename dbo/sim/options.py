"""The checked construction options of a `SimDevice`: its profile with overrides, where its
tensors live, and the knobs that must be in range. Each bad value is refused with one line
saying what was wrong, before the device holds any state."""

from __future__ import annotations

from dataclasses import replace

import torch

from dbo.sim.hardware import HardwareProfile, profile_from_name

__all__ = ["RACE_ACTIONS", "check_knobs", "profile_with", "tensor_device_of"]

RACE_ACTIONS = ("record", "raise", "warn")


def profile_with(profile: str | HardwareProfile, **overrides: float | None) -> HardwareProfile:
    """The named (or given) profile with the overrides that are set."""
    base = profile_from_name(profile)
    given = {k: v for k, v in overrides.items() if v is not None}
    return replace(base, **given) if given else base


def tensor_device_of(tensor_device: str | torch.device) -> torch.device:
    """Where a simulated device's tensors live: "cpu" (real values) or "meta" (shapes only)."""
    device = torch.device(tensor_device)
    if device.type not in ("cpu", "meta"):
        raise ValueError(
            f"tensor_device must be 'cpu' (real values) or 'meta' (shapes only), got "
            f"{tensor_device!r}"
        )
    return device


def check_knobs(
    profile: HardwareProfile,
    race_action: str,
    dbo_gemm_sms: int | None,
    ht_rdma_share: float,
    ht_nvl_share: float | None = None,
) -> None:
    """Refuse a race action, reserved GEMM SM count or RDMA share out of range.

    `dbo_gemm_sms`: SGLang's two-batch overlap caps DeepGEMM at (SMs - DeepEP's SMs) for the
    whole ubatched prefill step (sglang operations_strategy.py: deep_gemm_num_sms), so its
    GEMMs never share SMs with the comm kernels, and always run on fewer of them.
    `ht_rdma_share`: of the bytes a multi-node "ht" region sends off-node, the share that
    crosses RDMA: DeepEP's normal kernels send a token once per destination node and forward
    it over NVLink there (`dbo.sim.cost.node_dedup_share` derives it from the routing); 1.0 is
    one RDMA copy per expert copy, as the low-latency kernels send. `ht_nvl_share`: NVLink
    bytes per byte of expert copies sent, one per token and destination rank as DeepEP's
    normal kernels move them (`dbo.sim.traffic.balanced_dedup` gives both shares, its own
    node and rank included); None keeps every byte not on RDMA on NVLink."""
    if race_action not in RACE_ACTIONS:
        raise ValueError(f"race_action must be 'record', 'raise' or 'warn', got {race_action!r}")
    if dbo_gemm_sms is not None and not 0 < dbo_gemm_sms <= profile.num_sms:
        raise ValueError(f"dbo_gemm_sms must be in (0, {profile.num_sms}], got {dbo_gemm_sms!r}")
    for name, share in (("ht_rdma_share", ht_rdma_share), ("ht_nvl_share", ht_nvl_share)):
        if share is not None and not 0.0 < share < float("inf"):
            raise ValueError(f"{name} must be a positive share of the bytes, got {share!r}")
