"""`dbo-sim plan`'s command line read and checked whole, without torch: `PlanArgs`.

One job: every option in the user's words, before anything heavy is imported. Numbers are
ASCII decimals, finite and in range (`float` would take "nan", "inf" and other scripts'
digits); no comma list holds an empty item; a token range doubles to a bounded count; the
product of phases, EP sizes, skews and token counts is bounded; a histogram or `--config`
file is read and holds what it must (finite counts, known fields of the right type). What
needs the model (the preset, the EP size against its experts, the histogram's shape) is
checked by `scenarios.tools.plan_sim` before its first step.
"""

from __future__ import annotations

import argparse
import csv
import io
import re
from dataclasses import dataclass
from pathlib import Path

from scenarios.lib.usage import (
    UsageError,
    finite_float,
    read_json_file,
    read_text_file,
    writable_dir,
)
from scenarios.model_config import config_changes

__all__ = [
    "DEFAULT_SKEWS",
    "MAX_EP",
    "MAX_SEED",
    "MAX_TOKENS",
    "MAX_WORKERS",
    "MAX_ZIPF",
    "PlanArgs",
    "parse_args",
    "parse_placement",
    "parse_skew",
    "parse_tokens",
]

DEFAULT_TOKENS = {"decode": "16,32,64,128,256,512", "prefill": "2048,4096,8192,16384"}
DEFAULT_SKEWS = "balanced,zipf:0.2,zipf:0.4"
MAX_TOKENS = 1 << 20  # tokens per device; far above any engine's step
MAX_EP = 4096
MAX_REDUNDANT = 4096  # eplb:N replicas, placed one at a time
MAX_ITEMS = 32  # values in one comma list
MAX_POINTS = 512  # steps to replay: phases x EP sizes x skews x token counts
MAX_SEED = 2**32 - 1
MAX_WORKERS = 64  # processes for plan's steps (scenarios.tools.plan_pool caps it lower)
MAX_ZIPF = 10.0  # 1/i^10: all but the top few experts already get nothing
MAX_ALPHA = 1e6  # Dirichlet(1e6) is balanced to a millionth
MAX_COUNT = 1e15  # tokens per expert in a histogram; a layer's sum stays exact in a float
_UINT = re.compile(r"[0-9]{1,12}")  # ASCII digits only: int() would take "²" and "1_0"


@dataclass(frozen=True)
class PlanArgs:
    """The command line, read and checked; nothing here needs the model or torch."""

    preset: str
    config_changes: dict[str, object]
    profile: str
    eps: list[int]
    dp: int | None
    gpus_per_node: int | None  # None: the profile's (the one source; no default of our own)
    phases: list[str]
    tokens: dict[str, list[int]]
    dp_spread: float
    skews: list[str]
    histogram: Path | None
    placement: str
    redundant: int
    ubatches: list[int]
    seed: int
    out: Path | None
    json: bool
    workers: int | None = None  # processes for the steps (None: the local cores)


def _items(text: str, flag: str, what: str) -> list[str]:
    items = [item.strip() for item in text.split(",")]
    if "" in items:
        raise UsageError(f"{flag} {text!r}: an empty item; give {what}, comma-separated")
    if len(items) > MAX_ITEMS:
        raise UsageError(f"{flag}: {len(items)} values; give at most {MAX_ITEMS}")
    return items


def _whole(text: str, flag: str, lo: int, hi: int, given: str, why: str = "") -> int:
    if not (_UINT.fullmatch(text) and lo <= int(text) <= hi):
        raise UsageError(f"{flag} {given!r}: give whole numbers in {lo}..{hi}{why}")
    return int(text)


def _ints(text: str, flag: str, lo: int, hi: int, why: str = "") -> list[int]:
    items = _items(text, flag, f"whole numbers in {lo}..{hi}")
    return sorted({_whole(item, flag, lo, hi, text, why) for item in items})


def parse_tokens(text: str) -> list[int]:
    """`16,32,64`, or `16:512` doubling from 16 up to 512: at most 21 counts."""
    if ":" not in text:
        return _ints(text, "--tokens", 1, MAX_TOKENS)
    lo_text, _, hi_text = text.partition(":")
    lo = _whole(lo_text.strip(), "--tokens", 1, MAX_TOKENS, text)
    hi = _whole(hi_text.strip(), "--tokens", 1, MAX_TOKENS, text)
    if lo > hi:
        raise UsageError(f"--tokens {text!r}: a range runs up, like 16:512")
    values = [lo]
    while values[-1] * 2 <= hi:
        values.append(values[-1] * 2)
    return values


def parse_skew(text: str) -> str:
    """`balanced`, `zipf:S` or `dirichlet:A`, checked; the text as given (the label)."""
    name, colon, value = text.partition(":")
    try:
        if name == "balanced" and not colon:
            return text
        if name == "zipf":
            finite_float(value, 0.0, MAX_ZIPF)
            return text
        if name == "dirichlet":
            finite_float(value, 0.0, MAX_ALPHA, above_low=True)
            return text
    except ValueError as error:
        raise UsageError(f"--skew {text!r}: {error}") from None
    raise UsageError(
        f"unknown skew {text!r}: give balanced, zipf:S (S in 0..{MAX_ZIPF:g}, e.g. zipf:0.8) "
        f"or dirichlet:A (A > 0, e.g. dirichlet:4)"
    )


