"""CUDA graphs keyed as vLLM keys them (`dbo.graph_dispatch`), served and checked on the
simulated device (`dbo.verification.graph_runner`), and `dbo.verify(..., graphs=)`."""

from __future__ import annotations

import itertools

import pytest
import torch

import dbo
from dbo.graph_dispatch import BatchDescriptor, CudagraphDispatcher, CUDAGraphMode
from dbo.sim import SimDevice
from dbo.split import CommonAttentionMetadata
from dbo.verification import split_inputs
from dbo.verification.graph_runner import CUDAGraphRunner, describe_batch

FULL, PIECEWISE, NONE = CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE
LAYOUT = [slice(0, 5), slice(5, 8)]  # cuts the mixed batch below at a request boundary


def attention(batch: dict) -> torch.Tensor:
    """A decode kernel (one query per request) or a prefill kernel (causal within each
    request), picked on the host from the request layout, as a backend picks its kernel: a
    captured graph keeps the kernel of the batch it was captured on."""
    q, m = batch["q"], batch["attn"]
    qsl = m.query_start_loc_cpu.tolist()
    dbo.dbo_yield()
    if max((b - a for a, b in itertools.pairwise(qsl)), default=0) <= 1:
        return q * m.seq_lens[: q.shape[0]].to(q.dtype)[:, None]
    out = torch.zeros_like(q)
    for i, (a, b) in enumerate(itertools.pairwise(qsl)):
        if b > a:
            out[a:b] = q[a:b].cumsum(0) * m.seq_lens[i].to(q.dtype)
    return out


def batch(query_lens, seq_lens, num_reqs_padded=None) -> dict:
    meta = CommonAttentionMetadata.make(
        query_lens, seq_lens, block_size=16, num_reqs_padded=num_reqs_padded
    )
    q = torch.arange(meta.num_actual_tokens * 2, dtype=torch.float64).reshape(-1, 2)
    return {"q": q, "attn": meta}


def decode_dummy(key: BatchDescriptor) -> dict:
    return batch([1] * key.num_tokens, [3] * key.num_tokens)


def mixed_batch() -> dict:
    return batch([5, 1, 1, 1], [5, 9, 7, 12], num_reqs_padded=8)


def runner(mode=CUDAGraphMode.FULL_DECODE_ONLY, key=None, **kw) -> CUDAGraphRunner:
    dispatcher = CudagraphDispatcher(mode, [1, 2, 4, 8])
    graphs = CUDAGraphRunner(attention, dispatcher, device=SimDevice(), key=key, **kw)
    graphs.capture_all(decode_dummy)
    return graphs


def by_token_count(b: dict, num_ubatches: int) -> BatchDescriptor:
    """An engine keying its graphs by token count only: every batch taken for uniform decode."""
    n = describe_batch(b).num_tokens
    return BatchDescriptor(n, n, True, num_ubatches)


# ------------------------------------------------------------------------------ dispatcher


def test_full_decode_only_captures_uniform_decode_keys_only() -> None:
    d = CudagraphDispatcher(CUDAGraphMode.FULL_DECODE_ONLY, [4, 8])
    assert d.keys() == [(FULL, BatchDescriptor(4, 4, True)), (FULL, BatchDescriptor(8, 8, True))]


def test_a_mixed_batch_falls_to_the_piecewise_graph_of_its_padded_size() -> None:
    d = CudagraphDispatcher(CUDAGraphMode.FULL_AND_PIECEWISE, [4, 8])
    assert d.dispatch(BatchDescriptor(6)) == (PIECEWISE, BatchDescriptor(8))
    assert d.dispatch(BatchDescriptor(6, 6, True)) == (FULL, BatchDescriptor(8, 8, True))


def test_a_batch_above_the_largest_capture_size_runs_eager() -> None:
    d = CudagraphDispatcher(CUDAGraphMode.FULL_AND_PIECEWISE, [4, 8])
    assert d.dispatch(BatchDescriptor(9))[0] is NONE


def test_dispatch_pads_to_the_dp_agreed_count() -> None:
    d = CudagraphDispatcher(CUDAGraphMode.FULL_DECODE_ONLY, [1, 2, 4, 8])
    mode, key = d.dispatch(BatchDescriptor(1, 1, True), num_tokens_across_dp=[1, 7])
    assert (mode, key) == (FULL, BatchDescriptor(8, 8, True))


def test_ubatched_graphs_are_keyed_apart_from_serial_ones() -> None:
    d = CudagraphDispatcher(CUDAGraphMode.FULL_DECODE_ONLY, [4], ubatch_counts=(1, 2))
    assert {k.num_ubatches for _, k in d.keys()} == {1, 2}
    assert d.dispatch(BatchDescriptor(4, 4, True, 2))[1].num_ubatches == 2


def test_describe_batch_reads_the_kind_from_the_metadata() -> None:
    assert describe_batch(mixed_batch()) == BatchDescriptor(8, None, False)
    assert describe_batch(decode_dummy(BatchDescriptor(4))) == BatchDescriptor(4, 4, True)


# ---------------------------------------------------------------------------------- verify


