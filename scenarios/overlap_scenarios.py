"""Overlap correctness on the MoE workload: the tiny model with values checked, and the same
schedules at DeepSeek-V3 size on `meta` tensors (timing only)."""

from __future__ import annotations

from scenarios.harness import (
    RunOptions,
    compare_serial_dbo,
)
from scenarios.model import Batch, preset
from scenarios.registry import ScenarioResult, scenario
from scenarios.verdicts import result_from_comparison

TINY_DECODE = Batch.decode(num_requests=64, context_len=16)
TINY_PREFILL = Batch(query_start_loc=(0, 40, 70, 128, 160), context_lens=(0, 0, 0, 0))


@scenario(
    "moe-decode-ll",
    "MoE decode, DeepEP low-latency style: recv hooks, 2 yields per layer",
    cuda=True,
)
def _moe_decode_ll(opts: RunOptions) -> ScenarioResult:
    c = compare_serial_dbo("moe-decode-ll", preset("tiny"), TINY_DECODE, "ll", opts)
    return result_from_comparison("moe-decode-ll", c, mode="ll", tokens=TINY_DECODE.num_tokens)


@scenario(
    "moe-prefill-ht",
    "MoE prefill, DeepEP high-throughput style: comm stream, 3 yields per layer; a request is "
    "cut by "
    "the ubatch boundary",
    cuda=True,
)
def _moe_prefill_ht(opts: RunOptions) -> ScenarioResult:
    c = compare_serial_dbo("moe-prefill-ht", preset("tiny"), TINY_PREFILL, "ht", opts)
    return result_from_comparison("moe-prefill-ht", c, mode="ht", tokens=TINY_PREFILL.num_tokens)


@scenario("three-ubatches", "The prefill workload split into 3 ubatches round the ring", cuda=True)
def _three_ubatches(opts: RunOptions) -> ScenarioResult:
    three = RunOptions(**{**opts.__dict__, "num_ubatches": 3})
    c = compare_serial_dbo("three-ubatches", preset("tiny"), TINY_PREFILL, "ht", three)
    return result_from_comparison("three-ubatches", c, num_ubatches=3)


# The same schedules at DeepSeek-V3 size on `meta` tensors: timing only (no values), to show
# what the overlap buys where communication is large, and where it does not pay.
DSV3_PREFILL = Batch.prefill(num_requests=2, prompt_len=4096)  # 8K tokens per device
DSV3_DECODE = Batch.decode(num_requests=256, context_len=2048)  # 256 tokens per device


@scenario(
    "dsv3-prefill-ht",
    "DeepSeek-V3 size (meta, timing only), prefill 8K tokens per device, high-throughput EP",
)
def _dsv3_prefill(opts: RunOptions) -> ScenarioResult:
    c = compare_serial_dbo("dsv3-prefill-ht", preset("deepseek-v3"), DSV3_PREFILL, "ht", opts)
    return result_from_comparison("dsv3-prefill-ht", c, mode="ht", tokens=DSV3_PREFILL.num_tokens)


@scenario(
    "dsv3-decode-ll",
    "DeepSeek-V3 size (meta, timing only), decode 256 tokens per device, low-latency EP, "
    "replayed as a CUDA graph",
)
def _dsv3_decode(opts: RunOptions) -> ScenarioResult:
    # Decode runs as a captured graph in an engine (vLLM captures the ubatched step too):
    # eagerly, the host issuing two ubatches' ops would bound the step, not the overlap.
    c = compare_serial_dbo(
        "dsv3-decode-ll", preset("deepseek-v3"), DSV3_DECODE, "ll", opts, graph=True
    )
    return result_from_comparison(
        "dsv3-decode-ll", c, mode="ll", tokens=DSV3_DECODE.num_tokens, graph_replay=True
    )
