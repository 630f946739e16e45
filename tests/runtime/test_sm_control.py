"""SM control (vLLM 0.33's SMControlContextManager): while ubatches overlap, comm kernels run
on the reserved SMs and a ubatch's GEMMs on the rest; on exit every SM serves both again."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dbo.sim import COMM, H200, SimDevice, SimOptions
from dbo.sim.state import PlannedOp
from dbo.sm_control import (
    DEFAULT_DBO_COMM_SMS,
    SMControlContextManager,
    create_sm_control_context,
    env_comm_sms,
)
from dbo.split import DBOConfig

ROUND = replace(H200, name="round", num_sms=100, launch_us=1.0)


def _gemm_us(device: SimDevice) -> float:
    with device.thread_scope(0):  # a ubatch's GEMM: what the compute SMs run
        op = PlannedOp("aten::mm", 10.0, track=device.Stream("compute").track)
        return device.place_op(op).dur_us


def _comm_share(device: SimDevice) -> float:
    with device.thread_scope(0):
        device.set_stream(device.Stream("comm"))
        with device.comm_region("dispatch", nbytes=1_000_000, ep_size=8):
            torch.ones(4).clone()
    (op,) = [r for r in device.timeline if r.kind == COMM]
    return op.args["sm_share"]


def test_inside_the_context_a_ubatchs_gemm_runs_on_the_compute_sms_only():
    device = SimDevice(SimOptions(ROUND))
    with create_sm_control_context(DBOConfig(), device=device, comm_sms=20):
        assert _gemm_us(device) == pytest.approx(10.0 * 100 / 80)


def test_inside_the_context_comm_kernels_hold_the_reserved_share():
    device = SimDevice(SimOptions(ROUND))
    with create_sm_control_context(DBOConfig(), device=device, comm_sms=20):
        assert _comm_share(device) == pytest.approx(0.2)


def test_on_exit_the_device_prices_as_before():
    device = SimDevice(SimOptions(ROUND))
    before = (device.profile.comm_sms, device.dbo_gemm_sms)
    with create_sm_control_context(DBOConfig(), device=device, comm_sms=20):
        pass
    assert (device.profile.comm_sms, device.dbo_gemm_sms) == before
    assert _gemm_us(device) == pytest.approx(10.0)


def test_zero_comm_sms_reserves_nothing():
    device = SimDevice(SimOptions(ROUND))
    with create_sm_control_context(DBOConfig(), device=device, comm_sms=0):
        assert device.dbo_gemm_sms is None and _gemm_us(device) == pytest.approx(10.0)


def test_the_manager_calls_the_setters_as_vllms_does():
    calls = []
    manager = SMControlContextManager(
        20,
        lambda n: calls.append(("comm", n)),
        lambda n: calls.append(("compute", n)),
        device=SimDevice(SimOptions(ROUND)),
    )
    with manager:
        pass
    assert calls == [("comm", 20), ("compute", 80), ("comm", 100), ("compute", 100)]


def test_comm_sms_at_or_above_the_device_sms_is_refused():
    with pytest.raises(ValueError, match=r"comm_sms must be in \[0, 100\)"):
        create_sm_control_context(DBOConfig(), device=SimDevice(SimOptions(ROUND)), comm_sms=100)


def test_the_comm_sm_count_comes_from_vllm_dbo_comm_sms(monkeypatch):
    monkeypatch.setenv("VLLM_DBO_COMM_SMS", "12")
    assert (
        create_sm_control_context(DBOConfig(), device=SimDevice(SimOptions(ROUND))).comm_sms == 12
    )


def test_vllm_dbo_comm_sms_defaults_to_vllms_default(monkeypatch):
    monkeypatch.delenv("VLLM_DBO_COMM_SMS", raising=False)
    assert env_comm_sms() == DEFAULT_DBO_COMM_SMS == 20


def test_a_non_integer_vllm_dbo_comm_sms_is_refused(monkeypatch):
    monkeypatch.setenv("VLLM_DBO_COMM_SMS", "lots")
    with pytest.raises(ValueError, match="VLLM_DBO_COMM_SMS must be an integer, got 'lots'"):
        env_comm_sms()


def test_the_default_agrees_with_vllms(monkeypatch):
    envs = pytest.importorskip("vllm.envs", reason="vLLM 0.33 not installed")
    monkeypatch.delenv("VLLM_DBO_COMM_SMS", raising=False)
    assert envs.VLLM_DBO_COMM_SMS == DEFAULT_DBO_COMM_SMS
