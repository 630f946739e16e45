"""`dbo.verify_ranks`: a step verified on real gloo rank processes, each rank with its own
batch (an idle rank's 0-token dummy batch included), every collective fingerprinted across
ranks before it runs, one report for the group, and a hang explained with no process left."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed import all_gather as raw_all_gather  # taken before any tracker exists
from torch.distributed import all_reduce as raw_all_reduce

import dbo
from dbo.comm import EPGroup
from dbo.split import coordinate_ubatching

HIDDEN = 4


def batches(rank: int, world_size: int) -> torch.Tensor:
    """Uneven ranks: rank 0 has 6 tokens, rank 1 is idle (the engine's 0-token dummy batch)."""
    rows = 6 if rank == 0 else 0
    return torch.arange(rows * HIDDEN, dtype=torch.float64).reshape(rows, HIDDEN)


def dp_step(batch: torch.Tensor) -> torch.Tensor:
    """Agree on the padded count, gather every rank's padded rows, keep this rank's own."""
    n = batch.shape[0]
    padded = coordinate_ubatching(False, n, 2).num_tokens_padded
    hidden = torch.zeros(padded, HIDDEN, dtype=batch.dtype)
    hidden[:n] = batch
    rows = [torch.empty_like(hidden) for _ in range(dist.get_world_size())]
    with dbo.collective_kind("moe gather"):
        dist.all_gather(rows, hidden)
    return rows[dist.get_rank()][:n] * 2


def skips_when_idle(batch: torch.Tensor) -> torch.Tensor:
    if batch.shape[0] == 0:
        return batch  # an idle rank that returns before the step's collectives
    return dp_step(batch)


def kind_swapped(batch: torch.Tensor) -> torch.Tensor:
    """Two same-shape exchanges whose order differs on rank 1: only their kinds tell."""
    first, second = ("combine", "dispatch") if dist.get_rank() == 1 else ("dispatch", "combine")
    out = torch.ones(2)
    for kind in (first, second):
        with dbo.collective_kind(kind):
            dist.all_reduce(out)
    return batch * out.sum()


def bypasses_tracker(batch: torch.Tensor) -> torch.Tensor:
    if dist.get_rank() == 0:
        raw_all_reduce(torch.ones(4))
    else:
        raw_all_gather([torch.ones(4), torch.ones(4)], torch.ones(4))
    return batch


def rank1_hangs(batch: torch.Tensor) -> torch.Tensor:
    if dist.get_rank() == 1:
        torch.multiprocessing.Event().wait()  # never set: rank 1 stops outside any collective
    dist.all_reduce(torch.ones(1))
    return batch


def wrong_under_dbo_on_rank0(batch: torch.Tensor) -> torch.Tensor:
    out = dp_step(batch)
    return out + 1 if dbo.dbo_enabled() and dist.get_rank() == 0 else out


@pytest.mark.timeout(60)
def test_uneven_ranks_with_an_idle_rank_are_ok_when_they_keep_in_step() -> None:
    report = dbo.verify_ranks(dp_step, batches, num_ranks=2)
    assert report.ok, report.describe()
    assert [v.tokens for v in report.ranks] == [6, 0]
    assert "every rank ran the same collectives" in report.describe()


@pytest.mark.timeout(60)
def test_a_skipped_collective_is_named_with_each_ranks_call_and_step() -> None:
    report = dbo.verify_ranks(skips_when_idle, batches, num_ranks=2)
    assert not report.ok
    text = report.out_of_step
    assert "rank 1 has begun step 2 (DBO) while rank 0 still calls all_gather" in text
    assert "kind 'dp-agreement', step 1 (serial)" in text
    assert "test_verify_ranks.py:" in text and ":dp_step" in text  # the user's call site
    assert all(not v.ok and "out of step" in v.headline() for v in report.ranks)


@pytest.mark.timeout(60)
def test_same_shape_collectives_of_other_kinds_are_named_by_kind() -> None:
    report = dbo.verify_ranks(kind_swapped, batches, num_ranks=2)
    assert "rank 0 calls all_reduce ('dispatch') where rank 1 calls all_reduce ('combine')" in (
        report.out_of_step or ""
    )


@pytest.mark.timeout(60)
def test_pytorchs_detail_check_becomes_the_reports_finding() -> None:
    report = dbo.verify_ranks(bypasses_tracker, batches, num_ranks=2, timeout=20)
    text = report.out_of_step or ""
    assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in text
    assert "rank 0: allreduce" in text and "rank 1: allgather" in text


@pytest.mark.timeout(60)
def test_a_hang_is_explained_and_no_rank_process_is_left() -> None:
    report = dbo.verify_ranks(rank1_hangs, batches, num_ranks=2, timeout=4)
    assert not report.ok and report.hang is not None
    text = "\n".join(report.hang)
    assert "did not finish within the 4 s timeout" in text
    assert "the ranks diverge at their collective #2" in text
    assert "rank 0 waits in all_reduce ('all_reduce', step 1) called at" in text, text
    assert "rank 1 is in no collective" in text and ":rank1_hangs" in text
    assert not multiprocessing.active_children()
    assert all(not Path(f"/proc/{pid}").exists() for pid in report.pids), report.pids
    assert os.getpid() not in {_parent(p) for p in Path("/proc").glob("[0-9]*")}


def _parent(proc: Path) -> int:
    try:
        stat = (proc / "stat").read_text()
    except OSError:
        return -1
    return int(stat[stat.rfind(")") + 2 :].split()[1])


@pytest.mark.timeout(60)
def test_each_rank_has_its_own_verdict_in_the_group_report() -> None:
    report = dbo.verify_ranks(wrong_under_dbo_on_rank0, batches, num_ranks=2)
    assert not report.ok and report.out_of_step is None
    assert not report.ranks[0].ok and report.ranks[1].ok
    assert "rank 0 (6 tokens): FAILED: outputs differ" in report.describe()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_ranks": 1}, "num_ranks"),
        ({"num_ranks": 3}, "2 batches for num_ranks=3"),  # a list of two batches for three ranks
        ({"timeout": 0}, "timeout"),
        ({"device": "cuda"}, "not supported"),
        ({"inputs": lambda: None}, "inputs must take"),
    ],
)
def test_bad_arguments_are_refused_before_any_rank_starts(kwargs, message) -> None:
    inputs = [batches(0, 2), batches(1, 2)] if kwargs.get("num_ranks") == 3 else batches
    kwargs = {"inputs": inputs, **kwargs}
    with pytest.raises((TypeError, ValueError), match=message):
        dbo.verify_ranks(dp_step, **kwargs)


