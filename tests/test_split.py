"""Tests of dbo.split: cut points, request slicing, thresholds, bad input, and DP agreement.

The agreement tests start real gloo process groups (2 and 4 ranks on 127.0.0.1). Starting a
torch process costs seconds, so each group is started once per module and runs every
scenario in turn; each test then checks one behaviour from the recorded outcomes. The workers
are this file run as a script, so they do not depend on how pytest imports test modules.
"""

from __future__ import annotations

import os
import pickle
import random
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

import dbo
from dbo.split import (
    UBatchAgreementError,
    UBatchDecision,
    UBatchProposal,
    UBatchSlice,
    UBatchThresholds,
    coordinate_ubatching,
    decide_ubatching,
    has_empty_ubatch,
    make_ubatch_batches,
    should_ubatch,
    slice_query_start_loc,
    split_batch,
    ubatch_cut_points,
)

NO_THRESHOLDS = UBatchThresholds(decode_min_tokens=0, prefill_min_tokens=0)


def _token_slices(slices: list[UBatchSlice]) -> list[tuple[int, int]]:
    return [(s.token_slice.start, s.token_slice.stop) for s in slices]


def _request_slices(slices: list[UBatchSlice]) -> list[tuple[int, int]]:
    return [(s.request_slice.start, s.request_slice.stop) for s in slices]


# --------------------------------------------------------------------------------------------
# Records


def test_ubatch_slice_counts_and_emptiness() -> None:
    s = UBatchSlice(request_slice=slice(1, 3), token_slice=slice(8, 12))
    assert (s.num_tokens, s.num_requests, s.is_empty()) == (4, 2, False)
    assert UBatchSlice(slice(2, 2), slice(5, 5)).is_empty()


# --------------------------------------------------------------------------------------------
# Too few tokens


def test_one_token_is_never_split() -> None:
    assert not should_ubatch(1, True, 2, NO_THRESHOLDS)


def test_split_batch_refuses_one_token() -> None:
    with pytest.raises(ValueError, match="no real tokens"):
        split_batch([0, 1], num_tokens_padded=1, num_ubatches=2)


def test_fewer_tokens_than_ubatches_is_never_split() -> None:
    assert not should_ubatch(3, True, 4, NO_THRESHOLDS)
    # Padding does not help: the cut width grows but the real tokens still miss ubatch 3.
    assert not should_ubatch(3, True, 4, NO_THRESHOLDS, num_tokens_padded=8)


def test_exactly_num_ubatches_tokens_split_one_each() -> None:
    slices = split_batch([0, 4], num_tokens_padded=4, num_ubatches=4)
    assert _token_slices(slices) == [(0, 1), (1, 2), (2, 3), (3, 4)]


# --------------------------------------------------------------------------------------------
# Where the cuts fall


def test_uneven_split_gives_the_remainder_to_the_last_ubatch() -> None:
    slices = split_batch([0, 10], num_tokens_padded=10, num_ubatches=3)
    assert _token_slices(slices) == [(0, 3), (3, 6), (6, 10)]


@pytest.mark.parametrize(
    "num_ubatches, expected",
    [
        (2, [(0, 50), (50, 100)]),
        (3, [(0, 33), (33, 66), (66, 100)]),
        (4, [(0, 25), (25, 50), (50, 75), (75, 100)]),
    ],
)
def test_split_into_n_ubatches_cuts_at_multiples_of_padded_over_n(
    num_ubatches: int, expected: list[tuple[int, int]]
) -> None:
    qsl = [0, 7, 40, 41, 77, 100]
    slices = split_batch(qsl, num_tokens_padded=100, num_ubatches=num_ubatches)
    assert _token_slices(slices) == expected
    assert ubatch_cut_points(100, num_ubatches) == [a for a, _ in expected[1:]]


