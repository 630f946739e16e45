"""Where `plan`'s crossover lies against its token range, and the count to add when it lies
at an edge.

One job: decide, from the answer over the counts simulated so far, whether the range must
grow. DBO "pays from" the smallest count from which the gain stays positive to the range's
end; when that is the range's first count, the crossover may lie below it, and when DBO pays
nowhere (or only at the last count), above it. The range then grows by halving its first
count or doubling its last, until the crossover is inside it or a bound stops it: at most
`MAX_EXTENSIONS` steps each way, never below 1 token or above `MAX_TOKENS`, and never past a
count that does not fit in the GPU's memory (upwards, memory only grows).
"""

from __future__ import annotations

from dataclasses import dataclass

from scenarios.tools.plan_args import MAX_TOKENS

__all__ = ["MAX_EXTENSIONS", "RangeState", "next_tokens", "range_note"]

MAX_EXTENSIONS = 4  # each way: the range reaches 16x below its first and above its last count


@dataclass(frozen=True)
class RangeState:
    """What the decision needs: the counts given, those simulated, the answer over them."""

    given: tuple[int, ...]
    simulated: tuple[int, ...]  # every count with a fitting point, given or added
    pays_from: int | None
    last_fits: bool  # the largest simulated count fits in memory


def _steps(a: int, b: int) -> int:
    steps = 0
    while a < b:
        a, steps = a * 2, steps + 1
    return steps


def next_tokens(state: RangeState) -> int | None:
    """The count to simulate next, or None when the crossover is inside the range or a
    bound stops the search."""
    if not state.simulated:
        return None
    lo, hi = min(state.simulated), max(state.simulated)
    if state.pays_from is not None and state.pays_from == lo:
        down_ok = lo > 1 and _steps(lo, min(state.given)) < MAX_EXTENSIONS
        return lo // 2 if down_ok else None
    if state.pays_from is None or state.pays_from == hi:
        up_ok = state.last_fits and hi * 2 <= MAX_TOKENS
        return hi * 2 if up_ok and _steps(max(state.given), hi) < MAX_EXTENSIONS else None
    return None


def range_note(state: RangeState) -> str:
    """The answer's word on its range: how it grew and why it stopped ("" if it did not)."""
    if not state.simulated:
        return ""
    lo, hi = min(state.simulated), max(state.simulated)
    given_lo, given_hi = min(state.given), max(state.given)
    notes = []
    if lo < given_lo:
        where = f"range extended down from {given_lo} to {lo} tokens"
        if state.pays_from == lo:
            stop = "1 token" if lo == 1 else f"{MAX_EXTENSIONS} halvings"
            where += f"; still pays there, bound reached ({stop})"
        notes.append(where)
    elif state.pays_from == lo and lo == given_lo:
        notes.append(f"pays at the range's first count {lo}: the crossover may lie below it")
    if hi > given_hi or (state.pays_from in (None, hi) and hi == given_hi):
        where = f"range extended up from {given_hi} to {hi} tokens" if hi > given_hi else ""
        if state.pays_from in (None, hi):
            if not state.last_fits:
                stop = f"{hi} tokens does not fit in memory"
            elif hi * 2 > MAX_TOKENS:
                stop = f"{MAX_TOKENS} tokens"
            else:
                stop = f"{MAX_EXTENSIONS} doublings"
            where = f"{where}; bound reached ({stop})" if where else f"bound reached ({stop})"
        notes.append(where)
    return "; ".join(n for n in notes if n)
