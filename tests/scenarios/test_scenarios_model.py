"""The MoE workload's dbo_* calls sit where vLLM's DeepEP back ends put them.

High-throughput ("ht"): 3 yields per MoE layer, dispatch and combine on the comm stream, no
recv hook. Low-latency ("ll"): 2 yields per layer, each after a recv hook registered for the
next ubatch, every transfer issued from the compute stream.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import pytest

import dbo
from dbo.sim import SimDevice, SimOptions
from dbo.split import split_batch
from scenarios.model import Batch, MoEModel, preset
from scenarios.steps import prepare, serial_step
from workspace import init_workspace_manager, reset_workspace_manager

pytestmark = pytest.mark.timeout(60)

_YIELDING = (
    "dbo_yield",
    "dbo_yield_and_switch_from_compute_to_comm",
    "dbo_yield_and_switch_from_comm_to_compute",
)


def _count_dbo_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, collections.Counter]:
    """Count, per ubatch, the yields and recv-hook registrations the model makes (it calls
    them as `dbo.<name>`); only calls from ubatch threads are counted."""
    counts = {"yields": collections.Counter(), "recv_hooks": collections.Counter()}
    lock = threading.Lock()

    def counting(name: str, kind: str) -> None:
        inner = getattr(dbo, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if dbo.dbo_enabled():
                with lock:
                    counts[kind][dbo.dbo_current_ubatch_id()] += 1
            return inner(*args, **kwargs)

        monkeypatch.setattr(dbo, name, wrapper)

    for name in _YIELDING:
        counting(name, "yields")
    counting("dbo_register_recv_hook", "recv_hooks")
    return counts


@pytest.fixture(autouse=True)
def _workspace():
    reset_workspace_manager()
    yield
    reset_workspace_manager()


def _ubatched_step(mode: str, batch: Batch) -> tuple[MoEModel, SimDevice]:
    """One step of the tiny model in 2 ubatches on a fresh simulated device."""
    model = MoEModel(preset("tiny"), batch)
    device = SimDevice()
    init_workspace_manager(device.torch_device, 2)
    x = model.inputs()
    slices = split_batch(batch.query_start_loc, batch.num_tokens, 2)
    dbo.run_ubatches(
        lambda s: model.forward(x[s.token_slice], s, mode=mode), slices, device=device, timeout=30
    )
    return model, device


def test_high_throughput_layer_yields_three_times_and_sends_on_the_comm_stream(monkeypatch):
    counts = _count_dbo_calls(monkeypatch)
    model, device = _ubatched_step("ht", Batch.prefill(num_requests=2, prompt_len=16))
    layers = model.config.num_layers
    assert counts["yields"] == {0: 3 * layers, 1: 3 * layers}
    assert not counts["recv_hooks"]
    transfers = [
        r
        for r in device.timeline
        if r.kind == "comm" and r.name in ("comm::dispatch", "comm::combine")
    ]
    assert len(transfers) == 2 * 2 * layers  # dispatch and combine, per ubatch, per layer
    assert {r.stream for r in transfers} == {"comm"}


def test_low_latency_layer_yields_twice_after_recv_hooks_and_stays_on_the_compute_stream(
    monkeypatch,
):
    counts = _count_dbo_calls(monkeypatch)
    model, device = _ubatched_step("ll", Batch.decode(num_requests=16, context_len=8))
    layers = model.config.num_layers
    assert counts["yields"] == {0: 2 * layers, 1: 2 * layers}
    assert counts["recv_hooks"] == {0: 2 * layers, 1: 2 * layers}
    sends = [r for r in device.timeline if r.name in ("comm::dispatch.send", "comm::combine.send")]
    assert len(sends) == 2 * 2 * layers  # dispatch and combine, per ubatch, per layer
    # Issued from the compute stream; the transfers themselves run on the link, never on a
    # comm stream.
    assert {r.stream for r in sends} == {"compute"}
    assert "comm" not in {r.stream for r in device.timeline}


def _expert_ops(mode: str) -> collections.Counter:
    """The ops a DeepSeek-V3 (FP8 experts, shapes only) MoE layer runs between its dispatch
    and its combine, one serial prefill step."""
    config = preset("deepseek-v3", ep_size=32, num_layers=2, num_dense_layers=1)
    model = MoEModel(config.with_(tensor_device="meta"), Batch.prefill(1, 256))
    device = SimDevice(SimOptions(profile="h100", tensor_device="meta"))
    step = serial_step(model, model.inputs(), device, mode=mode)
    prepare(device.torch_device, step.num_ubatches, [step])
    device.synchronize()
    device.reset()
    step()
    device.synchronize()
    names = [r.name for r in device.timeline]
    first = max(i for i, n in enumerate(names) if n.startswith("comm::dispatch"))
    last = max(i for i, n in enumerate(names) if n.startswith("comm::combine"))
    return collections.Counter(names[first + 1 : last])


def test_normal_kernels_rows_are_permuted_into_the_expert_layout_and_gathered_back():
    # DeepEP's normal kernels deliver rows per token: SGLang scatters them into DeepGEMM's
    # expert-contiguous layout and gathers the down GEMM's rows back; the low-latency kernels
    # deliver and combine the expert layout themselves.
    ht, ll = _expert_ops("ht"), _expert_ops("ll")
    assert ht["aten::bmm"] == ll["aten::bmm"] == 2
    assert ht["aten::copy_"] == 2 and ll["aten::copy_"] == 0
