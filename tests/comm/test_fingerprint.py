"""`dbo.fingerprint` and `dbo.collective_calls` without processes: the cause each pair of
unpaired collectives is explained by, `collective_kind`, and the user's call site."""

from __future__ import annotations

import pytest

import dbo
from dbo.collective_calls import BOUNDARY_OP, CollectiveCall, explain, user_site


def call(rank: int, **fields) -> CollectiveCall:
    values = dict(
        group="WORLD",
        seq=3,
        op="all_gather",
        kind="dp-agreement",
        step=2,
        step_label="serial",
        index=1,
        ubatch=-1,
        shape=(6,),
        site="model.py:10:forward",
    )
    values.update(fields)
    return CollectiveCall(rank=rank, **values)


def test_a_rank_at_the_next_steps_boundary_skipped_the_collective() -> None:
    text = explain([call(0), call(1, op=BOUNDARY_OP, kind="has begun step 3 (DBO)", shape=None)])
    assert "rank 1 has begun step 3 (DBO) while rank 0 still calls all_gather" in text
    assert "rank 1 skipped that collective" in text


def test_the_same_kind_in_another_step_names_the_rank_behind() -> None:
    text = explain([call(0, step=2), call(1, step=3, group="ranks [0, 1]")])
    assert "rank 0 is in step 2 while rank 1 is in step 3 for the same 'dp-agreement'" in text


def test_the_same_collective_with_other_shapes_is_named_by_shape() -> None:
    text = explain([call(0, shape=(6, 4)), call(1, shape=(1, 4))])
    assert "([6, 4] on rank 0, [1, 4] on rank 1)" in text


def test_same_shape_exchanges_of_other_kinds_are_named_by_kind() -> None:
    text = explain([call(0, kind="ep combine"), call(1, kind="ep dispatch")])
    assert (
        "rank 0 calls all_gather ('ep combine') where rank 1 calls all_gather ('ep dispatch')"
        in text
    )


def test_a_repeated_collective_is_named_by_its_index() -> None:
    text = explain([call(0, index=2), call(1, index=1)])
    assert "rank 0 is at its #2 'dp-agreement' of step 2, rank 1 at #1" in text


def test_every_rank_is_listed_with_its_call_site() -> None:
    text = explain([call(0), call(1, kind="x")])
    assert "rank 0: all_gather, kind 'dp-agreement', step 2 (serial)" in text
    assert text.count("at model.py:10:forward") == 2


def test_collective_kind_nests_and_decorates() -> None:
    from dbo.fingerprint import _KIND  # the context variable the tracker reads

    @dbo.collective_kind("outer")
    def inner() -> str | None:
        with dbo.collective_kind("inner"):
            assert _KIND.get() == "inner"
        return _KIND.get()

    assert inner() == "outer" and _KIND.get() is None


def test_collective_kind_needs_a_name() -> None:
    with pytest.raises(ValueError, match="non-empty name"):
        dbo.collective_kind(" ")


def test_the_call_site_is_the_users_line() -> None:
    assert user_site().startswith("test_fingerprint.py:") and user_site().endswith(
        ":test_the_call_site_is_the_users_line"
    )
