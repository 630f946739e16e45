"""Cost model: how long one op or one communication takes on a `HardwareProfile`.

Pure functions of shapes, dtypes and the profile; no clocks, no state. The device calls them
for every placed op; tests and the fidelity work call them directly.

Compute (roofline):  time = max(FLOPs / peak(dtype), bytes / HBM bandwidth) + kernel_fixed_us,
where FLOPs come from torch.utils.flop_counter's registered formulas (0 when an op has none:
it is then memory bound) and bytes = nbytes of every tensor input and output.

Communication:  time = latency + algo_factor(kind, ep_size) * max(nvlink bytes / NVLink bw,
RDMA bytes / RDMA bw), the two links working in parallel. Latency is the link's for "ht"
(DeepEP normal-style kernels) and `ll_latency_us` for "ll" (low-latency kernels). A group
within one node uses NVLink only; a larger group splits a rank's bytes by where its peers are
(`ep_traffic`), unless the caller says how many of them cross nodes (`rdma_bytes`, e.g. after
the per-node de-duplication of DeepEP's normal internode kernels). An EP group of one rank
moves nothing over a link: its "communication" is a local permutation, costed by the HBM
roofline of the bytes it moves (`local_copy_us`).
"""

from __future__ import annotations

import functools
import math
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
    "ep_traffic",
    "node_dedup_share",
    "local_copy_us",
    "flop_formula",
    "op_flops",
    "aliased_input_bytes",
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
    mem_us = nbytes / profile.hbm_bytes_per_us_for(dtype) if nbytes else 0.0
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


def ep_traffic(nbytes: float, ep_size: int, gpus_per_node: int) -> tuple[float, float]:
    """(NVLink bytes, RDMA bytes) of `nbytes` a rank sends to the other ranks of its group,
    spread evenly over its peers (balanced routing): (g - 1) of the ep - 1 peers share its
    node, the rest are reached over RDMA. A group within one node is all NVLink."""
    n = max(int(ep_size), 1)
    if n <= gpus_per_node:
        return float(nbytes), 0.0
    rdma = nbytes * (n - gpus_per_node) / (n - 1)
    return float(nbytes) - rdma, rdma


