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


def _describe(error: BaseException) -> str:
    """`Type: message` for any exception, never raising: the runtime formats the user's
    exceptions on its failure path, where a `__str__` or `__repr__` that raises must not
    replace the failure being reported (nor kill the thread reporting it)."""
    try:
        name = type(error).__name__
    except BaseException:  # noqa: BLE001 - a metaclass may break even this
        name = "exception"
    for render in (str, repr):
        try:
            text = render(error)
        except BaseException:  # noqa: BLE001, S112 - a failure falls through to the next form
            continue
        if isinstance(text, str):
            text = str.__str__(text)  # a str subclass could override formatting too
            return f"{name}: {text}" if text else name
    return f"{name}: <unprintable: its __str__ and __repr__ raise>"
