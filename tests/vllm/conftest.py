"""tests/vllm/ compare dbo-sim with the installed vLLM 0.33 release (the differential oracle).

Without it every test here skips with one line saying how to install it."""

from __future__ import annotations

import importlib.metadata

import pytest

ORACLE_VERSION = "0.33.0"
ENABLE = "make vllm-oracle (pip install --no-deps -r .ci/vllm-oracle.txt)"


def _installed_version() -> str | None:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    version = _installed_version()
    if version == ORACLE_VERSION:
        return
    why = f"vLLM {ORACLE_VERSION} is not installed ({version or 'no vllm'}): {ENABLE}"
    for item in items:
        if "tests/vllm/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.skip(reason=why))
