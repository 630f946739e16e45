"""dbo.split's V2 input slicing and output merging against vLLM 0.33's, on random inputs."""

from __future__ import annotations

import random

import pytest
import torch

from dbo.split import DBOConfig, get_num_ubatches, merge_ubatch_outputs, slice_model_inputs

v2 = pytest.importorskip(
    "vllm.v1.worker.gpu.ubatch_utils", reason="vLLM 0.33 is not installed: make vllm-oracle"
)
v1 = pytest.importorskip("vllm.v1.worker.ubatch_utils")
sequence = pytest.importorskip("vllm.sequence")


def random_inputs(rng: random.Random, tokens: int) -> dict:
    g = torch.Generator().manual_seed(rng.randrange(1000))
    positions = torch.arange(tokens)
    if rng.random() < 0.5:
        positions = torch.stack([positions, positions + 1, positions + 2])  # M-RoPE
    return {
        "input_ids": torch.randint(0, 100, (tokens,), generator=g),
        "inputs_embeds": None if rng.random() < 0.5 else torch.randn(tokens, 4, generator=g),
        "positions": positions,
        "intermediate_tensors": sequence.IntermediateTensors(
            {"hidden_states": torch.randn(tokens, 4, generator=g)}
        ),
        "kv_caches": "passed on",
    }


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, sequence.IntermediateTensors):
        return a.tensors.keys() == b.tensors.keys() and all(
            torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors
        )
    return a == b


def test_slice_model_inputs_agrees_with_vllms():
    rng = random.Random(0)
    for _ in range(50):
        tokens = rng.randint(2, 40)
        inputs = random_inputs(rng, tokens)
        start = rng.randrange(tokens)
        token_slice = slice(start, rng.randint(start + 1, tokens))
        ours, theirs = (
            slice_model_inputs(inputs, token_slice),
            v2.slice_model_inputs(inputs, token_slice),
        )
        assert ours.keys() == theirs.keys()
        assert all(same(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("kind", ["tensor", "tuple", "intermediate"])
def test_merge_ubatch_outputs_agrees_with_vllms(kind):
    g = torch.Generator().manual_seed(1)
    parts = [torch.randn(n, 4, generator=g) for n in (3, 5, 2)]
    if kind == "tuple":
        parts = [(p, p * 2) for p in parts]
    if kind == "intermediate":
        parts = [sequence.IntermediateTensors({"hidden_states": p, "residual": -p}) for p in parts]
    ours, theirs = merge_ubatch_outputs(parts), v2.merge_ubatch_outputs(parts)
    assert type(ours) is type(theirs)
    if kind == "tuple":
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    else:
        assert same(ours, theirs)


def test_get_num_ubatches_agrees_with_vllms():
    for config in (DBOConfig(num_ubatches=3), DBOConfig(use_ubatching=False)):
        assert get_num_ubatches(config) == v1.get_num_ubatches(config)
