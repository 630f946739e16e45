"""`dbo-sim race-check`: seeded programs, our verdicts, and CSAN's where CUDA is present."""

from __future__ import annotations

import pytest
import torch

from scenarios.cli import main as cli_main
from scenarios.tools.race_check_run import PROGRAMS, Verdict, format_table, run_csan, run_sim

NO_CUDA = not torch.cuda.is_available()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("program", PROGRAMS, ids=[p.name for p in PROGRAMS])
def test_simulated_device_gives_the_expected_verdict(program) -> None:
    verdict = run_sim(program)
    assert verdict.error is None
    assert bool(verdict.races) == program.expect_race


def test_every_seeded_bug_has_a_correct_twin() -> None:
    names = [p.name for p in PROGRAMS]
    for bug in "abcd":
        assert sum(n.startswith(f"{bug}:") for n in names) == 1
        assert sum(n.startswith(f"{bug} twin:") for n in names) == 1


@pytest.mark.skipif(not NO_CUDA, reason="checks the CPU-only path")
def test_csan_column_is_not_applicable_without_cuda() -> None:
    verdict = run_csan(PROGRAMS[0])
    assert verdict == Verdict(None) and verdict.cell() == "n/a"


def test_table_marks_a_verdict_that_disagrees_with_the_expectation() -> None:
    race, clean = PROGRAMS[0], PROGRAMS[1]
    table = format_table([(race, Verdict(0), Verdict(None)), (clean, Verdict(0), Verdict(3))])
    lines = table.splitlines()
    assert "clean (!)" in lines[2] and "n/a" in lines[2]
    assert "race x3 (!)" in lines[3] and "clean (!)" not in lines[3]


@pytest.mark.timeout(60)
def test_cli_verb_prints_both_columns(capsys) -> None:
    assert cli_main(["race-check", "--only", "even/odd"]) == 0
    out = capsys.readouterr().out
    assert "dbo-sim checker" in out and "CSAN, every ubatch thread" in out
    assert "even/odd strided views" in out and "clean" in out


@pytest.mark.skipif(NO_CUDA, reason="needs CUDA: CSAN runs on real streams")
@pytest.mark.timeout(120)
def test_csan_in_every_ubatch_thread_sees_the_shared_slot() -> None:
    (program,) = [p for p in PROGRAMS if p.name.startswith("c:")]
    assert run_csan(program).races
