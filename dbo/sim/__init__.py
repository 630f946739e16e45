"""dbo.sim: the virtual-time GPU (clock, cost model, op interception, race checker, graphs).

`SimDevice` implements `dbo.streams.Device`; the records it produces (`OpRecord`,
`RaceReport`, ...) live in `dbo.sim.records` for the reports to read.

    device = SimDevice(SimOptions("h200", tensor_device="cpu"))  # or "meta": shapes only
    with device.thread_scope(ubatch_id):              # in each thread that issues work
        device.set_stream(compute); y = x @ w          # placed on `compute`, costed
        with device.comm_region("dispatch", nbytes=n, ep_size=8) as h: ...
    device.timeline, device.races, device.mark() / since() / elapsed_us(), device.reset()
    with device.graph() as g: ...; g.replay()

Modules, one job each (dependencies point down this list's reverse: device imports the rest,
state and timeline import none of the device modules): device (`SimDevice`: the one path of an
op, `issue`, and `place_op`; streams, events, syncs, comm regions, capture), options (the
checked `SimOptions` record a device is built from), handles (`SimStream`, `SimEvent`,
`SimMark`, and the `HandleSink` they feed), tracks (`Track` and vector clocks), clock (the
device's virtual time), timeline (placement arithmetic, pure), regions (what a comm region is
placed as, pure), state (the shared records: `PlannedOp`, `CommRegion`, `ThreadState`,
`SimDeviceProtocol`),
intercept (op classification and the two torch modes), graph (capture and replay), log (what a
device reports), races (happens-before over byte ranges) with race_memory, footprints and
stacks, ranges (named host ranges), cuda_facade (torch's and vLLM's CUDA stream and event
calls answered by a SimDevice), hardware (profiles), cost (roofline and comm time, pure
functions) with families (which op is which), records (the contract with the reports),
summary / trace / trace_read / window / plot / report (the reports).
"""

from dbo.sim.cost import comm_time_us, compute_time_us
from dbo.sim.cuda_facade import cuda_facade
from dbo.sim.device import SimDevice, SimEvent, SimMark, SimStream
from dbo.sim.graph import (
    GraphComm,
    GraphEventRecord,
    GraphEventWait,
    GraphOp,
    GraphReplayError,
    SimGraph,
)
from dbo.sim.hardware import B200, H100, H200, H800, PROFILES, HardwareProfile, profile_from_name
from dbo.sim.options import EngineKnobs, ProfileOverrides, SimOptions
from dbo.sim.races import RaceError
from dbo.sim.records import (
    COMM,
    COMPUTE,
    GRAPH_LAUNCH,
    HANDOFF,
    SYNC,
    Access,
    OpRecord,
    OpSite,
    RaceReport,
)
from dbo.sim.state import PlannedOp

__all__ = [
    "SimDevice",
    "SimOptions",
    "ProfileOverrides",
    "EngineKnobs",
    "PlannedOp",
    "cuda_facade",
    "SimStream",
    "SimEvent",
    "SimMark",
    "HardwareProfile",
    "H200",
    "H100",
    "H800",
    "B200",
    "PROFILES",
    "profile_from_name",
    "comm_time_us",
    "compute_time_us",
    "RaceError",
    "GraphReplayError",
    "SimGraph",
    "GraphOp",
    "GraphEventRecord",
    "GraphEventWait",
    "GraphComm",
    "GRAPH_LAUNCH",
    "Access",
    "OpRecord",
    "OpSite",
    "RaceReport",
    "COMPUTE",
    "COMM",
    "SYNC",
    "HANDOFF",
]
