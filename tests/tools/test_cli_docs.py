"""The command line's own documentation: docs/cli.md's verb table has a row for every verb,
and every verb's `--help` points to the one glossary of the words the output prints."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scenarios.cli import GLOSSARY, VERBS, main

ROOT = Path(__file__).resolve().parents[2]
# The jargon the verbs print that a newcomer cannot guess, each an entry of the glossary.
TERMS = ("LL / HT", "roofline-priced", "full-grid", "untraced", "padded", "(cal)")


def verb_table_rows() -> set[str]:
    """The verbs named in the first column of docs/cli.md's table."""
    text = (ROOT / "docs/cli.md").read_text(encoding="utf-8")
    return set(re.findall(r"^\| `([a-z-]+)` \|", text, re.MULTILINE))


def test_the_cli_docs_verb_table_has_a_row_for_every_verb():
    assert sorted({v.name for v in VERBS} - verb_table_rows()) == []


@pytest.mark.parametrize("verb", [v.name for v in VERBS])
def test_every_verbs_help_points_to_the_glossary(verb, capsys):
    assert main([verb, "--help"]) == 0
    assert GLOSSARY in " ".join(capsys.readouterr().out.split())


def test_the_glossary_explains_each_term_the_help_names():
    text = (ROOT / GLOSSARY).read_text(encoding="utf-8")
    entries = set(re.findall(r"^\*\*([^*]+)\*\*", text, re.MULTILINE))
    missing = [t for t in TERMS if not any(e == t or e.startswith(f"{t} ") for e in entries)]
    assert missing == []
