"""Fidelity rows of DeepEP's kernel tables (low-latency times, normal-mode bandwidths):
pure cost-model arithmetic (`dbo.sim.cost.comm_time_us`) on the H800 profile."""

from __future__ import annotations

from dbo.sim.cost import comm_time_us, node_dedup_share
from dbo.sim.hardware import H800, HardwareProfile
from scenarios.lib.fidelity_rows import (
    DEEPEP_HIDDEN,
    DEEPEP_LL_PUBLISHED,
    DEEPEP_LL_TOKENS,
    DEEPEP_NORMAL_TOKENS,
    DEEPEP_NVLINK_PUBLISHED,
    DEEPEP_RDMA_PUBLISHED,
    DEEPEP_README,
    DEEPEP_TOPK,
    FidelityRow,
    deepep_ll_constant,
    deepep_ll_figures,
    deepep_ll_table_note,
    rel_row,
)

__all__ = ["DEEPEP_BYTES", "deepep_ll_us", "normal_bandwidth_gbps", "deepep_rows"]

# --------------------------------------------------------------------------------------------
# DeepEP kernels: pure cost-model arithmetic


def _dispatch_bytes_per_copy(hidden: int) -> int:
    """FP8 token plus one FP32 scale per 128 channels, as DeepEP's FP8 dispatch sends it."""
    return hidden + hidden // 128 * 4


# Bytes one (token, expert) copy carries: FP8 with scales out, BF16 back.
DEEPEP_BYTES = {"dispatch": _dispatch_bytes_per_copy(DEEPEP_HIDDEN), "combine": DEEPEP_HIDDEN * 2}


def deepep_ll_us(
    kind: str, ep_size: int, profile: HardwareProfile = H800, *, tokens: int = DEEPEP_LL_TOKENS
) -> float:
    """Simulated DeepEP low-latency dispatch or combine time: every (token, expert) copy bound
    for another rank is one message; in-node peers over NVLink, the rest over RDMA."""
    per_copy = _dispatch_bytes_per_copy(DEEPEP_HIDDEN) if kind == "dispatch" else DEEPEP_HIDDEN * 2
    nbytes = tokens * DEEPEP_TOPK * per_copy * (ep_size - 1) / ep_size
    return comm_time_us(profile, kind, nbytes, ep_size, mode="ll")


def normal_bandwidth_gbps(kind: str, ep_size: int, profile: HardwareProfile) -> tuple[float, float]:
    """(simulated bandwidth in GB/s, bytes it counts) of a DeepEP normal dispatch/combine of
    4096 tokens: within a node the expert copies sent to other ranks; across whole nodes one
    copy per (token, node) pair, the own node included, as DeepEP's internode test counts
    them, with its routing (groups = nodes, top-4 groups). The time is the formula's: the
    RDMA link carries only the remote nodes' copies."""
    per_copy = _dispatch_bytes_per_copy(DEEPEP_HIDDEN) if kind == "dispatch" else DEEPEP_HIDDEN * 2
    nbytes = DEEPEP_NORMAL_TOKENS * DEEPEP_TOPK * per_copy * (ep_size - 1) / ep_size
    if ep_size <= profile.gpus_per_node:
        return nbytes / comm_time_us(profile, kind, nbytes, ep_size, mode="ht") / 1e3, nbytes
    nodes, rest = divmod(ep_size, profile.gpus_per_node)
    if rest:
        raise ValueError(
            f"EP {ep_size} is not a whole number of {profile.gpus_per_node}-GPU nodes; "
            "DeepEP's internode figures run whole nodes"
        )
    share = node_dedup_share(DEEPEP_TOPK, ep_size, profile.gpus_per_node, nodes, min(nodes, 4))
    rdma = nbytes * (ep_size - profile.gpus_per_node) / (ep_size - 1) * share
    time_us = comm_time_us(profile, kind, nbytes, ep_size, mode="ht", rdma_bytes=rdma)
    # every node is alike under balanced routing: a token reaches its own node as often as
    # any other, so the pairs DeepEP counts are the remote ones times nodes / (nodes - 1)
    counted = rdma * nodes / (nodes - 1)
    return counted / time_us / 1e3, counted


# Over two nodes the formula's time is its NVLink forwarding's, not the NIC's.
EP16_NOTE = "; over two nodes this formula's time is set by its NVLink forwarding, not the NIC"


def deepep_rows(profile: HardwareProfile = H800) -> list[FidelityRow]:
    """DeepEP's published kernel figures: low-latency times, then normal-mode bandwidths."""
    return _ll_rows(profile) + _normal_rows(profile)


def _ll_rows(profile: HardwareProfile) -> list[FidelityRow]:
    rows = []
    for ep, (dispatch, combine) in DEEPEP_LL_PUBLISHED.items():
        for kind, published in (("dispatch", dispatch), ("combine", combine)):
            constant = deepep_ll_constant(ep, kind)
            if constant == "ll_latency_us":
                note = (
                    f"calibration: ll_latency_us ({profile.ll_latency_us:g} us) is this figure "
                    "minus its NVLink transfer time"
                )
            elif constant:
                note = (
                    "calibration: ll_rdma_efficiency was read off DeepEP's low-latency times "
                    f"at {deepep_ll_figures('efficiency')} through the all-ranks replay, i.e. "
                    "partly off this figure; this balanced formula leaves out the routing "
                    "imbalance the replay sees"
                )
            else:
                note = ""
            table = deepep_ll_table_note(ep, kind)
            note = "; ".join(part for part in (note, table) if part)
            rows.append(
                rel_row(
                    f"deepep-ll-{kind}-ep{ep}",
                    f"DeepEP LL {kind}, EP {ep}, 128 tok",
                    published,
                    deepep_ll_us(kind, ep, profile),
                    "us",
                    "H800",
                    DEEPEP_README,
                    note,
                    calibration=constant is not None,
                )
            )
    return rows


def _normal_rows(profile: HardwareProfile) -> list[FidelityRow]:
    rows = []
    for kind, published in DEEPEP_NVLINK_PUBLISHED.items():
        bw, _ = normal_bandwidth_gbps(kind, 8, profile)
        rows.append(
            rel_row(
                f"deepep-normal-nvlink-{kind}",
                f"DeepEP normal {kind} NVLink bw, EP 8",
                published,
                bw,
                "GB/s",
                "H800",
                DEEPEP_README,
                f"calibration: nvlink_efficiency {profile.nvlink_efficiency:g} comes from "
                "DeepEP's '~160 GB/s NVLink maximum', stated beside this figure",
                calibration=True,
            )
        )
    for ep, published in DEEPEP_RDMA_PUBLISHED.items():
        for kind, value in zip(("dispatch", "combine"), published):
            bw, _ = normal_bandwidth_gbps(kind, ep, profile)
            rows.append(
                rel_row(
                    f"deepep-normal-rdma-{kind}-ep{ep}",
                    f"DeepEP normal {kind} RDMA bw, EP {ep}",
                    value,
                    bw,
                    "GB/s",
                    "H800",
                    DEEPEP_README,
                    f"calibration: the normal kernels keep rdma_efficiency "
                    f"{profile.rdma_efficiency:g} because with it the all-ranks replay reads "
                    "DeepEP's internode bandwidths within 10%"
                    + (EP16_NOTE if ep == 2 * profile.gpus_per_node else ""),
                    calibration=True,
                )
            )
    return rows
