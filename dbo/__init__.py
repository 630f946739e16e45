"""dbo: a reference runtime for Dual Batch Overlap (DBO) micro-batching.

The names mirror vLLM's (`make_ubatch_contexts`, `dbo_yield`, ...), so code written against
this package reads like an engine's. Streams come from `dbo.streams` (real CUDA or the simulated
device in `dbo.sim`); `run_ubatches` runs one ubatched step and always comes back.

This module is the facade: the runtime's names, `analyze_trace` (`dbo.analysis`), and the tools
that check a forward (`verify`, `verify_ranks`: `dbo.verification`), imported last. Importing it
loads the simulator's modules but changes no torch state: the simulator hooks NVTX only when a
simulated device is first used.
"""

from dbo.analysis import TraceReport, analyze_trace
from dbo.collective_calls import CollectiveMismatchError
from dbo.devices import (
    current_device,
    current_stream,
    get_default_device,
    record_stream,
    set_default_device,
    use_device,
)
from dbo.errors import (
    ReadyBarrierBroken,
    StepAborted,
    UBatchAbandoned,
    UBatchError,
    UBatchTimeoutError,
    YieldMismatchError,
)
from dbo.fingerprint import collective_kind
from dbo.runner import DEFAULT_TIMEOUT_S, merge_outputs, run_ubatches
from dbo.streams import CudaDevice, Device, Event, Stream, stream_context
from dbo.ubatching import (
    UBatchContext,
    current_forward_context,
    dbo_current_ubatch_id,
    dbo_current_ubatch_token_offset,
    dbo_enabled,
    dbo_get_previous_event,
    dbo_maybe_run_recv_hook,
    dbo_register_recv_hook,
    dbo_switch_to_comm,
    dbo_switch_to_comm_sync,
    dbo_switch_to_compute,
    dbo_switch_to_compute_sync,
    dbo_yield,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
    make_ubatch_contexts,
    set_forward_context,
)

# The tools last: they stand on everything above (and on `workspace`, whose modules stand on
# this package's runtime), and nothing in the runtime imports them.
from dbo.verification import (
    RanksReport,
    VerifyError,
    VerifyRanksError,
    VerifyReport,
    verify,
    verify_ranks,
)

__all__ = [
    "UBatchError",
    "UBatchTimeoutError",
    "YieldMismatchError",
    "StepAborted",
    "ReadyBarrierBroken",
    "UBatchAbandoned",
    "DEFAULT_TIMEOUT_S",
    "merge_outputs",
    "run_ubatches",
    "CudaDevice",
    "Device",
    "Event",
    "Stream",
    "current_device",
    "current_stream",
    "get_default_device",
    "record_stream",
    "set_default_device",
    "stream_context",
    "use_device",
    "UBatchContext",
    "current_forward_context",
    "dbo_current_ubatch_id",
    "dbo_current_ubatch_token_offset",
    "dbo_enabled",
    "dbo_get_previous_event",
    "dbo_maybe_run_recv_hook",
    "dbo_register_recv_hook",
    "dbo_switch_to_comm",
    "dbo_switch_to_comm_sync",
    "dbo_switch_to_compute",
    "dbo_switch_to_compute_sync",
    "dbo_yield",
    "dbo_yield_and_switch_from_comm_to_compute",
    "dbo_yield_and_switch_from_compute_to_comm",
    "make_ubatch_contexts",
    "set_forward_context",
    "verify",
    "VerifyReport",
    "VerifyError",
    "analyze_trace",
    "TraceReport",
    "verify_ranks",
    "RanksReport",
    "VerifyRanksError",
    "collective_kind",
    "CollectiveMismatchError",
]
