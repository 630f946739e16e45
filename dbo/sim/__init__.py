"""dbo.sim: the virtual-time GPU (clock, cost model, op interception, race checker, graphs).

`SimDevice` implements `dbo.streams.Device`; the records it produces (`OpRecord`,
`RaceReport`, ...) live in `dbo.sim.records` for the reports to read.
"""

from dbo.sim.cost import comm_time_us, compute_time_us
from dbo.sim.device import SimDevice, SimEvent, SimMark, SimStream
from dbo.sim.hardware import B200, H100, H200, H800, PROFILES, HardwareProfile, profile_from_name
from dbo.sim.graph import GraphReplayError, SimGraph
from dbo.sim.races import RaceError
from dbo.sim.records import COMM, COMPUTE, GRAPH_LAUNCH, HANDOFF, SYNC, Access, OpRecord, OpSite, RaceReport

__all__ = [
    "SimDevice",
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
