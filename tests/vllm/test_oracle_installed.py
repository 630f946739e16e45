"""The oracle itself: the five DBO modules of the installed vLLM 0.33 import on a CPU machine."""

from __future__ import annotations

import importlib

import pytest

DBO_MODULES = (
    "vllm.v1.worker.ubatching",
    "vllm.v1.worker.workspace",
    "vllm.v1.worker.ubatch_utils",
    "vllm.v1.worker.gpu.ubatch_utils",
    "vllm.v1.worker.gpu_ubatch_wrapper",
)


@pytest.mark.parametrize("name", DBO_MODULES)
def test_each_vllm_dbo_module_imports_without_vllms_compiled_ops(name):
    module = importlib.import_module(name)
    assert module.__name__ == name
