"""Every verb's `--help`, a usage error argparse catches, and a malformed `--window` answer
without torch or the simulator: the parser of a verb is built from torch-free modules, the
work is imported by its `run` only."""

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


def _probe(script: str, *args: str) -> object:
    """What `script` printed as JSON, run in a fresh interpreter with `args` and HEAVY."""
    done = subprocess.run(
        [sys.executable, "-c", script, *args, ",".join(HEAVY)],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("verb", [v.name for v in VERBS])
def test_a_verbs_help_and_usage_errors_import_no_torch_and_no_simulator(verb):
    assert _probe(PROBE, verb) == {"--help": [], "usage error": []}


# Run one verb with a malformed `--window`; report its exit status, what it printed, and what
# of HEAVY was imported.
WINDOW_PROBE = """
import contextlib, io, json, sys
from scenarios.cli import main
verb, window, heavy = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
with contextlib.redirect_stderr(io.StringIO()) as err:
    status = main([verb, "--window", window])
print(json.dumps({"status": status, "stderr": err.getvalue(),
                  "imported": [m for m in heavy if m in sys.modules]}))
"""
MALFORMED_WINDOWS = {
    "5:1": "window end (1.0) must be after its start (5.0)",
    "layers=x": "window 'layers=x': expected START:END in microseconds (e.g. 100:400) or "
    "layers=A:B (e.g. layers=0:2)",
    "layers=2:1": "window 'layers=2:1': layers A:B needs 0 <= A < B",
    "nan:1": "window bounds must be finite, got nan:1.0",
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("window", MALFORMED_WINDOWS)
@pytest.mark.parametrize("verb", ["run", "verify"])
def test_a_malformed_window_is_refused_without_torch_or_the_simulator(verb, window):
    assert _probe(WINDOW_PROBE, verb, window) == {
        "status": 2,
        "stderr": f"dbo-sim: argument --window: {MALFORMED_WINDOWS[window]}\n",
        "imported": [],
    }
