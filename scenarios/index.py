"""What `dbo-sim list` shows of every scenario, as a plain table, so that listing them imports
neither torch nor the workloads (the registry, `scenarios.catalog`, imports both).

`tests/scenarios/test_scenario_registry.py` checks this table against the registered
scenarios: a scenario added, renamed or re-described there fails until it is listed here too.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LISTED", "Listed"]


@dataclass(frozen=True)
class Listed:
    """One scenario as listed: its name, whether it injects a fault it must catch, whether
    `dbo-sim run` runs it by default, whether it also means something on CUDA streams."""

    name: str
    negative: bool
    default: bool
    cuda: bool
    summary: str


# In the catalog's order (the order `list` and `run` keep).
LISTED: tuple[Listed, ...] = (
    Listed(
        "moe-decode-ll",
        negative=False,
        default=True,
        cuda=True,
        summary=("MoE decode, DeepEP low-latency style: recv hooks, 2 yields per layer"),
    ),
    Listed(
        "moe-prefill-ht",
        negative=False,
        default=True,
        cuda=True,
        summary=(
            "MoE prefill, DeepEP high-throughput style: comm stream, 3 yields per layer; a "
            "request is cut by the ubatch boundary"
        ),
    ),
    Listed(
        "three-ubatches",
        negative=False,
        default=True,
        cuda=True,
        summary=("The prefill workload split into 3 ubatches round the ring"),
    ),
    Listed(
        "dsv3-prefill-ht",
        negative=False,
        default=True,
        cuda=False,
        summary=(
            "DeepSeek-V3 size (meta, timing only), prefill 8K tokens per device, high-throughput EP"
        ),
    ),
    Listed(
        "dsv3-decode-ll",
        negative=False,
        default=True,
        cuda=False,
        summary=(
            "DeepSeek-V3 size (meta, timing only), decode 256 tokens per device, low-latency EP, "
            "replayed as a CUDA graph"
        ),
    ),
    Listed(
        "dcp-attention",
        negative=False,
        default=True,
        cuda=False,
        summary=("DCP attention: two buffers from two calls alias, per ubatch slot"),
    ),
    Listed(
        "fused-moe-workspace",
        negative=False,
        default=True,
        cuda=False,
        summary=(
            "Fused MoE: one call gives a shared region (workspace13 / fused_out views) and an "
            "independent workspace2"
        ),
    ),
    Listed(
        "sparse-indexer",
        negative=False,
        default=True,
        cuda=False,
        summary=(
            "Sparse indexer: a profile call reserves three buffers; prefill and decode calls then"
            " allocate nothing"
        ),
    ),
    Listed(
        "mla-init-reservation",
        negative=False,
        default=True,
        cuda=False,
        summary=(
            "MLA init: a buffer reserved at init and held as an attribute; later calls alias it "
            "and never grow"
        ),
    ),
    Listed(
        "graph-pointer-stability",
        negative=False,
        default=True,
        cuda=False,
        summary=(
            "CUDA graphs: warm up, capture, lock; replays reuse the captured workspace pointers "
            "and recompute from new inputs"
        ),
    ),
    Listed(
        "elastic-ep",
        negative=False,
        default=True,
        cuda=False,
        summary=(
            "Elastic EP: unlock, re-warm with larger experts (growth), relock; the stale graph is"
            " refused and a recaptured one replays"
        ),
    ),
    Listed(
        "missing-wait-race",
        negative=True,
        default=True,
        cuda=False,
        summary=(
            "Negative: dispatch switches to the comm stream without waiting for compute; the race"
            " checker must report it"
        ),
    ),
    Listed(
        "yield-mismatch",
        negative=True,
        default=True,
        cuda=True,
        summary=(
            "Negative: one ubatch yields once more than the others; a YieldMismatchError must "
            "name every count"
        ),
    ),
    Listed(
        "exception-in-ubatch",
        negative=True,
        default=True,
        cuda=True,
        summary=(
            "Negative: the last ubatch raises mid-step; every peer is released and one "
            "UBatchError names it"
        ),
    ),
    Listed(
        "locked-growth",
        negative=True,
        default=True,
        cuda=False,
        summary=(
            "Negative: after warm-up and lock, a larger batch needs more workspace; the error "
            "names the caller and both sizes"
        ),
    ),
    Listed(
        "dp-disagreement",
        negative=True,
        default=True,
        cuda=False,
        summary=(
            "Negative, 2 processes (or --ranks N): DP ranks decide ubatching alone (2 vs 1 "
            "ubatches); the EP step handshake must stop every rank with an error naming each "
            "rank's count, and the agreed step must then run"
        ),
    ),
)
