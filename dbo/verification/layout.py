"""An explicit ubatch layout for `dbo.verify(..., slices=...)`, and each engine's rule on a
ubatch that holds no real token.

Where a ubatch may be empty (no real token: nothing at all, or padding only) is a property of
the engine's split, not of DBO, so `verify` takes the engine's rules by name:

- "vllm-v1": vLLM's V1 runner never runs one. It cuts at k * (padded // N) and turns DBO off
  for a step whose last ubatch would hold no real token (`is_last_ubatch_empty`); its
  thresholds keep steps smaller than the ubatch count whole.
- "vllm-v2": vLLM's V2 runner (#50945) dropped `is_last_ubatch_empty`: a ubatch of padding
  only runs like a dummy run. It still refuses a batch with fewer tokens than ubatches, and
  its cut leaves the real tokens in the first ubatches, so an empty ubatch only follows them.
- "sglang": SGLang's two-batch overlap keeps both child batches whatever they hold: a decode
  batch of one request splits at sequence index 0 and leaves the first child empty.

A layout the engine's rules refuse is refused before any work (`EmptyUBatchError`, naming
the rule), as the engine itself would never run it.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dbo.split import (
    CommonAttentionMetadata,
    UBatchSlice,
    cut_ubatch_slices,
    split_attn_metadata,
)

__all__ = ["SPLIT_RULES", "EmptyUBatchError", "SplitRules", "resolve_layout", "split_by_layout"]


@dataclass(frozen=True)
class SplitRules:
    """An engine's rule on empty ubatches: `empty` is "never", "trailing" (only after the
    real tokens) or "anywhere"; `rule` says it in the engine's terms."""

    name: str
    empty: str
    rule: str


SPLIT_RULES = {
    "vllm-v1": SplitRules(
        "vllm-v1",
        "never",
        "vLLM's V1 runner does not split a step that would leave a ubatch without real "
        "tokens (is_last_ubatch_empty turns DBO off for it)",
    ),
    "vllm-v2": SplitRules(
        "vllm-v2",
        "trailing",
        "vLLM's V2 runner runs a ubatch of padding only like a dummy run, but cuts the real "
        "tokens into the first ubatches and refuses a batch with fewer tokens than ubatches",
    ),
    "sglang": SplitRules(
        "sglang",
        "anywhere",
        "SGLang's two-batch overlap runs a child batch with no tokens",
    ),
}


class EmptyUBatchError(ValueError):
    """A layout leaves a ubatch without real tokens where the engine's rules forbid it."""


def _metadata(inputs: Any) -> CommonAttentionMetadata | None:
    return next((v for v in _leaves(inputs) if isinstance(v, CommonAttentionMetadata)), None)


def _leaves(inputs: Any) -> list[Any]:
    if isinstance(inputs, Mapping):
        return list(inputs.values())
    if isinstance(inputs, (tuple, list)):
        return list(inputs)
    return [inputs]


def _token_counts(inputs: Any) -> tuple[int, int, list[int] | None]:
    """(real tokens, all tokens with padding, per-request counts or None) of the batch."""
    meta = _metadata(inputs)
    if meta is not None:
        qsl = [int(v) for v in meta.query_start_loc_cpu.tolist()]
        return qsl[-1], int(meta.num_actual_tokens), [b - a for a, b in itertools.pairwise(qsl)]
    rows = {v.shape[0] for v in _leaves(inputs) if isinstance(v, torch.Tensor) and v.dim()}
    if len(rows) != 1:
        raise TypeError(
            f"slices cut the batch's tensors along dim 0, so they need one shared dim 0 (or "
            f"attention metadata to count the tokens); got dim 0 sizes {sorted(rows)}"
        )
    (n,) = rows
    return n, n, None


def _bounds(slices: Sequence[Any]) -> list[tuple[int, int]]:
    bounds = []
    for k, s in enumerate(slices):
        toks = s.token_slice if isinstance(s, UBatchSlice) else s
        if not isinstance(toks, slice) or not all(
            isinstance(v, int) for v in (toks.start, toks.stop)
        ):
            raise TypeError(
                f"slices[{k}] must be a UBatchSlice or a slice(start, stop) of tokens, got {s!r}"
            )
        bounds.append((toks.start, toks.stop))
    return bounds


