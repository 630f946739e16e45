"""The parsers' torch-free names match the registries they name."""

from __future__ import annotations

from dbo.sim.hardware import PROFILES
from dbo.verification.arguments import RACE_ORDERS
from scenarios.lib import choices
from scenarios.lib.configs import config_names
from scenarios.model_presets import PRESETS


def test_the_profile_names_are_the_simulators_profiles_in_order():
    assert choices.PROFILE_NAMES == tuple(PROFILES)


def test_the_preset_names_are_the_model_presets():
    assert choices.PRESET_NAMES == tuple(sorted(PRESETS))


def test_the_race_orders_are_the_ones_verify_accepts():
    assert choices.RACE_ORDERS == RACE_ORDERS


def test_the_config_names_are_the_ones_profile_can_record():
    assert choices.CONFIG_NAMES == tuple(config_names())
