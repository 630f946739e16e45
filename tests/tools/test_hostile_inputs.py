"""Hostile input to `dbo-sim plan` and `dbo-sim analyze`: every case in its own process,
under a hard timeout, ends with exit status 0 or 2, never a traceback, never a NaN or an
infinity in an answer, and a refusal is one line `dbo-sim: <why>`.

The cases are data (`tests/tools/hostile_cases.py`). Most are refused before torch is imported,
so each process is short; the `heavy` ones (past the torch-free checks: the model, the
profile, a trace's contents, two small answered runs) import torch and are marked slow.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hostile_cases import CASES, REFUSED, Case  # beside this file (pytest puts it on the path)

ROOT = Path(__file__).resolve().parents[2]
NON_FINITE = re.compile(r"\b[+-]?(nan|inf|infinity)\b", re.IGNORECASE)
LIGHT_TIMEOUT_S = 60  # a torch-free refusal takes well under a second on a quiet machine
HEAVY_TIMEOUT_S = 240


def _params() -> list:
    return [pytest.param(c, id=c.id, marks=[pytest.mark.slow] if c.heavy else []) for c in CASES]


def _run(case: Case, folder: Path) -> subprocess.CompletedProcess[str]:
    for name, text in case.files.items():
        (folder / name).write_text(text, encoding="utf-8")
    argv = [a.replace("{dir}", str(folder)) for a in case.argv]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "scenarios", *argv],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=HEAVY_TIMEOUT_S if case.heavy else LIGHT_TIMEOUT_S,
    )


def test_there_are_at_least_a_hundred_cases_over_plan_and_analyze():
    assert len(CASES) >= 100 and len({c.id for c in CASES}) == len(CASES)
    assert {c.argv[0] for c in CASES if c.argv} == {"plan", "analyze"}


@pytest.mark.timeout(HEAVY_TIMEOUT_S + 30)
@pytest.mark.parametrize("case", _params())
def test_a_hostile_input_is_answered_or_refused_in_one_line(case: Case, tmp_path: Path):
    done = _run(case, tmp_path)
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.returncode == case.status, (done.returncode, done.stderr[-500:])
    if done.returncode == REFUSED:
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("dbo-sim: "), done.stderr
        assert case.says in lines[0]
    else:
        assert not NON_FINITE.search(done.stdout), NON_FINITE.search(done.stdout)
        assert case.says in done.stdout
        if "--json" in case.argv:
            json.loads(done.stdout)  # exactly one JSON document, nothing else on stdout