def _check_tiling(bounds: list[tuple[int, int]], real: int, total: int) -> None:
    expected = 0
    for k, (start, stop) in enumerate(bounds):
        if start != expected or stop < start:
            raise ValueError(
                f"slices must tile the batch's tokens in order: ubatch {k} is [{start}, {stop}) "
                f"but the ubatches before it end at {expected}"
            )
        expected = stop
    if expected not in (real, total):
        raise ValueError(
            f"the slices cover {expected} tokens; the batch has {real} real tokens ({total} "
            f"with padding)"
        )


def _check_rules(bounds: list[tuple[int, int]], real: int, total: int, rules: SplitRules) -> None:
    empty = [start >= min(stop, real) for start, stop in bounds]
    if not any(empty) or rules.empty == "anywhere":
        return
    k = empty.index(True)
    start, stop = bounds[k]
    what = f"ubatch {k} holds no real token (tokens [{start}, {stop}); the real ones end at {real})"
    if rules.empty == "never":
        raise EmptyUBatchError(
            f"{what}: {rules.rule}; pass split_rules='vllm-v2' or 'sglang' where the engine "
            f"runs an empty ubatch"
        )
    # V2's guard counts the batch as it runs it, padding included (every DP rank padded).
    if total < len(bounds) or not all(empty[k:]):
        raise EmptyUBatchError(f"{what}: {rules.rule}")


def resolve_layout(
    slices: Sequence[Any], inputs: Any, num_ubatches: int, rules: SplitRules
) -> list[UBatchSlice]:
    """The layout as `UBatchSlice`s (request slices from the batch's metadata when given as
    token slices), refused before any work if it does not tile the batch or leaves a ubatch
    empty against `rules`."""
    if isinstance(slices, (str, bytes)) or not isinstance(slices, Sequence):
        raise TypeError(f"slices must be a list of UBatchSlice or slice, got {slices!r:.80}")
    if len(slices) != num_ubatches:
        raise ValueError(
            f"slices lists {len(slices)} ubatches but num_ubatches={num_ubatches}; leave "
            f"num_ubatches out to take the layout's count"
        )
    real, total, counts = _token_counts(inputs)
    bounds = _bounds(slices)
    _check_tiling(bounds, real, total)
    _check_rules(bounds, real, total, rules)
    if all(isinstance(s, UBatchSlice) for s in slices):
        return list(slices)
    if counts is None:  # no requests to speak of: one row per token
        return [UBatchSlice(slice(a, b), slice(a, b)) for a, b in bounds]
    laid = cut_ubatch_slices(counts, [a for a, _ in bounds[1:]])
    last = laid[-1]
    return [
        *laid[:-1],
        UBatchSlice(last.request_slice, slice(last.token_slice.start, bounds[-1][1])),
    ]


def split_by_layout(inputs: Any, slices: Sequence[UBatchSlice], allow_empty: bool) -> list[Any]:
    """The default split for an explicit layout: tensors cut along dim 0 by each ubatch's
    tokens, attention metadata by `split_attn_metadata` (a ubatch without real tokens gets a
    record without requests, where the rules allow one)."""

    def cut(value: Any, s: UBatchSlice) -> Any:
        if isinstance(value, CommonAttentionMetadata):
            return split_attn_metadata([s], value, allow_empty=allow_empty)[0]
        if isinstance(value, torch.Tensor) and value.dim():
            return value[s.token_slice]
        raise TypeError(
            f"the default split for slices cuts tensors and attention metadata; got a "
            f"{type(value).__name__}; pass split=fn(inputs, num_ubatches)"
        )

    def piece(s: UBatchSlice) -> Any:
        if isinstance(inputs, Mapping):
            return {k: cut(v, s) for k, v in inputs.items()}
        if isinstance(inputs, (tuple, list)):
            return type(inputs)(cut(v, s) for v in inputs)
        return cut(inputs, s)

    return [piece(s) for s in slices]
