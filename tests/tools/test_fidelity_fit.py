"""The DeepEP low-latency constants read through the all-ranks replay: the fit's two steps."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dbo.sim.hardware import H800
from scenarios.lib.fidelity_rows import DEEPEP_LL_EFFICIENCY_FIGURES, DEEPEP_LL_PUBLISHED
from scenarios.tools.fidelity_fit import (
    EFFICIENCY_STEP,
    LATENCY_STEP_US,
    LLFit,
    fit_deepep_ll_constants,
    fit_ll_rdma_efficiency,
)
from scenarios.tools.fidelity_scale import deepep_ll_cluster_times


@pytest.fixture(scope="module")
def fit() -> LLFit:
    return fit_deepep_ll_constants(H800)


def _squared_misses(profile) -> float:
    total = 0.0
    for ep, kind in DEEPEP_LL_EFFICIENCY_FIGURES:
        published = DEEPEP_LL_PUBLISHED[ep][0 if kind == "dispatch" else 1]
        total += (deepep_ll_cluster_times(ep, profile)[kind] / published - 1) ** 2
    return total


@pytest.mark.slow
def test_fitted_latency_puts_the_replayed_ep8_dispatch_on_deepeps_figure(fit: LLFit) -> None:
    # on the latency's grid the replay can miss the figure by at most half a step
    fitted = replace(
        H800, ll_latency_us=fit.ll_latency_us, ll_rdma_efficiency=fit.ll_rdma_efficiency
    )
    assert deepep_ll_cluster_times(8, fitted)["dispatch"] == pytest.approx(
        DEEPEP_LL_PUBLISHED[8][0], abs=LATENCY_STEP_US / 2 + 1e-9
    )
    assert fit.misses["scale-deepep-ll-dispatch-ep8"] == pytest.approx(
        (deepep_ll_cluster_times(8, fitted)["dispatch"] / DEEPEP_LL_PUBLISHED[8][0] - 1) * 100
    )


@pytest.mark.slow
def test_fitted_efficiency_misses_the_ep64_and_ep256_figures_least_of_its_grid(
    fit: LLFit,
) -> None:
    at = replace(H800, ll_latency_us=fit.ll_latency_us)
    best = _squared_misses(replace(at, ll_rdma_efficiency=fit.ll_rdma_efficiency))
    for step in (-EFFICIENCY_STEP, EFFICIENCY_STEP):
        neighbour = replace(at, ll_rdma_efficiency=fit.ll_rdma_efficiency + step)
        assert _squared_misses(neighbour) >= best


def test_a_fit_past_the_physical_bounds_is_not_plausible() -> None:
    assert LLFit(33.0, 0.95, {}).plausible
    assert LLFit(33.0, 1.0, {}).plausible  # the line rate itself is the bound
    assert not LLFit(33.0, 1.01, {}).plausible
    assert not LLFit(0.0, 0.95, {}).plausible


@pytest.mark.slow
def test_the_profiles_carry_the_low_latency_nic_share_the_replay_reads() -> None:
    # read at the profile's own ll_latency_us; a change to the replay that moves the fit
    # must re-read the constant (and say so in docs/fidelity.md)
    assert H800.ll_rdma_efficiency == pytest.approx(fit_ll_rdma_efficiency(H800))
    assert LLFit(H800.ll_latency_us, H800.ll_rdma_efficiency, {}).plausible
