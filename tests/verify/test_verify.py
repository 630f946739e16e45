"""dbo.verify on a user-written model (nothing from scenarios/): a correct forward passes, and
each planted fault fails with the field that names it set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dbo
from dbo.sim import SimDevice
from dbo.sim.options import SimOptions
from workspace import (
    current_workspace_manager,
    init_workspace_manager,
    is_workspace_manager_initialized,
    reset_workspace_manager,
)

HIDDEN = 16


class ToyMoE:
    """Two layers of attention-ish GEMM then a dispatch / expert / combine block, with the
    yields where vLLM's DeepEP high-throughput kernels put them (3 per layer)."""

    def __init__(self, fault: str | None = None, layers: int = 2) -> None:
        g = torch.Generator().manual_seed(0)
        self.layers = [
            (
                torch.randn(HIDDEN, HIDDEN, generator=g, dtype=torch.float64) / 4,
                torch.randn(HIDDEN, HIDDEN, generator=g, dtype=torch.float64) / 4,
            )
            for _ in range(layers)
        ]
        self.fault = fault
        self.shared = torch.zeros(64, HIDDEN, dtype=torch.float64)  # the planted shared buffer

    def scratch(self, rows: int) -> torch.Tensor:
        if self.fault == "shared_scratch":
            return self.shared[:rows]
        (buf,) = current_workspace_manager().get_simultaneous(((rows, HIDDEN), torch.float64))
        return buf

    def to_comm(self) -> None:
        if self.fault == "no_wait":
            dbo.dbo_yield()
            dbo.dbo_switch_to_comm()  # the bug: comm reads compute's output without waiting
        else:
            dbo.dbo_yield_and_switch_from_compute_to_comm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = dbo.current_device()
        if self.fault == "raise" and dbo.dbo_current_ubatch_id() == 1:
            raise ValueError("planted failure in ubatch 1")
        for w_attn, w_expert in self.layers:
            h = torch.tanh(x @ w_attn)
            recv = self.scratch(h.shape[0])
            self.to_comm()
            with device.comm_region("dispatch", nbytes=h.numel() * 8):
                recv.copy_(h)
            dbo.dbo_yield_and_switch_from_comm_to_compute()
            expert_out = recv @ w_expert
            out = torch.empty_like(expert_out)
            self.to_comm()
            with device.comm_region("combine", nbytes=out.numel() * 8):
                out.copy_(expert_out)
            dbo.dbo_switch_to_compute_sync()
            x = x + out
        if self.fault == "extra_yield" and dbo.dbo_current_ubatch_id() == 1:
            dbo.dbo_yield()
        return x


def inputs(rows: int = 8) -> torch.Tensor:
    return torch.randn(
        rows, HIDDEN, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )


@pytest.fixture(autouse=True)
def no_workspace():
    reset_workspace_manager()
    yield
    reset_workspace_manager()


@pytest.mark.timeout(30)
def test_correct_forward_is_ok_from_one_call():
    report = dbo.verify(ToyMoE().forward, inputs())
    assert report.ok, report.describe()
    assert report.outputs_match and report.max_abs_diff == 0.0
    assert not report.races and report.races.serial == report.races.ubatched == []
    assert report.error is None
    assert report.yield_counts == [6, 6]  # 3 per layer, 2 layers
    assert report.step_us_serial > 0 and report.step_us_dbo > 0
    assert report.speedup == report.step_us_serial / report.step_us_dbo
    report.raise_for_failure()  # no-op when ok


@pytest.mark.timeout(30)
def test_report_says_how_much_of_the_step_the_roofline_priced():
    # float32 matmuls on the CPU are not in the H200 kernel table: the roofline prices them.
    report = dbo.verify(ToyMoE().forward, inputs())
    assert report.roofline_fraction is not None and 0.0 < report.roofline_fraction <= 1.0
    assert "roofline-priced" in report.describe()
    assert report.to_dict()["roofline_fraction"] == report.roofline_fraction


