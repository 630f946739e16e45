"""DP ranks replaying CUDA graphs of different sizes, rebuilt on two real gloo ranks and caught
by `dbo.verify_ranks(graphs=)` with no check the step calls by hand.

Each rank captures its own FULL decode graphs (`FULL_DECODE_ONLY`, capture sizes 1, 2, 4, 8,
as `scenarios.bugs.vllm_graphs` does in one process) and serves its step through them. The
count each replayed graph must have comes from the ranks themselves: `verify_ranks` makes the
DP agreement on the real group before the step and hands it to each rank's runner. Rank 0
runs a real decode step of 8 tokens; rank 1 is idle and runs the engine's dummy run, whose
inputs are sized by the agreed count (vLLM pads them) and whose graph key is the rebuilt bug.
A correct engine keys the dummy run by the agreed count, read from its runner's
`num_tokens_across_dp`, as vLLM's `_dummy_run` reads `num_tokens_after_padding`.
"""

from __future__ import annotations

from collections.abc import Callable

import dbo
from dbo.graph_dispatch import BatchDescriptor
from dbo.sim import SimDevice
from dbo.split import UBatchSlice, split_attn_metadata
from dbo.verification.graph_runner import CUDAGraphRunner
from scenarios.bugs.dp_steps import report_verdict
from scenarios.bugs.registry import Verdict, bug
from scenarios.bugs.vllm_graphs import attention, decode_batch, dispatcher

__all__ = ["decode_split", "graphs_for", "mrope_batch", "verdict"]

TIMEOUT_S = 30.0
STEP_TOKENS = 8  # rank 0's decode step, a capture size: both ranks' graphs are of 8 tokens
MROPE_SECTIONS = 3  # mRoPE's positions: one row per section (temporal, height, width)
_BY = "dbo.verify_ranks (graphs: each rank's runner checked against the ranks' DP agreement)"


def mrope_batch(num_tokens: int) -> dict:
    """A multimodal model's decode batch: mRoPE positions of shape (3, num_tokens)."""
    batch = decode_batch(num_tokens)
    row = batch["attn"].positions
    batch["positions"] = row.expand(MROPE_SECTIONS, num_tokens).clone()
    return batch


def decode_split(batch: dict, num_ubatches: int) -> list[dict]:
    """Cut a decode batch (one token per request) into `num_ubatches` runs of requests; mRoPE
    positions are cut along their token dimension (the last)."""
    n = batch["q"].shape[0]
    step = -(-n // num_ubatches)
    bounds = [min(i * step, n) for i in range(num_ubatches + 1)]
    slices = [UBatchSlice(slice(a, b), slice(a, b)) for a, b in zip(bounds, bounds[1:])]
    pieces = []
    for s in slices:
        (meta,) = split_attn_metadata([s], batch["attn"], allow_empty=True)
        piece = {"q": batch["q"][s.token_slice], "attn": meta}
        if "positions" in batch:
            piece["positions"] = batch["positions"][..., s.token_slice]
        pieces.append(piece)
    return pieces


DummyRunKey = Callable[[CUDAGraphRunner, dict, int], BatchDescriptor]


def graphs_for(
    dummy_run_key: DummyRunKey, batch: Callable[[int], dict]
) -> Callable[[int, int], CUDAGraphRunner]:
    """`graphs(rank, world_size)` for `verify_ranks`: each rank's runner, captured on the
    engine's dummy batches (`batch(num_tokens)`); rank 1's steps are dummy runs keyed by
    `dummy_run_key(runner, batch, num_ubatches)`, rank 0's by what its batch is."""

    def make(rank: int, world_size: int) -> CUDAGraphRunner:
        runner = CUDAGraphRunner(attention, dispatcher(), device=SimDevice())
        if rank != 0:  # the key reads the counts the ranks agree on, set on its runner
            runner.key = lambda b, n: dummy_run_key(runner, b, n)
        runner.capture_all(lambda key: batch(key.num_tokens))
        return runner

    return make


def verdict(dummy_run_key: DummyRunKey, batch: Callable[[int], dict]) -> Verdict:
    """Both ranks run a step of `STEP_TOKENS` tokens through their graphs (rank 1's is the
    dummy run, its inputs padded to the agreed count)."""
    report = dbo.verify_ranks(
        attention,
        lambda rank, world_size: batch(STEP_TOKENS),
        num_ranks=2,
        split=decode_split,
        atol=1e-9,
        timeout=TIMEOUT_S,
        graphs=graphs_for(dummy_run_key, batch),
    )
    return report_verdict(report, _BY)


def _agreed(runner: CUDAGraphRunner) -> int:
    """vLLM's `num_tokens_after_padding`: the largest count the ranks agreed on."""
    return max(runner.num_tokens_across_dp or [0])


@bug(
    "vllm-25906-dummy-run-graph-size",
    engine="vLLM",
    ref="vllm#25906",
    cause="an idle DP rank's dummy run dispatches its CUDA graph by its own token count (1) "
    "instead of the DP-padded count the ranks agreed (8), so it replays a graph of another "
    "size than its peers and their collectives hang",
    caught_by=_BY,
    ranks=2,
    evidence="the step runs a graph of 1 tokens, but the ranks agreed on 8 tokens",
)
def dummy_run_graph_size(buggy: bool) -> Verdict:
    def dummy_run_key(runner: CUDAGraphRunner, batch: dict, num_ubatches: int):
        # execute_dummy_batch runs _dummy_run(1); the fix keys it num_tokens_after_padding
        n = 1 if buggy else _agreed(runner)
        return BatchDescriptor(n, n, True, num_ubatches)

    return verdict(dummy_run_key, decode_batch)


@bug(
    "vllm-ascend-4393-mrope-graph-tokens",
    engine="vLLM-ascend",
    ref="vllm-ascend#4393 / #3425",
    cause="a DP dummy run under FULL_DECODE_ONLY takes its token count for the graph from "
    "positions.shape[0], which is 3 for a multimodal model's mRoPE positions (3, num_tokens), "
    "so it replays the graph of another size than its peers and the ranks hang",
    caught_by=_BY,
    ranks=2,
    evidence="the step runs a graph of 4 tokens, but the ranks agreed on 8 tokens",
)
def mrope_graph_tokens(buggy: bool) -> Verdict:
    def dummy_run_key(runner: CUDAGraphRunner, batch: dict, num_ubatches: int):
        positions = batch["positions"]
        n = positions.shape[0] if buggy else positions.shape[-1]  # the fix: num_tokens
        return BatchDescriptor(n, n, True, num_ubatches)

    return verdict(dummy_run_key, mrope_batch)
