"""Device records written as `torch.profiler` writes a Chrome trace, so they analyze as one.

One job: turn `OpRecord`s (a simulated step, or any normalised one) into the event shapes
`export_chrome_trace` produces: kernels as `"cat": "kernel"` on device 0 with a stream id and
a correlation id, each launched by a `"cuda_runtime"` `cudaLaunchKernel` call with the same
correlation on its host thread (one thread per ubatch), host-side records (syncs, hand-offs)
as CPU ops on their thread, and the step as a `ProfilerStep#N` span. A simulated step written
this way goes through the same reading, stream-role, launch and step rules as a real trace,
which is what makes a round trip against the simulator's own summary a test of those rules.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dbo.sim.records import COMM, COMPUTE, OpRecord

__all__ = ["profiler_trace", "write_profiler_trace"]

_DEVICE_PID = 0
_HOST_PID = 1
_FIRST_STREAM = 7  # the default stream's id in CUDA traces; the simulator's streams follow
_MAIN_TID = 100  # records with no ubatch; ubatch u launches from thread _MAIN_TID + 1 + u


def _tid(r: OpRecord) -> int:
    return _MAIN_TID if r.ubatch is None else _MAIN_TID + 1 + r.ubatch


def profiler_trace(records: Sequence[OpRecord], step: int = 0) -> dict[str, Any]:
    """The records as one `ProfilerStep#<step>` of a torch.profiler Chrome trace."""
    device = [r for r in records if r.kind in (COMPUTE, COMM)]
    if not device:
        raise ValueError("no device records (compute or comm) to write as a profiler trace")
    streams = {s: _FIRST_STREAM + k for k, s in enumerate(dict.fromkeys(r.stream for r in device))}
    events: list[dict[str, Any]] = []
    for corr, r in enumerate(device, start=1):
        sid = streams[r.stream]
        events.append({
            "ph": "X", "cat": "kernel", "name": r.name, "pid": _DEVICE_PID, "tid": sid,
            "ts": r.start_us, "dur": r.dur_us,
            "args": {"device": 0, "stream": sid, "correlation": corr, "External id": corr},
        })  # fmt: skip
        events.append({
            "ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": _HOST_PID,
            "tid": _tid(r), "ts": r.issue_us, "dur": 0.0,
            "args": {"correlation": corr, "External id": corr},
        })  # fmt: skip
    for r in records:
        if r.kind not in (COMPUTE, COMM):
            events.append({
                "ph": "X", "cat": "cpu_op", "name": r.name, "pid": _HOST_PID, "tid": _tid(r),
                "ts": r.start_us, "dur": r.dur_us, "args": {},
            })  # fmt: skip
    # The step spans the host's part too (syncs, hand-offs), as the host's ProfilerStep does.
    lo = min(min(r.issue_us, r.start_us) for r in records)
    hi = max(r.end_us for r in records)
    events.append({
        "ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": _HOST_PID,
        "tid": _MAIN_TID, "ts": lo, "dur": hi - lo, "args": {},
    })  # fmt: skip
    tids = {_MAIN_TID} | {_tid(r) for r in records}
    events += [
        {"ph": "M", "name": "thread_name", "pid": _HOST_PID, "tid": t,
         "args": {"name": "main" if t == _MAIN_TID else f"ubatch {t - _MAIN_TID - 1}"}}
        for t in sorted(tids)
    ]  # fmt: skip
    events += [
        {"ph": "M", "name": "thread_name", "pid": _DEVICE_PID, "tid": sid,
         "args": {"name": f"stream {sid}"}}
        for sid in streams.values()
    ]  # fmt: skip
    return {"schemaVersion": 1, "traceEvents": events}


def write_profiler_trace(records: Sequence[OpRecord], path: str | Path, step: int = 0) -> Path:
    """Write `profiler_trace(records, step)` to `path` (JSON); returns the path."""
    path = Path(path)
    path.write_text(json.dumps(profiler_trace(records, step)))
    return path
