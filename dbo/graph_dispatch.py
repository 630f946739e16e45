"""CUDA graphs keyed as vLLM keys them: `CUDAGraphMode`, `BatchDescriptor` and
`CudagraphDispatcher`, under vLLM's names and rules.

The dispatcher holds the set of captured keys per runtime mode (FULL, PIECEWISE) and maps a
step's descriptor to the mode and key to replay: its token count padded up to the next
capture size, FULL first (the exact key, then the key relaxed to a mixed batch), then
PIECEWISE (relaxed), else NONE (eager). FULL keys for uniform decode exist only where the
mode has a separate decode routine (`FULL_DECODE_ONLY`, `FULL_AND_PIECEWISE`).

One field vLLM's descriptor does not carry: `num_ubatches`. vLLM keeps a ubatched step's
graphs apart from a serial step's of the same token count (the ubatch wrapper's own graphs,
and #27771 capturing both for counts near the DBO threshold); here that is part of the key.

Across data-parallel ranks every rank must replay a graph of the same size, or their
collectives disagree: `dispatch(..., num_tokens_across_dp=)` pads to the agreed count (the
largest rank's), as vLLM's `_dummy_run` must (#25906).
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from dbo.checks import as_int

__all__ = ["BatchDescriptor", "CUDAGraphMode", "CudagraphDispatcher"]


class CUDAGraphMode(enum.Enum):
    """vLLM's cudagraph modes: a runtime mode (NONE, PIECEWISE, FULL), or a pair (decode
    mode, mixed mode) for engines that run uniform-decode batches another way."""

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (FULL, NONE)
    FULL_AND_PIECEWISE = (FULL, PIECEWISE)

    def separate_routine(self) -> bool:
        return isinstance(self.value, tuple)

    def decode_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[0]) if self.separate_routine() else self

    def mixed_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[1]) if self.separate_routine() else self


class BatchDescriptor(NamedTuple):
    """A (padded) batch as a graph key: its token count, its request count (uniform batches
    only), whether every request has the same query length (uniform decode), and how many
    ubatches the step runs as."""

    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False
    num_ubatches: int = 1

    def relax_for_mixed_batch_cudagraphs(self) -> BatchDescriptor:
        """The key of a graph captured for mixed batches that can also run this one."""
        return BatchDescriptor(self.num_tokens, None, False, self.num_ubatches)

    def describe(self) -> str:
        kind = f"uniform decode of {self.num_reqs} requests" if self.uniform else "mixed"
        split = "serial" if self.num_ubatches == 1 else f"{self.num_ubatches} ubatches"
        return f"{self.num_tokens} tokens, {kind}, {split}"


def _order(key: BatchDescriptor) -> tuple[int, int, bool]:
    return key.num_ubatches, key.num_tokens, key.uniform


class CudagraphDispatcher:
    """The captured keys per runtime mode, and the choice of graph for a step.

    `capture_sizes`: the token counts graphs are captured for (vLLM's
    `cudagraph_capture_sizes`); `uniform_decode_query_len`: tokens per request of a uniform
    decode batch (1, or 1 + speculative tokens); `ubatch_counts`: the ubatch counts graphs
    are captured for (1: serial steps; add 2 for DBO steps).
    """

    def __init__(
        self,
        cudagraph_mode: CUDAGraphMode,
        capture_sizes: Iterable[int],
        *,
        uniform_decode_query_len: int = 1,
        max_num_seqs: int | None = None,
        ubatch_counts: Sequence[int] = (1,),
    ) -> None:
        if not isinstance(cudagraph_mode, CUDAGraphMode):
            raise TypeError(
                f"cudagraph_mode must be a CUDAGraphMode, got {type(cudagraph_mode).__name__}"
            )
        sizes = sorted({as_int("capture size", s, minimum=1) for s in capture_sizes})
        self.cudagraph_mode = cudagraph_mode
        self.capture_sizes = sizes
        self.uniform_decode_query_len = as_int(
            "uniform_decode_query_len", uniform_decode_query_len, minimum=1
        )
        self.max_num_seqs = None if max_num_seqs is None else as_int("max_num_seqs", max_num_seqs)
        self.ubatch_counts = sorted({as_int("ubatch count", n, minimum=1) for n in ubatch_counts})
        self.cudagraph_keys: dict[CUDAGraphMode, set[BatchDescriptor]] = {
            CUDAGraphMode.PIECEWISE: set(),
            CUDAGraphMode.FULL: set(),
        }
        self._initialize_cudagraph_keys()

    def _initialize_cudagraph_keys(self) -> None:
        mode, q = self.cudagraph_mode, self.uniform_decode_query_len
        for n in self.ubatch_counts:
            if mode.mixed_mode() != CUDAGraphMode.NONE:
                for size in self.capture_sizes:
                    key = BatchDescriptor(size, None, False, n)
                    self.cudagraph_keys[mode.mixed_mode()].add(key)
            if mode.decode_mode() == CUDAGraphMode.FULL and mode.separate_routine():
                most = None if self.max_num_seqs is None else q * self.max_num_seqs
                for size in self.capture_sizes:
                    if size >= q and size % q == 0 and (most is None or size <= most):
                        key = BatchDescriptor(size, size // q, True, n)
                        self.cudagraph_keys[CUDAGraphMode.FULL].add(key)

    def keys(self) -> list[tuple[CUDAGraphMode, BatchDescriptor]]:
        """Every (mode, key) to capture, in a stable order."""
        return [
            (mode, key)
            for mode in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE)
            for key in sorted(self.cudagraph_keys[mode], key=_order)
        ]

    def padded_num_tokens(self, num_tokens: int) -> int | None:
        """The smallest capture size holding `num_tokens`, or None above the largest."""
        n = as_int("num_tokens", num_tokens, minimum=0)
        i = bisect.bisect_left(self.capture_sizes, n)
        return self.capture_sizes[i] if i < len(self.capture_sizes) else None

    def dispatch(
        self,
        batch_descriptor: BatchDescriptor,
        *,
        num_tokens_across_dp: Sequence[int] | None = None,
    ) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """The runtime mode and the padded key to replay for a step the engine describes as
        `batch_descriptor`; with `num_tokens_across_dp`, padded to the agreed (largest) count
        so every rank replays a graph of one size. NONE comes with the unpadded descriptor."""
        if not isinstance(batch_descriptor, BatchDescriptor):
            raise TypeError(
                f"batch_descriptor must be a BatchDescriptor, got {type(batch_descriptor).__name__}"
            )
        num_tokens = batch_descriptor.num_tokens
        if num_tokens_across_dp is not None:
            counts = [as_int("num_tokens_across_dp", c, minimum=0) for c in num_tokens_across_dp]
            num_tokens = max([num_tokens, *counts])
        padded = self.padded_num_tokens(num_tokens)
        if padded is None:
            return CUDAGraphMode.NONE, batch_descriptor._replace(num_tokens=num_tokens)
        q = self.uniform_decode_query_len
        key = batch_descriptor._replace(
            num_tokens=padded, num_reqs=padded // q if batch_descriptor.uniform else None
        )
        relaxed = key.relax_for_mixed_batch_cudagraphs()
        for mode, candidate in (
            (CUDAGraphMode.FULL, key),
            (CUDAGraphMode.FULL, relaxed),
            (CUDAGraphMode.PIECEWISE, relaxed),
        ):
            if candidate in self.cudagraph_keys[mode]:
                return mode, candidate
        return CUDAGraphMode.NONE, key
