"""The errors a ubatched step can end with; each names the ubatch(es) at fault."""

from __future__ import annotations

__all__ = ["UBatchError", "YieldMismatchError", "UBatchTimeoutError"]


class UBatchError(RuntimeError):
    """A ubatched step failed. `ubatch_id` is the ubatch at fault (None when several are);
    the original exception, if any, is chained as `__cause__`."""

    def __init__(self, message: str, *, ubatch_id: int | None = None) -> None:
        super().__init__(message)
        self.ubatch_id = ubatch_id


class YieldMismatchError(UBatchError):
    """Ubatches yielded a different number of times; `yield_counts[i]` is ubatch i's."""

    def __init__(self, message: str, *, yield_counts: list[int]) -> None:
        super().__init__(message, ubatch_id=None)
        self.yield_counts = yield_counts


class UBatchTimeoutError(UBatchError):
    """The step did not finish in time; `stacks[i]` is ubatch i's formatted stack."""

    def __init__(self, message: str, *, stacks: dict[int, str]) -> None:
        super().__init__(message, ubatch_id=None)
        self.stacks = stacks


class _StepAborted(BaseException):
    """Unwinds a peer of a failed ubatch. A BaseException so that user code's
    `except Exception` cannot swallow it and run on with a dead ring."""