@pytest.mark.timeout(60)
def test_the_fixture_fails_the_test_with_the_group_report(dbo_verify_ranks) -> None:
    with pytest.raises(pytest.fail.Exception, match="rank 1 has begun step 2"):
        dbo_verify_ranks(skips_when_idle, batches)


_EP_GROUPS: dict[str, EPGroup] = {}


def ep_layer(batch: torch.Tensor, *, idle_skips_combine: bool = False) -> torch.Tensor:
    """One expert-parallel layer over the rank group (dbo.comm.EPGroup): prepare, dispatch,
    experts, combine; an idle rank dispatches and combines 0 rows."""
    if "world" not in _EP_GROUPS:  # one per rank process (each forked with an empty dict)
        _EP_GROUPS["world"] = EPGroup(dist.group.WORLD, num_experts=4)
    ep = _EP_GROUPS["world"]
    ids = (torch.arange(batch.shape[0]) % 4).reshape(-1, 1)
    weights = torch.ones(batch.shape[0], 1, dtype=batch.dtype)
    plan = ep.prepare(ids, weights, dtype=batch.dtype)
    sent = ep.dispatch(batch, ids, weights, plan=plan)
    if idle_skips_combine and batch.shape[0] == 0:
        return batch
    return ep.combine(sent.recv_x * 2, sent.handle)


@pytest.mark.timeout(60)
def test_the_runtimes_own_ep_collectives_are_fingerprinted_by_kind() -> None:
    assert dbo.verify_ranks(ep_layer, batches, num_ranks=2).ok
    report = dbo.verify_ranks(
        lambda batch: ep_layer(batch, idle_skips_combine=True), batches, num_ranks=2
    )
    assert "rank 0 still calls all_to_all_single ('ep combine')" in (report.out_of_step or "")
    assert all("out of step" in v.headline() for v in report.ranks)


def rank1_dies(batch: torch.Tensor) -> torch.Tensor:
    if dist.get_rank() == 1:
        os._exit(9)  # a hard crash: no exception, no report
    dist.all_reduce(torch.ones(1))
    return batch


@pytest.mark.timeout(60)
def test_a_rank_that_dies_is_named_and_its_peers_history_kept() -> None:
    report = dbo.verify_ranks(rank1_dies, batches, num_ranks=2)
    assert report.hang is not None and report.hang[0] == "rank 1 exited with 9 mid-run"
    assert "rank 1: issued no collective #2" in "\n".join(report.hang)
    assert report.ranks[1].error.startswith("exited with 9 before reporting")
    assert report.ranks[0].tokens == 6 and not report.ranks[0].ok
