"""Cost model: how long one op or one communication takes on a `HardwareProfile`.

Pure functions of shapes, dtypes and the profile; no clocks, no state. The device calls them
for every placed op; tests and the fidelity work call them directly.

Compute (roofline):  time = max(FLOPs / peak(dtype), bytes / HBM bandwidth) + kernel_fixed_us,
where FLOPs come from torch.utils.flop_counter's registered formulas (0 when an op has none:
it is then memory bound) and bytes = nbytes of every tensor input and output.

Communication:  time = latency(link) + algo_factor(kind, ep_size) * nbytes / bandwidth(link).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.flop_counter import flop_registry

from dbo.sim.hardware import HardwareProfile

__all__ = [
    "NVLINK",
    "RDMA",
    "COMM_MODES",
    "compute_time_us",
    "comm_time_us",
    "comm_link",
    "algo_factor",
    "flop_formula",
    "op_flops",
]

NVLINK = "nvlink"
RDMA = "rdma"
COMM_MODES = ("ht", "ll")


def compute_time_us(
    profile: HardwareProfile, flops: float, nbytes: float, dtype: torch.dtype
) -> float:
    """Roofline time of one kernel: the slower of its math and its memory traffic, plus the
    fixed per-kernel time."""
    math_us = flops / profile.peak_flops_per_us(dtype) if flops else 0.0
    mem_us = nbytes / profile.hbm_bytes_per_us if nbytes else 0.0
    return max(math_us, mem_us) + profile.kernel_fixed_us


def comm_link(profile: HardwareProfile, ep_size: int, link: str | None = None) -> str:
    """Which link carries a group's traffic: NVLink within a node, RDMA once the group spans
    nodes (a simplification: a multi-node group is costed at the slower link throughout)."""
    if link is not None:
        if link not in (NVLINK, RDMA):
            raise ValueError(f"link must be {NVLINK!r}, {RDMA!r} or None, got {link!r}")
        return link
    return NVLINK if ep_size <= profile.gpus_per_node else RDMA


def algo_factor(kind: str, ep_size: int) -> float:
    """Bytes on the wire per payload byte, by collective.

    dispatch/combine/all_to_all/send/recv: `nbytes` is what this rank sends, factor 1.
    all_reduce (ring): 2 (n-1)/n of the buffer crosses each link; all_gather and
    reduce_scatter: (n-1)/n. Unknown kinds are treated as point-to-point (factor 1).
    """
    n = max(int(ep_size), 1)
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    return 1.0


def comm_time_us(
    profile: HardwareProfile,
    kind: str,
    nbytes: float,
    ep_size: int,
    mode: str = "ht",
    link: str | None = None,
) -> float:
    """Time of one communication op (dispatch, combine, all_to_all, all_reduce, ...).

    latency(link) + algo_factor(kind, ep_size) * nbytes / (bandwidth(link) * efficiency).
    NVLink bandwidth is one direction of the datasheet total; RDMA is per-GPU NIC bandwidth.
    `mode` ("ht" or "ll") does not change the time here: it changes where the op runs (SMs on
    the comm stream vs. a link track) and is validated so a typo fails loudly.
    """
    if mode not in COMM_MODES:
        raise ValueError(f"mode must be one of {COMM_MODES}, got {mode!r}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if ep_size < 1:
        raise ValueError(f"ep_size must be >= 1, got {ep_size}")
    which = comm_link(profile, ep_size, link)
    if which == NVLINK:
        latency = profile.nvlink_latency_us
        bytes_per_us = profile.nvlink_gbps * 1e3 * profile.nvlink_efficiency
    else:
        latency = profile.rdma_latency_us
        bytes_per_us = profile.rdma_gbps * 1e3 * profile.rdma_efficiency
    return latency + algo_factor(kind, ep_size) * nbytes / bytes_per_us


# --------------------------------------------------------------------------------------------
# FLOPs


def flop_formula(func: Any) -> Callable[..., int] | None:
    """The registered FLOP formula of an op overload (keyed by its packet), or None."""
    packet = getattr(func, "overloadpacket", func)
    return flop_registry.get(packet)


def op_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> float:
    """FLOPs of one call by torch's formula; 0 where torch has none (memory-bound op)."""
    formula = flop_formula(func)
    if formula is None:
        return 0.0
    return float(formula(*args, **kwargs, out_val=out))
