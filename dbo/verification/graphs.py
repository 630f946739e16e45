"""`dbo.verify(..., graphs=runner)`: the step served through the engine's CUDA graphs, as
well as eager, and each replay checked against the batch it is replayed for.

After the eager serial and ubatched runs, the step is served through the `CUDAGraphRunner`
once serially and, where the dispatcher holds keys of verify's ubatch count, once
ubatched: the engine's key, the dispatcher's choice and the runner's checks (descriptor,
captured inputs, DP size) make a `GraphReplay`, whose output is compared with the eager
serial step's. Any problem or difference fails the report.
"""

from __future__ import annotations

from typing import Any

from dbo.streams import Device
from dbo.verification.compare import compare, copy_batch
from dbo.verification.graph_runner import CUDAGraphRunner, GraphReplay

__all__ = ["check_graphs_device", "graph_lines", "replay_steps"]


def check_graphs_device(graphs: Any, device: Device | str) -> Device:
    """The device verify runs on when given `graphs`: the runner's own (its graphs were
    captured there); refuses another device, before any work."""
    if not isinstance(graphs, CUDAGraphRunner):
        raise TypeError(
            "graphs must be a dbo.verification.graph_runner.CUDAGraphRunner (with its graphs "
            f"captured), got {type(graphs).__name__}"
        )
    if not graphs.entries:
        raise ValueError("graphs holds no captured graph; call graphs.capture_all(dummy_batch)")
    if not isinstance(device, str) and device is not graphs.device:
        raise ValueError("graphs replay on their runner's device; pass device='sim' or that one")
    return graphs.device


def replay_steps(
    graphs: CUDAGraphRunner,
    inputs: Any,
    eager_output: Any,
    num_ubatches: int,
    atol: float,
    rtol: float,
) -> list[GraphReplay]:
    """The serial step (and the ubatched one, where graphs of that count exist) served
    through `graphs`, each compared with `eager_output`."""
    counts = [1]
    if num_ubatches in graphs.dispatcher.ubatch_counts and graphs.split is not None:
        counts.append(num_ubatches)
    replays = []
    for n in counts:
        step = "serial step" if n == 1 else f"DBO step ({n} ubatches)"
        replay = graphs.run(copy_batch(inputs), num_ubatches=n, step=step)
        if replay.output is not None:
            found = compare(eager_output, replay.output, atol, rtol, "graph output")
            replay.mismatch, replay.max_abs_diff = found.mismatch, found.max_abs_diff
        replays.append(replay)
    return replays


def graph_lines(replays: list[GraphReplay]) -> list[str]:
    """The report's lines for the replays: one head per replay, then its problems."""
    lines = []
    for replay in replays:
        verdict = "ok" if replay.ok else "FAILED"
        text = replay.describe().splitlines()
        lines.append(f"  graphs           {verdict}: {text[0]}")
        lines.extend(f"    {line.strip()}" for line in text[1:])
    return lines
