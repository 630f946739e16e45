"""The virtual EP group (`dbo.sim.cluster`, every rank replayed in one process) agrees with R
real gloo rank processes whose simulated clocks wait for each other at every all-to-all, on
the same model, routing and token counts (`scenarios.ranks.crosscheck`)."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytest

from dbo.sim.alltoall import all_to_all_ends
from dbo.sim.hardware import H200
from dbo.sim.routing import assign_experts, routed_counts, zipf
from scenarios.harness import RunOptions
from scenarios.ranks.crosscheck import SKEWS, crosscheck_registered, crosscheck_replay
from scenarios.ranks.processes import run_local_ranks

# Multi-process or long-running: `make test-slow` (and CI) runs these.
pytestmark = pytest.mark.slow

BOUND = 0.02  # per rank, relative
replay = lru_cache(maxsize=None)(crosscheck_replay)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda r: f"R{r}")
def runs(request: pytest.FixtureRequest) -> tuple[int, dict]:
    ranks = request.param
    with crosscheck_registered() as names:
        results = run_local_ranks(names, RunOptions(num_ubatches=2, timeout_s=60), ranks)
    return ranks, {r.scenario: r for r in results}


def _pairs(runs: tuple[int, dict], name: str, field: str, replayed: str) -> list[tuple]:
    ranks, results = runs
    result = results[name]
    assert result.passed, result.error  # real all-to-all, values equal the one-process run
    virtual = replay(SKEWS[name], ranks, 2)
    per_rank = sorted(result.details["per_rank"], key=lambda o: o["rank"])
    assert len(per_rank) == ranks
    return [(o[field], float(getattr(virtual, replayed)[o["rank"]])) for o in per_rank]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(SKEWS))
def test_each_ranks_step_time_agrees_with_the_replay_within_2_percent(runs, name):
    for got, want in _pairs(runs, name, "step_us_dbo", "step_us"):
        assert got == pytest.approx(want, rel=BOUND)


@pytest.mark.timeout(120)
def test_balanced_routing_exposes_the_same_comm_on_both_paths(runs):
    for got, want in _pairs(runs, "crosscheck-balanced", "exposed_comm_us", "exposed_comm_us"):
        assert got == pytest.approx(want, rel=BOUND)


@pytest.mark.timeout(120)
def test_skewed_routing_exposes_comm_within_the_known_elementwise_difference(runs):
    # a few percent apart: the replay re-times elementwise expert ops linearly, the kernel
    # table does not (docs/plan.md, "Cross-check against real rank processes").
    for got, want in _pairs(runs, "crosscheck-zipf", "exposed_comm_us", "exposed_comm_us"):
        assert got == pytest.approx(want, rel=0.05)


@pytest.mark.timeout(120)
def test_skewed_routing_makes_ranks_wait_for_peers_on_both_paths(runs):
    pairs = _pairs(runs, "crosscheck-zipf", "peer_wait_us", "peer_wait_us")
    assert max(got for got, _ in pairs) > 0 and max(want for _, want in pairs) > 0
    balanced = _pairs(runs, "crosscheck-balanced", "peer_wait_us", "peer_wait_us")
    assert all(got == 0 and want == 0 for got, want in balanced)


@pytest.mark.timeout(120)
def test_skewed_routing_slows_the_step_on_both_paths(runs):
    skewed = _pairs(runs, "crosscheck-zipf", "step_us_dbo", "step_us")
    even = _pairs(runs, "crosscheck-balanced", "step_us_dbo", "step_us")
    assert min(s[0] for s in skewed) > 1.1 * max(e[0] for e in even)
    assert min(s[1] for s in skewed) > 1.1 * max(e[1] for e in even)


def test_the_slowest_sender_gates_the_receiver():
    ready = np.array([0.0, 100.0])  # rank 1 reaches the collective 100 us later
    traffic = np.array([[0.0, 1e6], [1e6, 0.0]])
    ends = all_to_all_ends(H200, "ht", ready, traffic)
    assert ends.gate.tolist() == [1, 1]
    assert ends.end[0] == pytest.approx(ends.end[1])
    assert ends.peer_wait_us[0] == pytest.approx(100.0)


def test_assigned_experts_route_exactly_the_counts_and_never_twice_per_token():
    counts = routed_counts(zipf(1, 8, 1.0, top_k=2, seed=0), 256, 2)[0]
    ids = assign_experts(counts, 256, 2)
    assert np.bincount(ids.ravel(), minlength=8).tolist() == counts.tolist()
    assert (ids[:, 0] != ids[:, 1]).all()