def test_padding_is_given_to_no_request() -> None:
    # 11 real tokens padded to 16: the cut is at 8, and the last slice ends at 11, not 16.
    slices = split_batch([0, 5, 11], num_tokens_padded=16, num_ubatches=2)
    assert _token_slices(slices) == [(0, 8), (8, 11)]
    assert slice_query_start_loc([0, 5, 11], slices[1]).tolist() == [0, 3]


def test_padded_ubatch_sizes_give_the_padding_tail_to_the_last_ubatch() -> None:
    batches = make_ubatch_batches([0, 5, 11], num_tokens_padded=17, num_ubatches=2)
    assert [(b.num_tokens, b.num_tokens_padded) for b in batches] == [(8, 8), (3, 9)]


# --------------------------------------------------------------------------------------------
# Requests across a cut


def test_request_across_a_cut_appears_in_both_slices() -> None:
    qsl = [0, 3, 10, 12]  # request 1 holds tokens 3..9; the cut at 6 passes through it
    first, second = split_batch(qsl, num_tokens_padded=12, num_ubatches=2)
    assert _request_slices([first, second]) == [(0, 2), (1, 3)]


def test_request_across_a_cut_has_rebased_offsets_summing_to_its_tokens() -> None:
    qsl = [0, 3, 10, 12]
    first, second = split_batch(qsl, num_tokens_padded=12, num_ubatches=2)
    a = slice_query_start_loc(qsl, first).tolist()
    b = slice_query_start_loc(qsl, second).tolist()
    assert a == [0, 3, 6]  # request 1 keeps tokens 3..5 of this slice
    assert b == [0, 4, 6]  # and tokens 0..3 of the next, rebased to start at 0
    assert (a[2] - a[1]) + (b[1] - b[0]) == 10 - 3


def test_clean_cut_on_a_request_boundary_duplicates_nothing() -> None:
    slices = split_batch([0, 4, 8], num_tokens_padded=8, num_ubatches=2)
    assert _request_slices(slices) == [(0, 1), (1, 2)]


def test_request_spanning_several_cuts_appears_in_every_slice_it_touches() -> None:
    qsl = [0, 1, 11, 12]  # request 1 spans the cuts at 3, 6 and 9
    slices = split_batch(qsl, num_tokens_padded=12, num_ubatches=4)
    assert _request_slices(slices) == [(0, 2), (1, 2), (1, 2), (1, 3)]
    assert [slice_query_start_loc(qsl, s).tolist() for s in slices] == [
        [0, 1, 3], [0, 3], [0, 3], [0, 2, 3]
    ]


def test_zero_token_requests_go_to_the_slice_holding_their_position() -> None:
    # Request 1 sits (empty) at the cut 4 -> second slice; request 3 (a padding request at the
    # real end) -> last slice.
    slices = split_batch([0, 4, 4, 8, 8], num_tokens_padded=8, num_ubatches=2)
    assert _request_slices(slices) == [(0, 1), (1, 4)]


@pytest.mark.parametrize("num_ubatches", [2, 3, 4])
def test_random_batches_rebuild_every_request_from_its_parts(num_ubatches: int) -> None:
    rng = random.Random(1234 + num_ubatches)
    for _ in range(200):
        lengths = [rng.randint(0, 40) for _ in range(rng.randint(1, 12))]
        qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        real = int(qsl[-1])
        padded = real + rng.randint(0, 30)
        if has_empty_ubatch(real, padded, num_ubatches):
            continue
        rebuilt = [0] * len(lengths)
        seen = [0] * len(lengths)
        for b in make_ubatch_batches(qsl, padded, num_ubatches):
            offsets = b.query_start_loc.tolist()
            assert offsets[0] == 0 and offsets[-1] == b.num_tokens
            for rid, lo, hi in zip(b.request_ids, offsets, offsets[1:]):
                rebuilt[rid] += hi - lo
                seen[rid] += 1
        assert rebuilt == lengths
        assert all(n >= 1 for n in seen), "every request belongs to some ubatch"


