"""Docstrings and comments give design reasons; measured figures live in the README and the
bench JSON, where they are dated and can be re-measured. Published figures quoted as model
constants (datasheets, DeepEP's tables, the published experiments fidelity re-runs) stay
beside their constants, with their source, in the files listed below."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("dbo", "workspace", "scenarios")
# Files whose figures are published constants quoted with their source, not our measurements.
PUBLISHED_FIGURES = {
    "dbo/sim/hardware.py",  # datasheets and DeepEP/DeepGEMM tables, each with its source
    "scenarios/tools/fidelity_run.py",  # the published experiments it scores the simulator against
    "scenarios/lib/fidelity_rows.py",  # the published figures and setups (its sources)
    "scenarios/tools/fidelity_kernels.py",
    "scenarios/tools/fidelity_steps.py",
    "scenarios/tools/fidelity_scale.py",
}
# A time, a memory size or a speed ratio, as a measurement is written.
FIGURE = re.compile(
    r"\b\d+(\.\d+)?\s?(us|µs|ns|ms|GiB|MiB)\b"
    r"|~\s?\d+(\.\d+)?\s?x\b|\b\d+(\.\d+)?x\s(faster|slower|cheaper)\b"
    r"|\bmeasured on an? (H|A|B)\d{3}\b",
    re.IGNORECASE,
)


def _docstrings(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                found.append((getattr(node, "lineno", 1), doc))
    return found


def _comments(source: str) -> list[tuple[int, str]]:
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return [(t.start[0], t.string) for t in tokens if t.type == tokenize.COMMENT]


def test_no_docstring_or_comment_quotes_a_measured_figure():
    offenders = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            if name in PUBLISHED_FIGURES:
                continue
            source = path.read_text(encoding="utf-8")
            texts = _docstrings(ast.parse(source)) + _comments(source)
            offenders += [
                f"{name}:{line}: {m.group(0)!r}"
                for line, text in texts
                for m in [FIGURE.search(text)]
                if m
            ]
    assert offenders == []
