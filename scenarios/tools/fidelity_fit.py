"""DeepEP's low-latency constants read off DeepEP's own figures through the all-ranks replay.

`ll_latency_us` and `ll_rdma_efficiency` (`dbo.sim.hardware`) are properties of DeepEP's
low-latency kernels that no datasheet gives, so they are read off DeepEP's published times.
Those times come from DeepEP's benchmark: random routing on every rank, 30 back-to-back runs
per rank. They hold the routing imbalance and the loop's waits. Read through the balanced
one-rank formula (`dbo.sim.cost`), a constant absorbs that imbalance, and the all-ranks
replay, which models it, then counts it a second time. This fit reads them through the
replay that reproduces the benchmark (`deepep_ll_cluster_times`), using calibration figures
only:

1. `ll_latency_us` from the EP 8 dispatch. One node means NVLink only, so the NIC plays no
   part. The fit takes the value on the `LATENCY_STEP_US` grid that brings the replay
   nearest the figure.
2. `ll_rdma_efficiency`, with that latency, from the EP 64 and EP 256 dispatch and combine:
   the value on the `EFFICIENCY_STEP` grid with the least sum of squared relative misses.

The profiles adopt step 2 at their own `ll_latency_us` (`fit_ll_rdma_efficiency`): that
latency was read off the same EP 8 figure by the balanced formula, and on one node, where
the imbalance is small, the two readings are close. The figures neither step reads (the EP 8
combine, EP 16, 32 and 128) stay checks. Both searches reach past what is physical (a latency
at or below zero, an efficiency above one), so the fit reports where the figures put the
constants instead of where a bound stopped it; `plausible` says whether the result can be
adopted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from dbo.sim.hardware import H800, HardwareProfile
from scenarios.lib.fidelity_rows import (
    DEEPEP_LL_EFFICIENCY_FIGURES,
    DEEPEP_LL_LATENCY_FIGURE,
    DEEPEP_LL_PUBLISHED,
)
from scenarios.tools.fidelity_scale import deepep_ll_cluster_times

__all__ = [
    "LLFit",
    "fit_deepep_ll_constants",
    "fit_ll_rdma_efficiency",
    "LATENCY_STEP_US",
    "EFFICIENCY_STEP",
]

# The grids the constants are stated on: DeepEP publishes whole microseconds, and a hundredth
# of the NIC's rate is finer than its figures tell apart.
LATENCY_STEP_US = 0.5
EFFICIENCY_STEP = 0.01


@dataclass(frozen=True)
class LLFit:
    """The fitted constants and the replay's relative miss (%) on each DeepEP LL figure with
    them, keyed like the fidelity rows (`scale-deepep-ll-<kind>-ep<ep>`)."""

    ll_latency_us: float
    ll_rdma_efficiency: float
    misses: dict[str, float]

    @property
    def plausible(self) -> bool:
        """A latency above zero and a share of the NIC's line rate no larger than all of it."""
        return self.ll_latency_us > 0 and 0 < self.ll_rdma_efficiency <= 1.0


def fit_deepep_ll_constants(profile: HardwareProfile = H800) -> LLFit:
    """`ll_latency_us`, then `ll_rdma_efficiency`, read through the all-ranks replay on
    `profile` (the module docstring gives the rule)."""
    latency = _fit_latency(profile)
    efficiency = _fit_efficiency(replace(profile, ll_latency_us=latency))
    fitted = replace(profile, ll_latency_us=latency, ll_rdma_efficiency=efficiency)
    return LLFit(latency, efficiency, _misses(fitted))


def fit_ll_rdma_efficiency(profile: HardwareProfile = H800) -> float:
    """Step 2 alone, at `profile`'s own `ll_latency_us`: the value the profiles carry."""
    return _fit_efficiency(profile)


def _miss(profile: HardwareProfile, ep: int, kind: str) -> float:
    """The replay's relative miss (%) on DeepEP's figure for (`ep`, `kind`)."""
    published = DEEPEP_LL_PUBLISHED[ep][0 if kind == "dispatch" else 1]
    return (deepep_ll_cluster_times(ep, profile)[kind] / published - 1) * 100


def _misses(profile: HardwareProfile) -> dict[str, float]:
    return {
        f"scale-deepep-ll-{kind}-ep{ep}": _miss(profile, ep, kind)
        for ep in sorted(DEEPEP_LL_PUBLISHED)
        for kind in ("dispatch", "combine")
    }


def _fit_latency(profile: HardwareProfile) -> float:
    """The replay's EP 8 dispatch grows with the latency: bisect for the figure, then take
    the nearer grid point."""
    ep, kind = DEEPEP_LL_LATENCY_FIGURE
    published = DEEPEP_LL_PUBLISHED[ep][0]

    def miss(latency: float) -> float:
        return _miss(replace(profile, ll_latency_us=latency), ep, kind)

    lo, hi = -published, published
    while hi - lo > LATENCY_STEP_US / 100:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if miss(mid) < 0 else (lo, mid)
    return _best_on_grid(lambda x: abs(miss(x)), (lo + hi) / 2, LATENCY_STEP_US)


def _fit_efficiency(profile: HardwareProfile) -> float:
    """Golden-section search of the squared misses (one minimum: every figure's time falls as
    the efficiency grows), then the better neighbouring grid point."""

    def cost(efficiency: float) -> float:
        p = replace(profile, ll_rdma_efficiency=efficiency)
        return sum(_miss(p, ep, kind) ** 2 for ep, kind in DEEPEP_LL_EFFICIENCY_FIGURES)

    ratio = (5**0.5 - 1) / 2
    lo, hi = 0.5, 1.5
    while hi - lo > EFFICIENCY_STEP / 100:
        a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        lo, hi = (lo, b) if cost(a) < cost(b) else (a, hi)
    return _best_on_grid(cost, (lo + hi) / 2, EFFICIENCY_STEP)


def _best_on_grid(cost: Callable[[float], float], x: float, step: float) -> float:
    """Of the two grid points around `x`, the one `cost` prefers (rounded to the grid)."""
    below = (x // step) * step
    points = [round(below, 6), round(below + step, 6)]
    return min(points, key=cost)
