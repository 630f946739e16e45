"""`verify`'s runtime choice: which ring drives the ubatched step, and `runtime="both"`.

"dbo" is this package's runtime (`run_ubatches`); "vllm" is the installed vLLM's
(`dbo.verification.vllm_runtime.run_vllm_ubatches`, its `make_ubatch_contexts` and `UBatchContext`
on the simulated GPU through the CUDA facade); "both" verifies under dbo's and also runs one more
ubatched step under each runtime, from the same batch on a reset device, and lists every difference
between the two: outputs, op order between hand-offs, the stream of each op, the events recorded
and waited on (`dbo.verification.runtime_diff`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dbo.runner import run_ubatches
from dbo.sim.device import SimDevice
from dbo.streams import Device
from dbo.ubatch_context import token_offsets_of
from dbo.verification.compare import compare, copy_batch, snapshot
from dbo.verification.report import VerifyReport, error_text
from dbo.verification.runtime_diff import RingTranscript, diff_transcripts, log_event_calls
from dbo.verification.vllm_runtime import load_vllm_ubatching, run_vllm_ubatches

__all__ = ["RUNTIMES", "check_runtime", "compare_runtimes", "record_runtime", "ubatch_runner"]

RUNTIMES = ("dbo", "vllm", "both")

Runner = Callable[[Callable[[Any], Any], Sequence[Any], Device, float], list[Any]]


def check_runtime(runtime: Any, device: Device) -> None:
    """Refuse, before any work, a runtime that is not one of RUNTIMES, or vLLM's anywhere
    but on the simulated device, or vLLM's when it is not installed."""
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {RUNTIMES}, got {runtime!r}")
    if runtime == "dbo":
        return
    if not isinstance(device, SimDevice):
        raise ValueError(
            f"runtime={runtime!r} runs vLLM's ring through the CUDA facade of the simulated "
            f"device; use device='sim' (on a real GPU vLLM's ring needs no facade)"
        )
    load_vllm_ubatching()


def _dbo(fn: Callable[[Any], Any], pieces: Sequence[Any], device: Device, timeout: float):
    # The rows vLLM's runtime passes too (each piece's first row), so a forward that reads
    # `dbo_current_ubatch_token_offset()` sees the same offsets under either ring.
    offsets = token_offsets_of(pieces)
    return run_ubatches(fn, pieces, device=device, timeout=timeout, token_offsets=offsets)


def _vllm(fn: Callable[[Any], Any], pieces: Sequence[Any], device: Device, timeout: float):
    assert isinstance(device, SimDevice)  # check_runtime refused any other device
    return run_vllm_ubatches(fn, pieces, device=device, timeout=timeout)


def ubatch_runner(runtime: str) -> Runner:
    """The launcher of the ubatched step verify measures ("both" measures dbo's)."""
    return _vllm if runtime == "vllm" else _dbo


def _one_step(
    runner: Runner,
    forward: Callable[[Any], Any],
    pieces_of: Callable[[Any], Sequence[Any]],
    merge: Callable[[list[Any]], Any],
    inputs: Any,
    device: SimDevice,
    timeout: float,
) -> tuple[RingTranscript, Any, BaseException | None]:
    device.synchronize()
    device.reset()
    batch = copy_batch(inputs)
    output, error = None, None
    with log_event_calls(device) as calls:
        try:
            output = snapshot(merge(runner(forward, pieces_of(batch), device, timeout)))
        except Exception as failure:  # noqa: BLE001 - a difference, reported as a line
            error = failure
    device.synchronize()
    return RingTranscript.of(list(device.timeline), calls), output, error


def compare_runtimes(
    forward: Callable[[Any], Any],
    inputs: Any,
    pieces_of: Callable[[Any], Sequence[Any]],
    merge: Callable[[list[Any]], Any],
    device: SimDevice,
    timeout: float,
) -> list[str]:
    """Run one ubatched step under dbo's runtime and one under vLLM's, each from a fresh copy
    of `inputs` on a reset device; one line per difference (none: they agree)."""
    args = (forward, pieces_of, merge, inputs, device, timeout)
    ours, our_out, our_error = _one_step(_dbo, *args)
    theirs, their_out, their_error = _one_step(_vllm, *args)
    if our_error is not None or their_error is not None:
        # After a failure the rings differ by design (dbo's releases the peers at once, vLLM's
        # lets them run to their next hand-off): only whether each failed is compared.
        if (our_error is None) != (their_error is None):
            return [
                f"the step failed under one runtime only: dbo {error_text(our_error)}, "
                f"vllm {error_text(their_error)}"
            ]
        return []
    found = compare(our_out, their_out, 0.0, 0.0, "vLLM runtime's output")
    lines = [] if found.match else [f"outputs differ: {found.mismatch}"]
    return lines + diff_transcripts(ours, theirs)


def record_runtime(report: VerifyReport, runtime: str, differences: list[str]) -> None:
    """Which ring ran; the two runtimes' differences fail the report. vLLM's ring makes no
    hand-off records, so yields are not counted under it."""
    report.runtime, report.runtime_differences = runtime, differences
    if differences:
        report.ok = False
    if runtime == "vllm":
        report.yield_counts = None
