"""What a finished comm region is placed as: pure planning of its ops and their costs.

"ht" (high-throughput): one op on the region's stream, holding comm_sms / num_sms of the SMs
for its duration, costed by `dbo.sim.cost.comm_time_us` (`ht_rdma_share` scales the RDMA part
of a multi-node region: DeepEP's per-node de-duplication; `ht_nvl_share`, where given, sets
the NVLink part: one copy per token and destination rank, `dbo.sim.traffic`). "ll"
(low-latency): a send on the region's stream, then the transfer on the device's link track,
leaving after the send. An EP group of one rank moves no byte over a link: the block's own
ops (a gather, a weighting, a scatter-add) are its whole cost, issued eagerly like any op,
and placed as one full-grid kernel on its stream that takes the GPU in turn with compute,
in either mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dbo.checks import as_int
from dbo.sim.cost import COMM_MODES, comm_link, comm_time_us, ep_traffic, host_family
from dbo.sim.hardware import HardwareProfile
from dbo.sim.records import Access
from dbo.sim.state import CommRegion, ThreadState

__all__ = ["RegionOp", "open_region", "region_ops"]


def open_region(
    profile: HardwareProfile, state: ThreadState, kind: str, nbytes: int, mode: str,
    ep_size: int, link: str | None,
) -> CommRegion:  # fmt: skip
    """A checked comm region entered by the thread whose state is `state`, on its current
    stream (not yet made the thread's: the caller does that around the block)."""
    if mode not in COMM_MODES:
        raise ValueError(f"mode must be one of {COMM_MODES}, got {mode!r}")
    nbytes = as_int("nbytes", nbytes)
    ep_size = as_int("ep_size", ep_size, minimum=1)
    comm_link(profile, ep_size, link)  # validates `link`
    if state.comm is not None:
        raise RuntimeError(
            f"comm_region({kind!r}) entered inside comm_region({state.comm.kind!r}); "
            f"one communication op cannot contain another"
        )
    return CommRegion(kind, nbytes, mode, ep_size, link, state.stream, [], [], [], [])


@dataclass(frozen=True)
class RegionOp:
    """One op a comm region is placed as (arguments of `SimDevice.place_op`)."""

    name: str
    cost_us: float
    on_link: bool = False  # on the link track (a low-latency transfer), not the region's stream
    after_send: bool = False  # leaves once the op before it (its send) has ended
    nbytes: float = 0.0
    reads: list[Access] = field(default_factory=list)
    writes: list[Access] = field(default_factory=list)
    fresh: list[int] = field(default_factory=list)
    args: dict[str, Any] = field(default_factory=dict)
    sm_share: float = 0.0
    launch: bool = True
    host_us: float | None = None
    full_grid: bool = False


def region_ops(
    profile: HardwareProfile,
    region: CommRegion,
    ht_rdma_share: float,
    replaying: bool,
    ht_nvl_share: float | None = None,
) -> list[RegionOp]:
    """The ops `region` is placed as, in order (see the module docstring)."""
    # A replayed graph writes the storages it captured: nothing is freshly allocated.
    fresh = [] if replaying else region.fresh
    if region.ep_size == 1 and region.link is None and region.op_names:
        return [_local_op(profile, region, fresh)]
    nbytes = region.nbytes
    wire, rdma_bytes = nbytes, None
    if region.mode == "ht" and region.link is None and region.ep_size > profile.gpus_per_node:
        rdma_bytes = ep_traffic(nbytes, region.ep_size, profile.gpus_per_node)[1] * ht_rdma_share
    if region.mode == "ht" and region.link is None and ht_nvl_share is not None:
        wire = nbytes * ht_nvl_share + (rdma_bytes or 0.0)  # NVLink and RDMA as DeepEP's kernels
    cost = comm_time_us(
        profile, region.kind, wire, region.ep_size, region.mode, region.link,
        rdma_bytes=rdma_bytes,
    )  # fmt: skip
    which = comm_link(profile, region.ep_size, region.link)
    args: dict[str, Any] = {"mode": region.mode, "ep_size": region.ep_size, "link": which}
    name = f"comm::{region.kind}"
    if region.mode == "ht":
        share = profile.comm_sms / profile.num_sms
        args["sm_share"] = share
        return [
            RegionOp(
                name, cost, nbytes=nbytes, reads=region.reads, writes=region.writes,
                fresh=fresh, args=args, sm_share=share,
            )
        ]  # fmt: skip
    send = RegionOp(
        f"{name}.send", profile.ll_send_us, reads=region.reads, fresh=fresh, args=dict(args)
    )
    transfer = RegionOp(
        name, cost, on_link=True, after_send=True, nbytes=nbytes, writes=region.writes,
        args=args, launch=False,
    )  # fmt: skip
    return [send, transfer]


def _local_op(profile: HardwareProfile, region: CommRegion, fresh: list[int]) -> RegionOp:
    args: dict[str, Any] = {"mode": region.mode, "ep_size": 1, "link": "local"}
    if region.op_fallback_us:
        args["fallback_us"] = region.op_fallback_us
    host = sum(profile.eager_host_us(host_family(n)) for n in region.op_names)
    return RegionOp(
        f"comm::{region.kind}", region.op_us, nbytes=region.op_bytes, reads=region.reads,
        writes=region.writes, fresh=fresh, args=args, host_us=host, full_grid=True,
    )  # fmt: skip