def test_make_ubatch_batches_names_requests_by_the_given_ids() -> None:
    a, b = make_ubatch_batches([0, 3, 10, 12], 16, 2, request_ids=["x", "y", "z"])
    assert (a.request_ids, b.request_ids) == (("x", "y"), ("y", "z"))


def test_slice_query_start_loc_keeps_a_tensors_dtype() -> None:
    qsl = torch.tensor([0, 3, 10, 12], dtype=torch.int64)
    (first, _) = split_batch(qsl, 12, 2)
    out = slice_query_start_loc(qsl, first)
    assert out.dtype == torch.int64 and out.tolist() == [0, 3, 6]


def test_slice_query_start_loc_gives_int32_for_a_list() -> None:
    (first, _) = split_batch([0, 3, 10, 12], 12, 2)
    assert slice_query_start_loc([0, 3, 10, 12], first).dtype == torch.int32


# --------------------------------------------------------------------------------------------
# Thresholds and the empty-last-ubatch rule


def test_decode_steps_split_from_32_tokens() -> None:
    assert not should_ubatch(31, True, 2)
    assert should_ubatch(32, True, 2)


def test_prefill_and_mixed_steps_split_from_512_tokens() -> None:
    assert not should_ubatch(511, False, 2)
    assert should_ubatch(512, False, 2)
    # 100 tokens would clear the decode bar but not the prefill one.
    assert not should_ubatch(100, False, 2)


def test_thresholds_are_configurable() -> None:
    t = UBatchThresholds(decode_min_tokens=8, prefill_min_tokens=64)
    assert should_ubatch(8, True, 2, t) and not should_ubatch(7, True, 2, t)
    assert should_ubatch(64, False, 2, t) and not should_ubatch(63, False, 2, t)


def test_no_split_when_padding_would_empty_the_last_ubatch() -> None:
    # 600 real tokens padded to 1200: the cut at 600 leaves ubatch 1 only padding.
    assert not should_ubatch(600, False, 2, num_tokens_padded=1200)
    assert should_ubatch(601, False, 2, num_tokens_padded=1200)


def test_empty_last_ubatch_rule_uses_the_last_cut_for_n_ubatches() -> None:
    # N = 3, padded 900: the last cut is at 600.
    assert has_empty_ubatch(600, 900, 3)
    assert not has_empty_ubatch(601, 900, 3)


def test_split_batch_refuses_a_split_with_an_empty_last_ubatch() -> None:
    with pytest.raises(ValueError, match="no real tokens"):
        split_batch([0, 300, 600], num_tokens_padded=1200, num_ubatches=2)


# --------------------------------------------------------------------------------------------
# Bad input


BAD_INPUTS: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    ("negative num_tokens", lambda: should_ubatch(-1, True, 2), ValueError, "num_tokens"),
    ("negative padded", lambda: split_batch([0, 4], -1, 2), ValueError, "num_tokens_padded"),
    ("one ubatch", lambda: split_batch([0, 4], 4, 1), ValueError, "num_ubatches"),
    ("one ubatch threshold", lambda: should_ubatch(600, False, 1), ValueError, "num_ubatches"),
    ("qsl not from 0", lambda: split_batch([1, 4, 8], 8, 2), ValueError, "start at 0"),
    ("qsl decreasing", lambda: split_batch([0, 5, 4, 8], 8, 2), ValueError, "non-decreasing"),
    ("qsl empty", lambda: split_batch([], 8, 2), ValueError, "query_start_loc"),
    ("qsl 2-D", lambda: split_batch([[0, 4], [4, 8]], 8, 2), ValueError, "1-D"),
    ("qsl float", lambda: split_batch(torch.tensor([0.0, 8.0]), 8, 2), TypeError, "integers"),
    ("padded < real", lambda: split_batch([0, 4, 8], 6, 2), ValueError, "num_tokens_padded"),
    ("padded < real threshold",
     lambda: should_ubatch(600, False, 2, num_tokens_padded=500), ValueError, "num_tokens_padded"),
    ("bool count", lambda: split_batch([0, 8], True, 2), TypeError, "num_tokens_padded"),
    ("decode flag not bool", lambda: should_ubatch(64, 1, 2), TypeError, "is_decode_only"),
    ("negative threshold", lambda: UBatchThresholds(decode_min_tokens=-1), ValueError,
     "decode_min_tokens"),
    ("slice outside batch",
     lambda: slice_query_start_loc([0, 4], UBatchSlice(slice(0, 2), slice(0, 4))), ValueError,
     "request_slice"),
    ("slice without bounds",
     lambda: slice_query_start_loc([0, 4], UBatchSlice(slice(None, 1), slice(0, 4))), ValueError,
     "explicit bounds"),
    ("slice not matching qsl",
     lambda: slice_query_start_loc([0, 4, 8], UBatchSlice(slice(1, 2), slice(0, 4))), ValueError,
     "does not match"),
    ("request_ids wrong length",
     lambda: make_ubatch_batches([0, 4, 8], 8, 2, request_ids=["a"]), ValueError, "request_ids"),
]