@pytest.mark.timeout(30)
def test_switch_to_comm_without_waiting_is_a_race():
    report = dbo.verify(ToyMoE("no_wait").forward, inputs())
    assert not report.ok
    assert report.races["ubatched"] and not report.races["serial"]
    assert report.error is None
    assert "missing: stream 'comm' does not wait for stream 'compute'" in report.describe()


@pytest.mark.timeout(30)
def test_a_raise_in_one_ubatch_is_the_error():
    report = dbo.verify(ToyMoE("raise").forward, inputs())
    assert not report.ok and not report.outputs_match
    assert isinstance(report.error, dbo.UBatchError) and report.error.ubatch_id == 1
    assert report.max_abs_diff is None
    assert "planted failure in ubatch 1" in report.describe()


@pytest.mark.timeout(30)
def test_an_extra_yield_is_a_yield_mismatch():
    report = dbo.verify(ToyMoE("extra_yield").forward, inputs())
    assert not report.ok
    assert isinstance(report.error, dbo.YieldMismatchError)
    assert report.yield_counts is not None and report.yield_counts[1] > report.yield_counts[0]
    assert "YieldMismatchError" in report.describe()


@pytest.mark.timeout(30)
def test_a_scratch_buffer_shared_between_ubatches_is_a_race():
    report = dbo.verify(ToyMoE("shared_scratch").forward, inputs())
    assert not report.ok
    assert report.races["ubatched"]
    assert report.error is None


@pytest.mark.timeout(30)
def test_raise_for_failure_raises_verify_error_with_the_description():
    report = dbo.verify(ToyMoE("no_wait").forward, inputs())
    with pytest.raises(dbo.VerifyError) as caught:
        report.raise_for_failure()
    assert str(caught.value) == report.describe()
    assert caught.value.report is report


@pytest.mark.timeout(30)
def test_outputs_that_differ_beyond_tolerance_fail_and_within_it_pass():
    def forward(x: torch.Tensor) -> torch.Tensor:
        # A per-ubatch offset: DBO changes the result by 1e-6 in ubatch 1's rows.
        return x + (1e-6 if dbo.dbo_current_ubatch_id() == 1 else 0.0)

    strict = dbo.verify(forward, inputs())
    assert not strict.ok and not strict.outputs_match
    assert strict.max_abs_diff == pytest.approx(1e-6)
    assert "values differ" in strict.describe()
    assert dbo.verify(forward, inputs(), atol=1e-5).ok


@pytest.mark.timeout(30)
def test_default_split_cuts_dicts_and_tuples_along_dim_0():
    seen: list[int] = []

    def forward(batch: dict) -> tuple:
        seen.append(batch["x"].shape[0])
        return batch["x"] * 2, batch["y"] + 1

    report = dbo.verify(forward, {"x": inputs(10), "y": torch.arange(10)}, num_ubatches=3, warmup=0)
    assert report.ok, report.describe()
    assert seen[-3:] == [3, 3, 4]  # dbo.split's cut points: the last ubatch takes the rest


@pytest.mark.timeout(30)
def test_custom_split_and_merge_are_used():
    def split(batch, n):
        return [batch[i::n] for i in range(n)]  # interleaved rows

    def merge(outs):
        full = torch.empty(sum(o.shape[0] for o in outs), HIDDEN, dtype=torch.float64)
        for i, o in enumerate(outs):
            full[i :: len(outs)] = o
        return full

    report = dbo.verify(lambda x: x * 3, inputs(), split=split, merge=merge)
    assert report.ok, report.describe()


@pytest.mark.timeout(30)
def test_workspace_is_initialised_then_restored_when_none_was():
    dbo.verify(ToyMoE().forward, inputs())
    assert not is_workspace_manager_initialized()


@pytest.mark.timeout(30)
def test_an_initialised_workspace_is_used_and_left_as_it_was():
    manager = init_workspace_manager("cpu", 2)
    report = dbo.verify(ToyMoE().forward, inputs())
    assert report.ok, report.describe()
    assert current_workspace_manager() is manager
    assert not manager.is_locked()  # verify locks only a workspace it initialised itself


