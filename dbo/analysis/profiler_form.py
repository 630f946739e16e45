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


def _event(ph: str, name: str, pid: int, tid: int, **fields: Any) -> dict[str, Any]:
    """One trace event: a complete span ("X": cat, ts, dur, args) or metadata ("M": args)."""
    return {"ph": ph, "name": name, "pid": pid, "tid": tid, **fields}


def _span(cat: str, name: str, at: tuple[int, int], ts: float, dur: float, **args: Any) -> dict:
    """A complete span of `dur` from `ts`, on (pid, tid) `at`."""
    return _event("X", name, *at, cat=cat, ts=ts, dur=dur, args=args)


def _kernel_events(device: Sequence[OpRecord], streams: dict[str, int]) -> list[dict[str, Any]]:
    """Each device record as a kernel and the `cudaLaunchKernel` that launched it."""
    events = []
    for corr, r in enumerate(device, start=1):
        sid, ids = streams[r.stream], {"correlation": corr, "External id": corr}
        kernel = {"device": 0, "stream": sid, **ids}
        events.append(_span("kernel", r.name, (_DEVICE_PID, sid), r.start_us, r.dur_us, **kernel))
        launch = (_HOST_PID, _tid(r))
        events.append(_span("cuda_runtime", "cudaLaunchKernel", launch, r.issue_us, 0.0, **ids))
    return events


def _thread_names(records: Sequence[OpRecord], streams: dict[str, int]) -> list[dict[str, Any]]:
    tids = {_MAIN_TID} | {_tid(r) for r in records}
    hosts = [
        _event("M", "thread_name", _HOST_PID, t, args={"name": _thread_name(t)})
        for t in sorted(tids)
    ]
    devices = [
        _event("M", "thread_name", _DEVICE_PID, sid, args={"name": f"stream {sid}"})
        for sid in streams.values()
    ]
    return hosts + devices


def _thread_name(tid: int) -> str:
    return "main" if tid == _MAIN_TID else f"ubatch {tid - _MAIN_TID - 1}"


def profiler_trace(records: Sequence[OpRecord], step: int = 0) -> dict[str, Any]:
    """The records as one `ProfilerStep#<step>` of a torch.profiler Chrome trace."""
    device = [r for r in records if r.kind in (COMPUTE, COMM)]
    if not device:
        raise ValueError("no device records (compute or comm) to write as a profiler trace")
    streams = {s: _FIRST_STREAM + k for k, s in enumerate(dict.fromkeys(r.stream for r in device))}
    events = _kernel_events(device, streams)
    events += [
        _span("cpu_op", r.name, (_HOST_PID, _tid(r)), r.start_us, r.dur_us)
        for r in records
        if r.kind not in (COMPUTE, COMM)
    ]
    # The step spans the host's part too (syncs, hand-offs), as the host's ProfilerStep does.
    lo = min(min(r.issue_us, r.start_us) for r in records)
    hi = max(r.end_us for r in records)
    main = (_HOST_PID, _MAIN_TID)
    events.append(_span("user_annotation", f"ProfilerStep#{step}", main, lo, hi - lo))
    events += _thread_names(records, streams)
    return {"schemaVersion": 1, "traceEvents": events}


def write_profiler_trace(records: Sequence[OpRecord], path: str | Path, step: int = 0) -> Path:
    """Write `profiler_trace(records, step)` to `path` (JSON); returns the path."""
    path = Path(path)
    path.write_text(json.dumps(profiler_trace(records, step)))
    return path
