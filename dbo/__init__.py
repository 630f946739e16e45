"""dbo: a reference runtime for Dual Batch Overlap (DBO) micro-batching.

The names mirror vLLM's (`make_ubatch_contexts`, `dbo_yield`, ...), so code written against
this package reads like an engine's. Streams come from `dbo.streams` (real CUDA or the simulated
device in `dbo.sim`); `run_ubatches` runs one ubatched step and always comes back.
"""

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
]


# `dbo.verify` (module `dbo.verification`) sits a layer above both this package's runtime and
# `workspace` (it initialises a workspace for the user), while `workspace` imports
# `dbo.ubatching`: importing it here would make `dbo` and `workspace` import each other. It is
# loaded on first use instead.
_VERIFY_NAMES = ("verify", "VerifyReport", "VerifyError")

# `dbo.analyze_trace` (package `dbo.analysis`) reads profiler traces into the simulator's
# records: loaded on first use so that `import dbo` stays light.
_ANALYSIS_NAMES = ("analyze_trace", "TraceReport")


def __getattr__(name: str):
    if name in _VERIFY_NAMES:
        from dbo import verification  # the layer above; see _VERIFY_NAMES

        return getattr(verification, name)
    if name in _ANALYSIS_NAMES:
        from dbo import analysis  # see _ANALYSIS_NAMES

        return getattr(analysis, name)
    raise AttributeError(f"module 'dbo' has no attribute {name!r}")
