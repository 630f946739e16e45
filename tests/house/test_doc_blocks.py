"""Every code block in README.md and docs/*.md runs as written, so what a user copies works.

A ```python block is saved as a file and run with this Python, the repository on its path (as
from the repository root). In a ```bash block every `dbo-sim ...` and `python -m scenarios
...` line runs, from a folder where the repository's `examples/` and `tests/` are at hand and
`out/` is the test's own. A block that cannot run alone says so on the line before it, with
the reason: `<!-- fragment: why -->` (a piece of a larger program) or `<!-- not run: why -->`
(a command too long for the suite, or one that builds the environment the suite runs in).
Blocks in any other language, or none (outputs, layouts), are shown, not run.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

# Multi-process or long-running: `make test-slow` (and CI) runs these.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_SKIP = re.compile(r"<!--\s*(fragment|not run):\s*(\S[^>]*?)\s*-->\s*$")
_CLI = re.compile(r"^(dbo-sim|python -m scenarios)\s")
# Seconds one block may take: the blocks that run are the cheap ones; a block that needs
# longer should be marked `not run` with the test that covers it.
BLOCK_TIMEOUT_S = 120


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, its language, its text, and why it is not run."""

    page: Path
    line: int
    lang: str
    text: str
    skip: str | None

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT).as_posix()}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    found = []
    for match in _FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = _SKIP.search(before)
        found.append(
            Block(
                page=page,
                line=text.count("\n", 0, match.start()) + 1,
                lang=match.group(1),
                text=match.group(2),
                skip=None if skip is None else f"{skip.group(1)}: {skip.group(2)}",
            )
        )
    return found


ALL = [b for page in PAGES for b in blocks(page)]
RUN = [b for b in ALL if b.lang in ("python", "bash") and b.skip is None]


def commands(block: Block) -> list[list[str]]:
    """The CLI lines of a bash block as argv for this Python; any other line is refused, so a
    block a user cannot run as written must carry a marker."""
    argv = []
    for line in block.text.splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        if not _CLI.match(line):
            pytest.fail(f"{block.id}: cannot run {line!r} here; mark the block `not run: why`")
        rest = words[1:] if words[0] == "dbo-sim" else words[3:]
        argv.append([sys.executable, "-m", "scenarios", *rest])
    return argv


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    return subprocess.run(
        argv,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )


def test_every_page_has_blocks_that_run():
    assert len(RUN) >= 10  # the extraction found the pages' blocks


def test_every_skipped_block_says_why():
    unexplained = [b.id for b in ALL if b.skip is not None and not b.skip.split(":", 1)[1].strip()]
    assert unexplained == []


@pytest.mark.timeout(BLOCK_TIMEOUT_S * 6)
@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_the_block_runs_as_written(block, tmp_path):
    for name in ("examples", "tests"):  # what the commands name, relative to the root
        (tmp_path / name).symlink_to(ROOT / name)
    if block.lang == "python":
        script = tmp_path / "snippet.py"
        script.write_text(block.text, encoding="utf-8")
        runs = [[sys.executable, str(script)]]
    else:
        runs = commands(block)
    for argv in runs:
        done = _run(argv, tmp_path)
        shown = shlex.join(argv[2:])
        assert done.returncode == 0, f"{block.id}: {shown}\n{done.stdout}{done.stderr}"
