"""docs/vllm-parity.md's table names every public name of vLLM 0.33's five DBO modules, no
more, and every dbo-sim counterpart it names exists: the page cannot drift from the release."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed: make vllm-oracle")

PAGE = Path(__file__).resolve().parents[2] / "docs" / "vllm-parity.md"
MODULES = {
    "ubatching": "vllm.v1.worker.ubatching",
    "workspace": "vllm.v1.worker.workspace",
    "ubatch_utils": "vllm.v1.worker.ubatch_utils",
    "gpu.ubatch_utils": "vllm.v1.worker.gpu.ubatch_utils",
    "gpu_ubatch_wrapper": "vllm.v1.worker.gpu_ubatch_wrapper",
}
ROW = re.compile(r"^\| ([\w.]+) \| `(\w+)` \| (`[\w.]+`|none) \|")


def public_names(module: str) -> set[str]:
    """Names the module's source defines at top level (classes, functions, assignments),
    public, less its logger and type variables."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    names = {n for n in names if not n.startswith("_") and n not in ("logger", "T")}
    loaded = importlib.import_module(module)
    return {n for n in names if hasattr(loaded, n)}


def table_rows() -> list[tuple[str, str, str]]:
    rows = []
    for line in PAGE.read_text().splitlines():
        match = ROW.match(line)
        if match and match.group(1) in MODULES:
            rows.append((match.group(1), match.group(2), match.group(3).strip("`")))
    return rows


def test_the_table_names_exactly_the_public_names_of_the_five_modules():
    documented = {(m, n) for m, n, _ in table_rows()}
    released = {(short, n) for short, full in MODULES.items() for n in public_names(full)}
    assert documented - released == set(), "rows for names vLLM 0.33 does not have"
    assert released - documented == set(), "vLLM 0.33 names the table leaves out"


def test_every_counterpart_the_table_names_exists():
    for _, name, counterpart in table_rows():
        if counterpart == "none":
            continue
        module_name, _, attribute = counterpart.rpartition(".")
        module = importlib.import_module(module_name)
        assert hasattr(module, attribute), f"{counterpart} (for vLLM's {name}) does not exist"
