"""A small torch.profiler-shaped trace and the malformed events the analysis must skip and
count, shared by the analysis tests and the CLI's hostile-input cases (importable from any test
folder: `tests/` is on the path through its conftest)."""

from __future__ import annotations

import json
from typing import Any

KERNEL = {
    "ph": "X",
    "cat": "kernel",
    "name": "nvjet_gemm",
    "pid": 0,
    "tid": 7,
    "ts": 400.0,
    "dur": 10.0,
    "args": {"stream": 7, "correlation": 99},
}
LAUNCH = {
    "ph": "X",
    "cat": "cuda_runtime",
    "name": "cudaLaunchKernel",
    "pid": 1,
    "tid": 100,
    "ts": 395.0,
    "dur": 2.0,
    "args": {"correlation": 99},
}


def without(event: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in event.items() if k != key}


# Each a kernel, launch or step range the analysis cannot read, or no event at all.
MALFORMED: dict[str, Any] = {
    "kernel-without-ts": without(KERNEL, "ts"),
    "kernel-without-name": without(KERNEL, "name"),
    "ts-null": {**KERNEL, "ts": None},
    "ts-string": {**KERNEL, "ts": "400"},
    "ts-1e308": {**KERNEL, "ts": 1e308},
    "dur-negative": {**KERNEL, "dur": -5.0},
    "dur-nan": {**KERNEL, "dur": float("nan")},
    "dur-infinity": {**KERNEL, "dur": float("inf")},
    "dur-string": {**KERNEL, "dur": "10"},
    "launch-without-tid": without(LAUNCH, "tid"),
    "launch-string-tid": {**LAUNCH, "tid": "main"},
    "args-string": {**KERNEL, "args": "stream 7"},
    "args-list": {**KERNEL, "args": [7, 99]},
    "correlation-list": {**KERNEL, "args": {"stream": 7, "correlation": [99]}},
    "step-range-string-dur": {
        "ph": "X",
        "cat": "user_annotation",
        "name": "ProfilerStep#3",
        "pid": 1,
        "tid": 100,
        "ts": 80.0,
        "dur": "300",
    },
    "not-an-object": [1, 2, 3],
}


def tiny_trace(*extra: Any) -> dict[str, Any]:
    """Four kernels on two streams, each launched by thread 100 ten us before it, plus
    `extra` events."""
    events: list[Any] = [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 100, "args": {"name": "main"}}
    ]
    for k in range(4):
        stream = 7 if k % 2 == 0 else 9
        name = "nvjet_gemm" if stream == 7 else "ncclDevKernel_AllToAll"
        events.append(
            {
                "ph": "X",
                "cat": "kernel",
                "name": name,
                "pid": 0,
                "tid": stream,
                "ts": 100.0 + 50 * k,
                "dur": 40.0,
                "args": {"stream": stream, "correlation": k + 1, "device": 0},
            }
        )
        events.append(
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": "cudaLaunchKernel",
                "pid": 1,
                "tid": 100,
                "ts": 90.0 + 50 * k,
                "dur": 5.0,
                "args": {"correlation": k + 1},
            }
        )
    return {
        "schemaVersion": 1,
        "deviceProperties": [{"name": "NVIDIA H200"}],
        "traceEvents": events + list(extra),
    }


def trace_text(*extra: Any) -> str:
    return json.dumps(tiny_trace(*extra))  # NaN and Infinity as JSON's literals
