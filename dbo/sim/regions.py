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

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from dbo.checks import as_int
from dbo.sim.cost import COMM_MODES, comm_link, comm_time_us, ep_traffic
from dbo.sim.families import host_family
from dbo.sim.hardware import HardwareProfile
from dbo.sim.records import COMM
from dbo.sim.state import CommRegion, PlannedOp, ThreadState

__all__ = ["open_region", "region_ops"]


def open_region(
    profile: HardwareProfile,
    state: ThreadState,
    kind: str,
    nbytes: int,
    mode: str,
    ep_size: int,
    link: str | None,
) -> CommRegion:
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


def region_ops(
    profile: HardwareProfile,
    region: CommRegion,
    ht_rdma_share: float,
    replaying: bool,
    ht_nvl_share: float | None = None,
) -> list[PlannedOp]:
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
        profile,
        region.kind,
        wire,
        region.ep_size,
        region.mode,
        region.link,
        rdma_bytes=rdma_bytes,
    )
    which = comm_link(profile, region.ep_size, region.link)
    args: dict[str, Any] = {"mode": region.mode, "ep_size": region.ep_size, "link": which}
    name = f"comm::{region.kind}"
    if region.mode == "ht":
        share = profile.comm_sms / profile.num_sms
        args["sm_share"] = share
        held = PlannedOp(name, cost, COMM, nbytes=nbytes, args=args, sm_share=share)
        return [_touching(held, region, fresh)]
    # The send reads the region's inputs; the transfer, on the link, writes its outputs.
    send = PlannedOp(f"{name}.send", profile.ll_send_us, COMM, reads=region.reads, fresh=fresh)
    transfer = PlannedOp(name, cost, COMM, nbytes=nbytes, writes=region.writes, launch=False)
    return [
        replace(send, args=dict(args)),
        replace(transfer, args=args, on_link=True, after_send=True),
    ]


def _touching(op: PlannedOp, region: CommRegion, fresh: Sequence[int]) -> PlannedOp:
    """`op` with all of the region's accesses."""
    return replace(op, reads=region.reads, writes=region.writes, fresh=fresh)


def _local_op(profile: HardwareProfile, region: CommRegion, fresh: list[int]) -> PlannedOp:
    args: dict[str, Any] = {"mode": region.mode, "ep_size": 1, "link": "local"}
    if region.op_fallback_us:
        args["fallback_us"] = region.op_fallback_us
    host = sum(profile.eager_host_us(host_family(n)) for n in region.op_names)
    local = PlannedOp(
        f"comm::{region.kind}",
        region.op_us,
        COMM,
        nbytes=region.op_bytes,
        args=args,
        host_us=host,
        full_grid=True,
    )
    return _touching(local, region, fresh)