def parse_placement(text: str) -> int:
    """`contiguous` (0) or `eplb:N`: N redundant experts."""
    if text == "contiguous":
        return 0
    name, _, value = text.partition(":")
    if name != "eplb" or not (_UINT.fullmatch(value) and int(value) <= MAX_REDUNDANT):
        raise UsageError(
            f"--placement {text!r}: give contiguous or eplb:N, N in 0..{MAX_REDUNDANT}"
        )
    return int(value)


def check_histogram(path: Path) -> list[list[float]]:
    """The file's token counts per layer and expert, read as `dbo.sim.routing.from_histogram`
    reads them (JSON lists or {"tokens": lists}; CSV rows, a header row allowed), refused
    unless every count is finite, 0..1e15, every row as long and every row's sum above 0.
    The shape against the model's is checked once the model is known."""
    flag = "--histogram"
    if path.suffix.lower() == ".json":
        data = read_json_file(path, flag)
        rows = data.get("tokens") if isinstance(data, dict) else data
    else:
        text = read_text_file(path, flag)
        rows = [r for r in csv.reader(io.StringIO(text)) if r]
        if rows and not _all_numbers(rows[0]):
            rows = rows[1:]
    if not isinstance(rows, list) or not rows or not all(isinstance(r, list) for r in rows):
        raise UsageError(f"{flag} {path}: give one row of token counts per MoE layer")
    counts = [[_count(v, path) for v in row] for row in rows]
    if len({len(row) for row in counts}) != 1 or not counts[0]:
        raise UsageError(f"{flag} {path}: every row needs the same number (one per expert) > 0")
    if any(sum(row) <= 0 for row in counts):
        raise UsageError(f"{flag} {path}: a layer's counts sum to 0; each layer needs tokens")
    return counts


def _all_numbers(row: list[str]) -> bool:
    try:
        [float(v) for v in row]
    except ValueError:
        return False
    return True


def _count(value: object, path: Path) -> float:
    try:
        number = float(value) if not isinstance(value, bool | list | dict) else float("nan")
    except (TypeError, ValueError):
        number = float("nan")
    if not 0 <= number <= MAX_COUNT:  # also refuses nan
        raise UsageError(
            f"--histogram {path}: {str(value)[:40]!r} is not a token count (0..{MAX_COUNT:g})"
        )
    return number


def _config(path: Path | None) -> dict[str, object]:
    if path is None:
        return {}
    try:
        return config_changes(read_json_file(path, "--config"))
    except ValueError as error:
        raise UsageError(f"--config {path}: {error}") from None


def _skews(args: argparse.Namespace) -> list[str]:
    if args.histogram:
        check_histogram(args.histogram)
        return ["histogram"]
    items = _items(args.skew, "--skew", "balanced, zipf:S or dirichlet:A")
    return list(dict.fromkeys(parse_skew(item) for item in items))


def _spread(text: str) -> float:
    try:
        spread = finite_float(text, 0.0, 1.0)
    except ValueError as error:
        raise UsageError(f"--dp-spread: {error}") from None
    if spread >= 1.0:
        raise UsageError(f"--dp-spread {text}: give a fraction in [0, 1)")
    return spread


def parse_args(args: argparse.Namespace) -> PlanArgs:
    """The whole command line checked, before anything heavy is imported."""
    eps = _ints(args.ep, "--ep", 2, MAX_EP, " (one rank has no all-to-all for DBO to hide)")
    if args.dp is not None and args.dp not in (1, *eps):
        raise UsageError(f"--dp {args.dp}: give 1 or the EP size (DP attention over the EP group)")
    phases = ["decode", "prefill"] if args.phase == "both" else [args.phase]
    given = args.tokens
    tokens = {p: parse_tokens(DEFAULT_TOKENS[p] if given is None else given) for p in phases}
    skews = _skews(args)
    points = sum(len(tokens[p]) for p in phases) * len(eps) * len(skews)
    if points > MAX_POINTS:
        raise UsageError(
            f"{points} points to simulate (phases x EP sizes x skews x token counts); give at "
            f"most {MAX_POINTS}"
        )
    parsed = PlanArgs(
        preset=args.preset,
        config_changes=_config(args.config),
        profile=args.profile,
        eps=eps,
        dp=args.dp,
        gpus_per_node=args.gpus_per_node,
        phases=phases,
        tokens=tokens,
        dp_spread=_spread(args.dp_spread),
        skews=skews,
        histogram=args.histogram,
        placement=args.placement,
        redundant=parse_placement(args.placement),
        ubatches=_ints(args.ubatches, "--ubatches", 2, 4),
        seed=args.seed,
        out=args.out,
        json=args.json,
        workers=getattr(args, "workers", None),
    )
    if args.out is not None:
        writable_dir(args.out)
    return parsed
