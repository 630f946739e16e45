"""The records a split passes around: a ubatch's slices, the size thresholds, and the fields
of vLLM's `ParallelConfig` that ubatching reads."""

from __future__ import annotations

from dataclasses import dataclass

from dbo.split.checks import as_bool, as_count, as_num_ubatches

__all__ = ["DBOConfig", "UBatchSlice", "UBatchSlices", "UBatchThresholds"]


@dataclass(frozen=True)
class UBatchSlice:
    """The requests and tokens of one ubatch, as half-open slices of the step's batch.

    A request cut by a ubatch boundary is in both neighbours' `request_slice`.
    """

    request_slice: slice
    token_slice: slice

    @property
    def num_tokens(self) -> int:
        return self.token_slice.stop - self.token_slice.start

    @property
    def num_requests(self) -> int:
        return self.request_slice.stop - self.request_slice.start

    def is_empty(self) -> bool:
        return self.num_tokens <= 0 or self.num_requests <= 0


UBatchSlices = list[UBatchSlice]


@dataclass(frozen=True)
class UBatchThresholds:
    """The smallest steps worth splitting: below these the overlap gains less than the split
    costs (a decode step of a few tokens is launch-bound, not communication-bound).

    Also readable under vLLM's `ParallelConfig` names, so `check_ubatch_thresholds` takes
    either this or a vLLM config.
    """

    decode_min_tokens: int = 32
    prefill_min_tokens: int = 512

    def __post_init__(self) -> None:
        as_count("decode_min_tokens", self.decode_min_tokens)
        as_count("prefill_min_tokens", self.prefill_min_tokens)

    def min_tokens(self, is_decode_only: bool) -> int:
        return self.decode_min_tokens if is_decode_only else self.prefill_min_tokens

    @property
    def use_ubatching(self) -> bool:
        return True

    @property
    def dbo_decode_token_threshold(self) -> int:
        return self.decode_min_tokens

    @property
    def dbo_prefill_token_threshold(self) -> int:
        return self.prefill_min_tokens


@dataclass(frozen=True)
class DBOConfig:
    """The fields of vLLM's `ParallelConfig` that ubatching reads, under the same names.

    A threshold below `num_ubatches` is refused: a step that small cannot give every ubatch a
    real token, so such a threshold would let steps through that can never split.
    """

    num_ubatches: int = 2
    use_ubatching: bool = True
    dbo_decode_token_threshold: int = 32
    dbo_prefill_token_threshold: int = 512

    def __post_init__(self) -> None:
        n = as_num_ubatches(self.num_ubatches)
        as_bool("use_ubatching", self.use_ubatching)
        for name in ("dbo_decode_token_threshold", "dbo_prefill_token_threshold"):
            threshold = as_count(name, getattr(self, name))
            if threshold < n:
                raise ValueError(
                    f"{name} ({threshold}) is below num_ubatches ({n}): a step of fewer tokens "
                    f"than ubatches leaves a ubatch empty; use a threshold >= {n}"
                )