def node_dedup_share(
    top_k: int, ep_size: int, gpus_per_node: int, num_groups: int = 1, topk_groups: int = 1
) -> float:
    """Of a token's expert copies bound for other nodes, the share that DeepEP's normal (HT)
    internode kernels put on RDMA: they send a token once per destination node and forward it
    over NVLink there (DeepEP README: "asymmetric-domain bandwidth forwarding").

    Balanced routing. With group-limited routing (DeepSeek-V3: n_group 8, topk_group 4) whose
    groups tile the nodes, a token reaches the nodes holding its `topk_groups` groups (each
    chosen group is assumed to receive at least one of its experts); otherwise each of the
    `top_k` experts lands on a node independently.
    """
    nodes = -(-max(int(ep_size), 1) // gpus_per_node)
    if nodes <= 1 or top_k <= 0:
        return 1.0
    if topk_groups > 1 and num_groups >= nodes and num_groups % nodes == 0:
        per_node = num_groups // nodes
        untouched = math.comb(num_groups - per_node, topk_groups) / math.comb(num_groups, topk_groups)
    else:
        untouched = (1 - 1 / nodes) ** top_k
    remote_nodes = nodes * (1 - untouched) * (nodes - 1) / nodes  # own node is one of them
    remote_copies = top_k * (nodes - 1) / nodes
    return min(1.0, remote_nodes / remote_copies)


def local_copy_us(profile: HardwareProfile, nbytes: float) -> float:
    """A permutation inside one GPU (an EP group of one): bytes read and written through HBM,
    as a memory-bound kernel."""
    return compute_time_us(profile, 0.0, nbytes, torch.uint8)


def comm_time_us(
    profile: HardwareProfile,
    kind: str,
    nbytes: float,
    ep_size: int,
    mode: str = "ht",
    link: str | None = None,
    *,
    rdma_bytes: float | None = None,
) -> float:
    """Time of one communication op (dispatch, combine, all_to_all, all_reduce, ...).

    `nbytes`: what this rank sends to other ranks. `mode` "ht" (high-throughput, DeepEP
    normal-style) pays the link latency; "ll" (low-latency) pays `ll_latency_us`, its fixed
    time (see the profile). `link` forces every byte onto one link. Otherwise a group within a
    node is NVLink only, and a multi-node group splits the bytes between NVLink and RDMA
    (`rdma_bytes` if given, else by peer count) and takes the slower of the two, which run in
    parallel. NVLink bandwidth is one direction of the datasheet total; RDMA is the per-GPU NIC;
    both are scaled by the profile's measured efficiencies. ep_size 1 (and no `link`): a local
    copy of `nbytes` (read + write) at the HBM roofline, whatever the mode.
    """
    if mode not in COMM_MODES:
        raise ValueError(f"mode must be one of {COMM_MODES}, got {mode!r}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if ep_size < 1:
        raise ValueError(f"ep_size must be >= 1, got {ep_size}")
    if rdma_bytes is not None and not 0 <= rdma_bytes <= nbytes:
        raise ValueError(f"rdma_bytes must be in [0, nbytes={nbytes}], got {rdma_bytes}")
    which = comm_link(profile, ep_size, link)
    if ep_size == 1 and link is None:
        return local_copy_us(profile, nbytes)
    nvl_bw = profile.nvlink_gbps * 1e3 * profile.nvlink_efficiency  # bytes per us
    rdma_bw = profile.rdma_gbps * 1e3 * profile.rdma_efficiency
    if link is not None:
        nvl, rdma = (float(nbytes), 0.0) if which == NVLINK else (0.0, float(nbytes))
    elif rdma_bytes is not None and ep_size > profile.gpus_per_node:
        nvl, rdma = float(nbytes) - rdma_bytes, float(rdma_bytes)
    else:
        nvl, rdma = ep_traffic(nbytes, ep_size, profile.gpus_per_node)
    if mode == "ll":
        latency = profile.ll_latency_us
    else:
        latency = profile.nvlink_latency_us if which == NVLINK else profile.rdma_latency_us
    wire_us = max(nvl / nvl_bw, rdma / rdma_bw)
    return latency + algo_factor(kind, ep_size) * wire_us


# --------------------------------------------------------------------------------------------
# FLOPs


_aten = torch.ops.aten
# Fused attention kernels: torch's formula counts the full q x k square even when causal.
_ATTENTION = {
    getattr(_aten, name)
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(_aten, name)
}


def _causal_share(s_q: int, s_k: int) -> float:
    """Share of the q x k score matrix a causal kernel computes, the queries being the last
    s_q of the s_k keys (an engine's convention: new tokens attend to everything before)."""
    if s_q <= 0 or s_k <= 0:
        return 0.0
    if s_q <= s_k:
        pairs = s_q * (s_k - s_q) + s_q * (s_q + 1) / 2
    else:  # more queries than keys: the first ones see nothing
        pairs = sum(max(0, min(s_k, s_k - s_q + i + 1)) for i in range(s_q))
    return pairs / (s_q * s_k)


def _attention_flops(base: Callable[..., int], causal_at: int, *args: Any, out_val: Any = None, **kwargs: Any) -> float:
    flops = base(*args, out_val=out_val, **kwargs)
    causal = args[causal_at] if len(args) > causal_at else kwargs.get("is_causal", False)
    if causal:
        flops *= _causal_share(args[0].shape[-2], args[1].shape[-2])
    return flops


def _grouped_mm_flops(mat_a: torch.Tensor, mat_b: torch.Tensor, *args: Any, out_val: Any = None, **kwargs: Any) -> float:
    """torch._grouped_mm: each output element is one dot product over the contraction dim
    (a's last dim, except for the 2-D x 2-D form, where groups split the contraction dim and
    each of the G outputs covers a share of it)."""
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        return 2.0 * mat_a.shape[0] * mat_a.shape[1] * mat_b.shape[1]
    out = out_val if isinstance(out_val, torch.Tensor) else None
    n_out = out.numel() if out is not None else mat_a.shape[-2] * mat_b.shape[-1]
    return 2.0 * n_out * mat_a.shape[-1]


_EXTRA_FORMULAS: dict[Any, Callable[..., float]] = {}
if hasattr(_aten, "_grouped_mm"):
    _EXTRA_FORMULAS[_aten._grouped_mm] = _grouped_mm_flops


def flop_formula(func: Any) -> Callable[..., float] | None:
    """The FLOP formula of an op overload (keyed by its packet), or None: torch's registered
    one, made causal-aware for fused attention, plus torch._grouped_mm, which torch lacks."""
    packet = getattr(func, "overloadpacket", func)
    if packet in _EXTRA_FORMULAS:
        return _EXTRA_FORMULAS[packet]
    base = flop_registry.get(packet)
    if base is not None and packet in _ATTENTION:
        names = [a.name for a in func._schema.arguments] if hasattr(func, "_schema") else []
        if "is_causal" in names:
            return functools.partial(_attention_flops, base, names.index("is_causal"))
    return base


def aliased_input_bytes(func: Any, ins: list[torch.Tensor]) -> int:
    """Bytes a kernel's input list counts twice: a fused attention whose V is a view of K's
    storage (MLA's latent cache serves as both) streams those bytes once."""
    if getattr(func, "overloadpacket", func) not in _ATTENTION or len(ins) < 3:
        return 0
    k, v = ins[1], ins[2]
    try:
        if v.untyped_storage()._cdata != k.untyped_storage()._cdata:
            return 0
    except (RuntimeError, NotImplementedError):  # a tensor without a storage (subclass)
        return 0
    return v.numel() * v.element_size()


def op_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> float:
    """FLOPs of one call by `flop_formula`; 0 where there is none (memory-bound op)."""
    formula = flop_formula(func)
    if formula is None:
        return 0.0
    return float(formula(*args, **kwargs, out_val=out))
