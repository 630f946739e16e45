"""Every verb's `--help`, and a usage error argparse catches, answer without torch or the
simulator: the parser of a verb is built from torch-free modules, the work is imported by
its `run` only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scenarios.cli import VERBS

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "dbo.sim")

# Build one verb's parser, ask for its help, then give it an option it does not have; after
# each, name what of HEAVY was imported.
PROBE = """
import contextlib, io, json, sys
from scenarios.cli import build_parser
verb, heavy, found = sys.argv[1], sys.argv[2].split(","), {}
parser = build_parser([verb])
for step, argv in (("--help", [verb, "--help"]), ("usage error", [verb, "--no-such-option"])):
    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
        with contextlib.redirect_stderr(io.StringIO()):
            parser.parse_args(argv)
    found[step] = [m for m in heavy if m in sys.modules]
print(json.dumps(found))
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("verb", [v.name for v in VERBS])
def test_a_verbs_help_and_usage_errors_import_no_torch_and_no_simulator(verb):
    done = subprocess.run(
        [sys.executable, "-c", PROBE, verb, ",".join(HEAVY)],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"--help": [], "usage error": []}
