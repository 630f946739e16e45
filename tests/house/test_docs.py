"""The README is a front door: at most 200 lines, every `docs/` page it links to exists, its
ten-line example runs as written, and no doc carries change history (git keeps that)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_README_LINES = 200
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# Phrases that narrate what changed rather than say what is.
_HISTORY = re.compile(
    r"\bwhat moved\b|\bsince (the previous|commit)\b|\bbefore commit\b|\bused to be\b"
    r"|\bthis project before\b|\bno longer\b",
    re.IGNORECASE,
)


def _docs() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def _missing_links(page: Path) -> set[str]:
    """The relative links in `page` that name no file, as paths from the repository root."""
    missing = set()
    for target in _LINK.findall(page.read_text(encoding="utf-8")):
        if "://" in target:
            continue
        path = (page.parent / target).resolve()
        if not path.is_file():
            missing.add(path.relative_to(ROOT).as_posix())
    return missing


def test_the_readme_is_at_most_200_lines():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines"


def test_every_docs_page_the_readme_links_to_exists():
    missing = _missing_links(README)
    assert not missing, f"README links to missing {sorted(missing)}"


def test_the_docs_pages_link_only_to_files_that_exist():
    for page in _docs()[1:]:
        missing = _missing_links(page)
        assert not missing, f"{page.name} links to missing {sorted(missing)}"


def test_no_doc_narrates_change_history():
    found = [
        f"{page.relative_to(ROOT)}:{n}: {line.strip()}"
        for page in _docs()
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        if _HISTORY.search(line)
    ]
    assert not found, "change history belongs in git:\n" + "\n".join(found)


@pytest.mark.timeout(120)
def test_the_readme_example_runs_as_written(tmp_path):
    text = README.read_text(encoding="utf-8")
    example = text[text.index("```python\n") + len("```python\n") :]
    example = example[: example.index("```")]
    assert len(example.splitlines()) <= 10
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, "-c", example],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "out/verify/verify.png").read_bytes().startswith(b"\x89PNG")