@pytest.mark.timeout(30)
def test_a_given_sim_device_is_used():
    device = SimDevice(SimOptions("h100"))
    report = dbo.verify(ToyMoE().forward, inputs(), device=device)
    assert report.ok
    assert report.records["ubatched"] == device.timeline


@pytest.mark.timeout(30)
def test_a_serial_forward_that_raises_propagates():
    def forward(x):
        raise KeyError("broken model")

    with pytest.raises(KeyError, match="broken model"):
        dbo.verify(forward, inputs())


@pytest.mark.timeout(30)
def test_a_stuck_ubatch_ends_in_a_timeout_error():
    import threading

    release = threading.Event()

    def forward(x):
        if dbo.dbo_current_ubatch_id() == 1:
            release.wait(5)  # stuck outside the dbo primitives
        return x

    try:
        report = dbo.verify(forward, inputs(), timeout=0.5, warmup=0)
    finally:
        release.set()
    assert isinstance(report.error, dbo.UBatchTimeoutError)
    assert not report.ok


@pytest.mark.timeout(30)
def test_artifacts_hold_a_trace_and_png_of_both_runs(tmp_path):
    report = dbo.verify(ToyMoE("no_wait").forward, inputs(), artifacts=tmp_path / "out")
    trace = json.loads(Path(report.trace).read_text())
    names = {
        e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert names == {"serial · rank 0", "DBO · rank 0"}
    assert any(e["ph"] == "i" and e["name"] == "race" for e in trace["traceEvents"])
    assert Path(report.timeline_png).read_bytes()[:4] == b"\x89PNG"
    assert str(tmp_path) in report.describe()


@pytest.mark.timeout(30)
def test_report_to_dict_is_json():
    report = dbo.verify(ToyMoE("raise").forward, inputs())
    data = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert data["ok"] is False and data["error_type"] == "UBatchError"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_ubatches": 1}, r"num_ubatches .* must be >= 2"),
        ({"num_ubatches": True}, r"num_ubatches .* must be an integer"),
        ({"warmup": -1}, r"warmup .* must be >= 0"),
        ({"atol": float("nan")}, "atol must be a finite number"),
        ({"rtol": -1.0}, "rtol must be a finite number"),
        ({"timeout": 0}, "timeout must be a positive number"),
        ({"device": "tpu"}, "device must be"),
        ({"split": 3}, "split must be callable"),
        ({"merge": "cat"}, "merge must be callable"),
        ({"artifacts": 5}, "artifacts must be a folder"),
    ],
)
def test_bad_arguments_are_refused_before_any_work(kwargs, message):
    calls = []
    with pytest.raises((TypeError, ValueError), match=message):
        dbo.verify(lambda x: calls.append(x) or x, inputs(), **kwargs)
    assert calls == []
    assert not is_workspace_manager_initialized()


def test_inputs_the_default_split_cannot_cut_are_refused_with_a_hint():
    with pytest.raises(TypeError, match="pass split="):
        dbo.verify(lambda x: x, "text")
    with pytest.raises(ValueError, match="same dim 0"):
        dbo.verify(lambda x: x, (torch.ones(4), torch.ones(5)))
    with pytest.raises(ValueError, match="fewer than num_ubatches"):
        dbo.verify(lambda x: x, torch.ones(1, 3))


def test_an_initialised_workspace_with_too_few_slots_is_refused():
    init_workspace_manager("cpu", 1)
    with pytest.raises(ValueError, match="1 slot"):
        dbo.verify(lambda x: x, inputs())


def test_a_split_returning_the_wrong_count_is_refused():
    with pytest.raises(ValueError, match="num_ubatches=2"):
        dbo.verify(lambda x: x, inputs(), split=lambda b, n: [b])


def test_forward_must_be_callable():
    with pytest.raises(TypeError, match="forward must be callable"):
        dbo.verify("model", inputs())
