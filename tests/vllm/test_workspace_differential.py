"""workspace against vLLM 0.33's `vllm/v1/worker/workspace.py` on random requests: the views
each call returns (shape, dtype, offset in the slot), growth to the largest request, and the
errors once locked."""

from __future__ import annotations

import random

import pytest
import torch

import workspace
from dbo.sim import SimDevice, cuda_facade

vllm_workspace = pytest.importorskip(
    "vllm.v1.worker.workspace", reason="vLLM 0.33 is not installed: make vllm-oracle"
)
DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.uint8)


def random_request(rng: random.Random) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [
        (tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 3))), rng.choice(DTYPES))
        for _ in range(rng.randint(1, 4))
    ]


def layout(views: list[torch.Tensor]) -> list[tuple]:
    base = views[0].untyped_storage().data_ptr()
    return [(tuple(v.shape), v.dtype, v.data_ptr() - base, v.is_contiguous()) for v in views]


@pytest.fixture(autouse=True)
def _facade():
    """vLLM's growth calls torch.accelerator.empty_cache(), which the facade answers."""
    with cuda_facade(SimDevice()):
        yield


def test_views_and_growth_agree_with_vllms_on_random_requests():
    rng = random.Random(0)
    ours = workspace.WorkspaceManager("cpu", num_ubatches=1)
    theirs = vllm_workspace.WorkspaceManager(torch.device("cpu"), num_ubatches=1)
    for _ in range(100):
        request = random_request(rng)
        assert layout(ours.get_simultaneous(*request)) == layout(
            theirs.get_simultaneous(*request)
        ), request


def test_a_locked_workspace_refuses_growth_and_new_keys_as_vllms_does():
    ours = workspace.WorkspaceManager("cpu", num_ubatches=1)
    theirs = vllm_workspace.WorkspaceManager(torch.device("cpu"), num_ubatches=1)
    for manager in (ours, theirs):
        manager.get_simultaneous(((16,), torch.float32))
        manager.get_persistent("warm", (4,), torch.float32)
        manager.lock()
        assert manager.is_locked()
        manager.get_simultaneous(((8,), torch.float32))  # fits: no growth
        assert manager.get_persistent("warm", (4,), torch.float32).shape == (4,)
        with pytest.raises(AssertionError):
            manager.get_simultaneous(((1024,), torch.float32))
        with pytest.raises(AssertionError):
            manager.get_persistent("new", (4,), torch.float32)
        manager.unlock()
        assert len(manager.get_simultaneous(((1024,), torch.float32))) == 1


def test_a_persistent_tensor_of_another_shape_is_refused_as_vllms_is():
    for manager in (
        workspace.WorkspaceManager("cpu", num_ubatches=1),
        vllm_workspace.WorkspaceManager(torch.device("cpu"), num_ubatches=1),
    ):
        manager.get_persistent("k", (4,), torch.float32)
        with pytest.raises(ValueError):
            manager.get_persistent("k", (5,), torch.float32)
