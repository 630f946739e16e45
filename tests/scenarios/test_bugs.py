"""Tests of the bug corpus (`scenarios.bugs`, `dbo-sim bugs`): every entry's buggy variant is
caught by its tool with a message naming the cause, and its fixed variant is clean."""

from __future__ import annotations

import json

import pytest

from scenarios.bugs.catalog import BUGS, run_bug
from scenarios.bugs.registry import Verdict, bug
from scenarios.cli import main


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(BUGS))
def test_each_bug_is_caught_naming_its_cause_and_its_fix_is_clean(name: str) -> None:
    result = run_bug(BUGS[name])
    assert result.buggy.caught, result.buggy.message
    assert result.names_cause, (BUGS[name].evidence, result.buggy.message)
    assert not result.fixed.caught, result.fixed.message
    assert result.passed


def test_the_corpus_covers_the_reported_bugs() -> None:
    refs = " ".join(b.ref for b in BUGS.values())
    for number in ("48659", "50945", "49542", "43966", "56031", "33694", "43145", "26209"):
        assert f"vllm#{number}" in refs
    assert "sglang#13082" in refs and "sglang#6328" in refs
    for number in ("25625", "25906", "52176"):  # graph kind and size, workspace fallback
        assert f"vllm#{number}" in refs
    assert "afd-plugin#99" in refs  # an empty ubatch the engine's rules refuse
    assert "vllm-ascend#4393" in refs  # a dummy run's graph size from mRoPE positions
    assert "sglang#7222" in refs  # the EP dispatch mode resolved from a rank's own batch
    assert "vllm#50945 (review thread)" in refs  # a dummy run opting out of microbatching
    assert all(b.cause and b.evidence and b.caught_by for b in BUGS.values())


def test_at_least_half_the_corpus_runs_on_real_ranks() -> None:
    multi = [b for b in BUGS.values() if b.ranks > 1]
    assert len(BUGS) >= 14 and 2 * len(multi) >= len(BUGS)


@pytest.mark.parametrize(
    "name", ["vllm-25906-dummy-run-graph-size", "vllm-ascend-4393-mrope-graph-tokens"]
)
def test_the_dp_graph_size_entries_run_on_real_ranks_through_verify_ranks(name: str) -> None:
    entry = BUGS[name]
    assert entry.ranks == 2 and entry.caught_by.startswith("dbo.verify_ranks (graphs")


def test_a_bug_name_registers_once() -> None:
    name = next(iter(BUGS))
    with pytest.raises(ValueError, match="registered twice"):
        bug(name, engine="x", ref="x", cause="x", caught_by="x", evidence="x")(
            lambda buggy: Verdict(buggy, "x", "x")
        )


def test_an_entry_that_fails_to_run_does_not_hold() -> None:
    from scenarios.bugs.registry import Bug

    def broken() -> tuple[Verdict, Verdict]:
        raise RuntimeError("rank 1 exited")

    result = run_bug(Bug("broken", "x", "x", "x", "x", "x", broken))
    assert not result.passed and "rank 1 exited" in result.buggy.message


def test_cli_lists_every_entry_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bugs", "--list", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {r["bug"] for r in rows} == set(BUGS)
    assert all(r["cause"] and r["ref"] and r["ranks"] >= 1 for r in rows)


@pytest.mark.timeout(60)
def test_cli_runs_a_named_entry_and_reports_both_variants(capsys) -> None:
    assert main(["bugs", "vllm-56031-continuation-computed", "--json"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["passed"] and row["buggy"]["caught"] and not row["fixed"]["caught"]
    assert "num_computed_tokens_cpu" in row["buggy"]["message"]


def test_cli_refuses_an_unknown_entry_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bugs", "no-such-bug"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dbo-sim: unknown bug 'no-such-bug'") and err.count("\n") == 1


@pytest.mark.timeout(60)
def test_the_unbalanced_prefill_split_is_judged_by_its_simulated_gain() -> None:
    from scenarios.bugs.sglang_split import MIN_GAIN, simulated_timeline

    buggy, fixed = simulated_timeline(True), simulated_timeline(False)
    assert fixed.gain >= MIN_GAIN
    assert buggy.gain < fixed.gain
    assert max(buggy.compute_us) > 2 * min(buggy.compute_us)