@pytest.mark.parametrize(
    "call, error, fragment", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS]
)
def test_bad_input_raises_an_error_naming_the_problem(
    call: Callable[[], Any], error: type[Exception], fragment: str
) -> None:
    with pytest.raises(error, match=fragment):
        call()


# --------------------------------------------------------------------------------------------
# Agreement, without processes: the pure decision and the no-process-group path


def _proposals(*rows: tuple[bool, int, int, int]) -> list[UBatchProposal]:
    return [UBatchProposal(r, *row) for r, row in enumerate(rows)]


def test_decision_pads_every_rank_to_the_largest_padded_count() -> None:
    d = decide_ubatching(_proposals((True, 1000, 1024, 2), (True, 1500, 1536, 2)))
    assert (d.split, d.num_tokens_padded, d.num_ubatches, d.reason) == (True, 1536, 2, "")


def test_decision_does_not_split_when_one_rank_cannot() -> None:
    d = decide_ubatching(_proposals((True, 1000, 1024, 2), (False, 100, 128, 2)))
    assert not d.split and "[1]" in d.reason and d.num_tokens_padded == 1024


def test_decision_refuses_padding_that_empties_a_ranks_last_ubatch() -> None:
    d = decide_ubatching(_proposals((True, 600, 600, 2), (True, 2000, 2000, 2)))
    assert not d.split and "rank 0" in d.reason


def test_decision_names_each_ranks_count_when_counts_differ() -> None:
    with pytest.raises(UBatchAgreementError, match=r"rank 0: 2, rank 1: 3"):
        decide_ubatching(_proposals((True, 1000, 1024, 2), (True, 1000, 1024, 3)))


def test_agreement_error_is_a_value_error() -> None:
    assert issubclass(UBatchAgreementError, ValueError)


def _skip_if_a_process_group_exists() -> None:
    if torch.distributed.is_initialized():
        pytest.skip("another test left a process group initialised in this process")


def test_without_a_process_group_the_local_decision_is_returned() -> None:
    _skip_if_a_process_group_exists()
    d = coordinate_ubatching(True, 1024, 2, num_tokens=1000)
    assert (d.split, d.num_tokens_padded, d.num_ubatches, len(d.per_rank)) == (True, 1024, 2, 1)


@pytest.mark.timeout(30)
def test_a_group_of_one_decides_locally_without_communicating(monkeypatch) -> None:
    import torch.distributed as dist

    _skip_if_a_process_group_exists()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{_free_loopback_port()}", rank=0, world_size=1,
        timeout=timedelta(seconds=20),
    )
    try:
        def no_collectives(*args: Any, **kwargs: Any) -> None:
            raise AssertionError("a group of one must not communicate")

        monkeypatch.setattr(dist, "all_gather", no_collectives)
        d = coordinate_ubatching(True, 600, 2, num_tokens=600)
    finally:
        dist.destroy_process_group()
    assert d.split and d.num_tokens_padded == 600 and len(d.per_rank) == 1


