"""The CUDA facade: torch's and vLLM's stream and event calls answered by a SimDevice, and
every patched name put back exactly."""

from __future__ import annotations

import threading

import pytest
import torch

from dbo.sim import SimDevice, cuda_facade
from dbo.sim.cuda_facade import facade_active
from dbo.sim.handles import SimEvent, SimStream

PATCHED = [
    (torch.cuda, "Stream"),
    (torch.cuda, "Event"),
    (torch, "Event"),
    (torch.cuda, "set_stream"),
    (torch.cuda, "current_stream"),
    (torch.cuda, "stream"),
    (torch.accelerator, "set_device_index"),
    (torch.accelerator, "empty_cache"),
    (torch.accelerator, "current_device_index"),
]


@pytest.fixture(scope="module")
def vllm_torch_utils():
    import vllm.v1.worker.ubatching  # noqa: F401 - its current_stream binding is patched too
    from vllm.utils import torch_utils

    return torch_utils


def test_streams_and_events_made_inside_are_the_devices():
    device = SimDevice()
    with cuda_facade(device):
        stream, event = torch.cuda.Stream(device="cuda:0"), torch.Event()
        assert isinstance(stream, SimStream) and stream.device is device
        assert isinstance(event, SimEvent) and isinstance(stream, torch.cuda.Stream)
        assert isinstance(torch.cuda.Event(enable_timing=True), torch.Event)


def test_set_stream_and_the_stream_context_move_the_threads_current_stream(vllm_torch_utils):
    device = SimDevice()
    with cuda_facade(device):
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            assert vllm_torch_utils.current_stream() is side
            assert device.current_stream() is side
        assert torch.cuda.current_stream() is device.default_stream()
        torch.cuda.set_stream(side)
        assert device.current_stream() is side


def test_every_patched_name_is_put_back_exactly(vllm_torch_utils):
    originals = [getattr(owner, name) for owner, name in PATCHED]
    vllm_current = vllm_torch_utils.current_stream
    with cuda_facade(SimDevice()):
        pass
    assert [getattr(owner, name) for owner, name in PATCHED] == originals
    assert vllm_torch_utils.current_stream is vllm_current
    assert facade_active() is None


def test_nested_entries_keep_the_facade_until_the_outermost_exit():
    device = SimDevice()
    original = torch.cuda.Stream
    with cuda_facade(device):
        with cuda_facade(device):
            pass
        assert torch.cuda.Stream is not original
    assert torch.cuda.Stream is original


def test_a_second_device_is_refused_while_one_is_active():
    with cuda_facade(SimDevice()):
        with pytest.raises(RuntimeError, match="already answers for"):
            with cuda_facade(SimDevice()):
                pass


@pytest.mark.timeout(30)
def test_threads_entering_and_leaving_in_any_order_restore_torch():
    device, original = SimDevice(), torch.cuda.Stream
    inside, leave = threading.Barrier(4), threading.Event()

    def hold():
        with cuda_facade(device):
            inside.wait()
            leave.wait(10)

    threads = [threading.Thread(target=hold) for _ in range(3)]
    for t in threads:
        t.start()
    inside.wait()
    assert torch.cuda.Stream is not original
    leave.set()
    for t in threads:
        t.join()
    assert torch.cuda.Stream is original
