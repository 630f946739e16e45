"""`scenarios.index`, what `dbo-sim list` shows, is the registered scenarios, row for row."""

from __future__ import annotations

import subprocess
import sys

import pytest

from scenarios.catalog import DEFAULT_SCENARIOS, SCENARIOS
from scenarios.index import LISTED, Listed


def test_the_listed_table_is_the_registry_in_its_order():
    registered = [
        Listed(name, s.negative, name in DEFAULT_SCENARIOS, s.cuda, s.summary)
        for name, s in SCENARIOS.items()
    ]
    assert list(LISTED) == registered


@pytest.mark.timeout(60)
def test_listing_the_scenarios_imports_no_torch():
    code = (
        "import sys; from scenarios.cli import main; main(['list']); "
        "print('torch' in sys.modules, file=sys.stderr)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stderr.strip() == "False"