def test_without_a_process_group_a_split_needing_one_ubatch_is_refused() -> None:
    with pytest.raises(ValueError, match="num_ubatches"):
        coordinate_ubatching(True, 1024, 1)


# --------------------------------------------------------------------------------------------
# Agreement across real gloo process groups


def _dp_scenarios(rank: int, world: int) -> list[tuple[str, dict[str, Any]]]:
    """Each rank's arguments for every scenario, run in this order by every worker."""
    last = world - 1
    return [
        ("all_agree", dict(should_split=True, num_tokens_padded=1024 + 256 * rank,
                           num_ubatches=2, num_tokens=1000 + 256 * rank)),
        ("one_cannot", dict(should_split=rank != last, num_tokens_padded=1024 + 256 * rank,
                            num_ubatches=2, num_tokens=1000 + 256 * rank)),
        ("mismatched_counts", dict(should_split=True, num_tokens_padded=1024,
                                   num_ubatches=2 + rank % 2, num_tokens=1000)),
        ("padding_empties_rank_0", dict(should_split=True,
                                        num_tokens_padded=600 if rank == 0 else 2000,
                                        num_ubatches=2,
                                        num_tokens=600 if rank == 0 else 2000)),
        ("bad_argument_on_rank_1", dict(should_split=True,
                                        num_tokens_padded=-1 if rank == 1 else 1024,
                                        num_ubatches=2, num_tokens=1000 if rank != 1 else 0)),
        ("after_errors_three_ubatches", dict(should_split=True, num_tokens_padded=900 + rank,
                                             num_ubatches=3, num_tokens=900)),
    ]


def _dp_worker(rank: int, world: int, port: int, out_path: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=30),
    )
    results: dict[str, Any] = {}

    def record(name: str, call: Callable[[], UBatchDecision]) -> None:
        try:
            results[name] = ("ok", call())
        except Exception as exc:  # recorded for the parent to check, type and message
            results[name] = ("error", type(exc).__name__, str(exc))

    for name, kwargs in _dp_scenarios(rank, world):
        record(name, lambda: coordinate_ubatching(**kwargs))
    if world >= 4:
        # A DP group that is not the world: only ranks 1 and 3 take part.
        sub = dist.new_group([1, 3], backend="gloo")
        if rank in (1, 3):
            record("subgroup", lambda: coordinate_ubatching(
                True, 1024 + rank, 2, group=sub, num_tokens=1000))
    dist.destroy_process_group()
    tmp = out_path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(results, f)
    os.replace(tmp, out_path)


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_dp_group(world: int, workdir: Path, deadline_s: float = 45.0) -> list[dict[str, Any]]:
    """Start `world` worker processes, wait for all with a deadline, return each rank's
    results. Kills every worker it started on a timeout, so nothing outlives the test."""
    port = _free_loopback_port()
    env = dict(os.environ)
    repo_root = str(Path(dbo.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo_root, env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    if Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"  # keep gloo's data connections on loopback too
    procs, outs, errs = [], [], []
    try:
        for rank in range(world):
            out = workdir / f"rank{rank}.pkl"
            err = open(workdir / f"rank{rank}.stderr", "wb")
            errs.append(err)
            outs.append(out)
            procs.append(subprocess.Popen(
                [sys.executable, __file__, str(rank), str(world), str(port), str(out)],
                env=env, stdout=subprocess.DEVNULL, stderr=err,
            ))
        end = time.monotonic() + deadline_s
        for p in procs:
            p.wait(timeout=max(0.1, end - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"{world}-rank gloo group did not finish in {deadline_s}s:\n"
                    + _stderr_tails(workdir, world))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for e in errs:
            e.close()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        pytest.fail(f"ranks {failed} exited non-zero:\n" + _stderr_tails(workdir, world))
    return [pickle.loads(o.read_bytes()) for o in outs]


def _stderr_tails(workdir: Path, world: int) -> str:
    parts = []
    for r in range(world):
        path = workdir / f"rank{r}.stderr"
        text = path.read_text(errors="replace") if path.exists() else ""
        parts.append(f"--- rank {r} ---\n{text[-2000:]}")
    return "\n".join(parts)


@pytest.fixture(scope="module")
def dp_group_results(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], list]:
    """Results of one gloo group per world size, started on first use and then reused."""
    cache: dict[int, list[dict[str, Any]]] = {}

    def get(world: int) -> list[dict[str, Any]]:
        if world not in cache:
            cache[world] = _run_dp_group(world, tmp_path_factory.mktemp(f"dp{world}"))
        return cache[world]

    return get


def _decisions(results: list[dict[str, Any]], name: str) -> list[UBatchDecision]:
    outcomes = [r[name] for r in results]
    assert all(o[0] == "ok" for o in outcomes), outcomes
    return [o[1] for o in outcomes]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 4])