@pytest.mark.timeout(60)
def test_a_mixed_batch_replayed_with_the_uniform_decode_graph_is_named() -> None:
    report = dbo.verify(
        attention, mixed_batch(), graphs=runner(key=by_token_count), slices=LAYOUT, atol=1e-9
    )
    assert not report.ok and report.outputs_match  # eager DBO is right; the graph is not
    (replay,) = report.graphs
    assert replay.mode is FULL and replay.key.uniform and not replay.batch.uniform
    assert any(p.startswith("graph kind") for p in replay.problems)
    assert any("request layout [0, 1, 2" in p for p in replay.problems)
    assert replay.mismatch is not None  # and the replayed values are wrong
    assert "graphs           FAILED: serial step: FULL graph" in report.describe()


@pytest.mark.timeout(60)
def test_a_mixed_batch_keyed_by_its_kind_runs_eager_and_is_clean() -> None:
    report = dbo.verify(attention, mixed_batch(), graphs=runner(), slices=LAYOUT, atol=1e-9)
    assert report.ok, report.describe()
    assert report.graphs[0].mode is NONE


@pytest.mark.timeout(60)
def test_a_uniform_decode_replay_matches_the_eager_step() -> None:
    step = batch([1] * 8, list(range(4, 12)))  # other seq_lens than the capture's
    report = dbo.verify(
        attention, step, graphs=runner(), split=None, slices=[slice(0, 4), slice(4, 8)]
    )
    assert report.ok, report.describe()
    assert report.graphs[0].mode is FULL and report.graphs[0].max_abs_diff == 0.0


@pytest.mark.timeout(60)
def test_a_dummy_run_replaying_its_own_size_instead_of_the_dp_agreed_one_is_named() -> None:
    graphs = runner(num_tokens_across_dp=[1, 8])  # an idle rank's dummy run of 1 token
    replay = graphs.run(decode_dummy(BatchDescriptor(1)), step="dummy run")
    assert replay.key.num_tokens == 1
    assert replay.problems == [
        "DP size: the step runs a graph of 1 tokens, but the ranks agreed on 8 tokens (a "
        "graph of 8); a rank that replays another size than its peers runs collectives of "
        "another size"
    ]


def test_a_batch_of_other_shapes_than_the_capture_is_not_replayed() -> None:
    graphs = runner(key=by_token_count)
    wider = decode_dummy(BatchDescriptor(4))
    wider["q"] = torch.zeros(4, 3, dtype=torch.float64)
    replay = graphs.run(wider)
    assert replay.output is None
    assert replay.problems == [
        "shapes of the captured inputs differ: ['q']: captured (4, 2), replayed with (4, 3)"
    ]


def test_verify_refuses_graphs_nothing_was_captured_for() -> None:
    graphs = CUDAGraphRunner(attention, CudagraphDispatcher(FULL, [4]), device=SimDevice())
    with pytest.raises(ValueError, match="holds no captured graph"):
        dbo.verify(attention, mixed_batch(), graphs=graphs, slices=LAYOUT)


def scale_and_shift(x: torch.Tensor) -> torch.Tensor:
    y = x * 2.0
    dbo.dbo_yield()
    return y + 1.0


def ubatched_runner(key=None) -> CUDAGraphRunner:
    dispatcher = CudagraphDispatcher(FULL, [4, 8], ubatch_counts=(1, 2))
    graphs = CUDAGraphRunner(
        scale_and_shift, dispatcher, device=SimDevice(), key=key, split=split_inputs
    )
    graphs.capture_all(lambda key: torch.zeros(key.num_tokens, 3))
    return graphs


@pytest.mark.timeout(60)
def test_verify_replays_the_dbo_step_through_a_graph_captured_ubatched() -> None:
    report = dbo.verify(scale_and_shift, torch.randn(8, 3), graphs=ubatched_runner())
    assert report.ok, report.describe()
    assert [r.key.num_ubatches for r in report.graphs] == [1, 2]


@pytest.mark.timeout(60)
def test_a_serial_step_replayed_with_a_ubatched_graph_is_named() -> None:
    def always_ubatched(batch: torch.Tensor, num_ubatches: int) -> BatchDescriptor:
        return BatchDescriptor(batch.shape[0], None, False, 2)

    replay = ubatched_runner(always_ubatched).run(torch.randn(8, 3))
    assert replay.problems == [
        "ubatches: a graph captured for 2 ubatch(es) is replayed for a step of 1"
    ]


def test_a_prefill_shaped_like_a_speculative_decode_is_not_uniform() -> None:
    # Two prompts of 2 tokens each alias a decode with one speculative token (vllm#53051):
    # the shape says uniform, is_prefilling says they are still in their prompts.
    meta = CommonAttentionMetadata.make([2, 2], [2, 2], prompt_lens=[2, 2])
    decode = CommonAttentionMetadata.make([2, 2], [9, 5], prompt_lens=[4, 3])
    assert not describe_batch({"attn": meta}, uniform_decode_query_len=2).uniform
    assert describe_batch({"attn": decode}, uniform_decode_query_len=2).uniform
