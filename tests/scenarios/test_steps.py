"""The one step runner: serial and ubatched steps of the same model agree, a captured step
replays, and `prepare` leaves a warmed, locked workspace."""

from __future__ import annotations

import pytest
import torch

from dbo.sim import SimDevice
from dbo.split import split_batch
from dbo.streams import CudaDevice
from scenarios.harness import RunOptions, compare_serial_dbo
from scenarios.model import Batch, MoEModel, preset
from scenarios.steps import prepare, serial_step, ubatched_step
from workspace import current_workspace_manager, reset_workspace_manager

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _fresh_workspace():
    yield
    reset_workspace_manager()


def _model() -> MoEModel:
    return MoEModel(preset("tiny"), Batch.decode(16, 8))


def test_serial_and_ubatched_steps_give_the_same_output():
    model = _model()
    x = model.inputs()
    serial = serial_step(model, x, SimDevice(), mode="ll")
    prepare("cpu", 1, [serial])
    expected = serial.output()
    model = _model()  # a fresh KV cache
    ubatched = ubatched_step(model, x, SimDevice(), mode="ll", num_ubatches=2)
    prepare("cpu", 2, [ubatched])
    assert ubatched.num_ubatches == 2 and serial.num_ubatches == 1
    torch.testing.assert_close(ubatched.output(), expected, rtol=0, atol=1e-9)


def test_a_step_along_given_slices_runs_one_ubatch_per_slice():
    model = _model()
    slices = split_batch(model.batch.query_start_loc, model.batch.num_tokens, 3)
    step = ubatched_step(model, model.inputs(), SimDevice(), mode="ll", slices=slices)
    prepare("cpu", 3, [step])
    outs = step()
    assert [o.shape[0] for o in outs] == [s.num_tokens for s in slices]


@pytest.mark.parametrize("ubatches", [None, 2])
def test_a_captured_step_replays_its_ops(ubatches):
    model = _model()
    device = SimDevice()
    if ubatches is None:
        step = serial_step(model, model.inputs(), device, mode="ll")
    else:
        step = ubatched_step(model, model.inputs(), device, mode="ll", num_ubatches=ubatches)
    prepare("cpu", step.num_ubatches, [step])
    graph = device.graph()
    step.capture(graph)
    device.synchronize()
    device.reset()
    graph.replay()
    device.synchronize()
    assert len(device.timeline) > 0


def _replayed_streams(step, device, **capture) -> tuple[torch.Tensor, set[str]]:
    """Capture the prepared `step`, replay it once: its output and the streams it ran on."""
    graph = device.graph()
    output = step.capture(graph, **capture)
    device.synchronize()
    device.reset()
    graph.replay()
    device.synchronize()
    return output, {r.stream for r in device.timeline if r.kind == "compute"}


def test_a_serial_step_captures_on_the_current_stream_on_the_simulated_device():
    device = SimDevice()
    model = _model()
    step = serial_step(model, model.inputs(), device, mode="ll")
    prepare("cpu", 1, [step])
    _, streams = _replayed_streams(step, device)
    assert streams == {device.current_stream().name}


def test_a_serial_step_captured_on_a_side_stream_replays_there_with_the_eager_output():
    device = SimDevice()
    model = _model()
    step = serial_step(model, model.inputs(), device, mode="ll")
    prepare("cpu", 1, [step])
    expected = step.output()
    output, streams = _replayed_streams(step, device, side_stream=True)
    assert streams == {"capture"}
    torch.testing.assert_close(output, expected, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_serial_step_captures_from_the_default_stream():
    device = CudaDevice()
    model = MoEModel(preset("tiny").with_(tensor_device="cuda"), Batch.decode(16, 8))
    step = serial_step(model, model.inputs(), device, mode="ll")
    prepare(device.torch_device, 1, [step])
    expected = step.output()
    graph = device.graph()
    output = step.capture(graph)  # on the default stream, which CUDA cannot capture
    graph.replay()
    device.synchronize()
    torch.testing.assert_close(output, expected, rtol=0, atol=0)


def test_prepare_warms_every_step_then_locks_the_workspace():
    calls: list[str] = []
    prepare("cpu", 2, [lambda: calls.append("a"), lambda: calls.append("b")], rounds=2)
    assert calls == ["a", "b", "a", "b"]
    assert current_workspace_manager().is_locked()


def test_ubatched_step_needs_exactly_one_way_to_split():
    model = _model()
    with pytest.raises(ValueError, match="exactly one"):
        ubatched_step(model, model.inputs(), SimDevice(), mode="ll")


def test_a_graph_replayed_comparison_matches_the_eager_one_and_issues_nothing_on_the_host():
    eager = compare_serial_dbo("t", preset("tiny"), Batch.decode(16, 8), "ll", RunOptions())
    replayed = compare_serial_dbo(
        "t", preset("tiny"), Batch.decode(16, 8), "ll", RunOptions(), graph=True
    )
    assert replayed.outputs_match and replayed.max_abs_diff == 0.0
    torch.testing.assert_close(replayed.dbo.output, eager.dbo.output, rtol=0, atol=0)
    # Replay launches the whole graph at once: the tiny, launch-bound step gets faster.
    assert replayed.serial.step_us < eager.serial.step_us
    assert replayed.dbo.step_us < eager.dbo.step_us


def test_a_serial_step_past_its_timeout_raises_between_layers():
    model = _model()
    serial = serial_step(model, model.inputs(), SimDevice(), mode="ll", timeout_s=1e-9)
    reset_workspace_manager()
    with pytest.raises(TimeoutError, match=r"ran past its 1e-09 s timeout after \d+ of 3 layers"):
        serial()


def test_a_serial_step_without_a_timeout_runs_to_the_end():
    model = _model()
    serial = serial_step(model, model.inputs(), SimDevice(), mode="ll")
    prepare("cpu", 1, [serial])
    assert serial.timeout_s is None and serial.output().shape == model.inputs().shape