def test_dp_all_ranks_agree_split_and_pad_to_the_max(dp_group_results, world: int) -> None:
    decisions = _decisions(dp_group_results(world), "all_agree")
    expected_padded = 1024 + 256 * (world - 1)
    assert all(d.split and d.num_tokens_padded == expected_padded for d in decisions)
    assert all(d == decisions[0] for d in decisions)
    assert [p.num_tokens_padded for p in decisions[0].per_rank] == [
        1024 + 256 * r for r in range(world)
    ]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 4])
def test_dp_one_rank_cannot_so_nobody_splits(dp_group_results, world: int) -> None:
    decisions = _decisions(dp_group_results(world), "one_cannot")
    assert not any(d.split for d in decisions)
    assert all(f"[{world - 1}]" in d.reason for d in decisions)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 4])
def test_dp_mismatched_ubatch_counts_raise_on_every_rank(dp_group_results, world: int) -> None:
    outcomes = [r["mismatched_counts"] for r in dp_group_results(world)]
    assert all(o[:2] == ("error", "UBatchAgreementError") for o in outcomes), outcomes
    assert len({o[2] for o in outcomes}) == 1, "every rank gets the same message"
    for r in range(world):
        assert f"rank {r}: {2 + r % 2}" in outcomes[0][2]


@pytest.mark.timeout(60)
def test_dp_padding_to_the_max_that_empties_a_rank_stops_the_split(dp_group_results) -> None:
    decisions = _decisions(dp_group_results(2), "padding_empties_rank_0")
    assert not any(d.split for d in decisions)
    assert all(d.num_tokens_padded == 2000 for d in decisions)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 4])
def test_dp_bad_argument_on_one_rank_raises_on_every_rank(dp_group_results, world: int) -> None:
    outcomes = [r["bad_argument_on_rank_1"] for r in dp_group_results(world)]
    assert outcomes[1][:2] == ("error", "ValueError") and "num_tokens_padded" in outcomes[1][2]
    for r in range(world):
        if r != 1:
            assert outcomes[r][:2] == ("error", "UBatchAgreementError"), outcomes[r]
            assert "[1]" in outcomes[r][2]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 4])
def test_dp_group_still_agrees_after_errors(dp_group_results, world: int) -> None:
    decisions = _decisions(dp_group_results(world), "after_errors_three_ubatches")
    assert all(d.split and d.num_ubatches == 3 for d in decisions)
    assert all(d.num_tokens_padded == 900 + world - 1 for d in decisions)


@pytest.mark.timeout(60)
def test_dp_agreement_over_a_subgroup_counts_only_its_members(dp_group_results) -> None:
    results = dp_group_results(4)
    assert "subgroup" not in results[0] and "subgroup" not in results[2]
    decisions = _decisions([results[1], results[3]], "subgroup")
    assert all(len(d.per_rank) == 2 and d.num_tokens_padded == 1027 for d in decisions)
    assert all(d.split for d in decisions)


if __name__ == "__main__":
    _rank, _world, _port, _out = sys.argv[1:5]
    _dp_worker(int(_rank), int(_world), int(_port), _out)
