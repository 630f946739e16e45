"""`SimOptions`: the one record a simulated device is built from, checked once, frozen."""

from __future__ import annotations

import dataclasses

import pytest

from dbo.sim import H800, EngineKnobs, ProfileOverrides, SimDevice, SimOptions


@pytest.mark.parametrize(
    ("options", "field"),
    [
        (lambda: SimOptions(rank=-1), "rank"),
        (lambda: SimOptions(race_action="ignore"), "race_action"),
        (lambda: SimOptions(tensor_device="cuda"), "tensor_device"),
        (lambda: SimOptions(profile="a100"), "hardware profile"),
        (lambda: SimOptions(overrides=ProfileOverrides(launch_us=-1.0)), "overrides.launch_us"),
        (lambda: SimOptions(engine=EngineKnobs(dbo_gemm_sms=0)), "dbo_gemm_sms"),
        (lambda: SimOptions(engine=EngineKnobs(ht_rdma_share=0.0)), "ht_rdma_share"),
        (lambda: SimOptions(engine=EngineKnobs(ht_nvl_share=float("inf"))), "ht_nvl_share"),
    ],
)
def test_a_bad_option_is_refused_when_the_record_is_built_naming_its_field(options, field):
    with pytest.raises((ValueError, TypeError), match=field):
        options()


def test_the_gemm_sm_cap_is_checked_against_the_overridden_profile() -> None:
    with pytest.raises(ValueError, match=r"dbo_gemm_sms must be in \(0, 132\]"):
        SimOptions("h800", engine=EngineKnobs(dbo_gemm_sms=H800.num_sms + 1))


def test_options_are_frozen() -> None:
    options = SimOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.__setattr__("rank", 3)


def test_the_overrides_replace_only_the_figures_they_set() -> None:
    device = SimDevice(SimOptions("h800", overrides=ProfileOverrides(launch_us=7.0)))
    assert device.profile.launch_us == 7.0
    assert device.profile.handoff_us == H800.handoff_us
    assert device.options.hardware() == device.profile


def test_the_engine_knobs_reach_the_device() -> None:
    knobs = EngineKnobs(dbo_gemm_sms=100, ht_rdma_share=0.5)
    device = SimDevice(SimOptions("h800", engine=knobs))
    assert (device.dbo_gemm_sms, device.ht_rdma_share) == (100, 0.5)


def test_a_device_without_options_is_the_default_record() -> None:
    assert SimDevice().options == SimOptions()
