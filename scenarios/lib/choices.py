"""The names the verbs' parsers offer (hardware profiles, model presets, race orders, the
profiled configurations), as plain tuples, so that building a parser for `--help` imports
neither torch nor the simulator, whose registries hold the things themselves.

`tests/tools/test_choices.py` checks every tuple against its registry: a profile, preset or
race order added there fails until it is named here too.
"""

from __future__ import annotations

__all__ = [
    "CONFIG_NAMES",
    "DECODE_CONTEXT",
    "GPU_CHECK",
    "PREFILL_REQUESTS",
    "PRESET_NAMES",
    "PROFILE_NAMES",
    "RACE_ORDERS",
]

# dbo.sim.hardware.PROFILES, in its order (the order `--help` lists them in).
PROFILE_NAMES = ("h200", "h100", "h800", "b200")
# scenarios.model_presets.PRESETS, sorted.
PRESET_NAMES = ("deepseek-v3", "tiny")
# dbo.verification's `race_order`s: the step as issued, or also re-run with every race reversed.
RACE_ORDERS = ("issue", "adversarial")

# The configurations `dbo-sim profile` records (scenarios.lib.configs builds them).
GPU_CHECK = "gpu-check"  # the default configuration: gpu_check's model and batches
CONFIG_NAMES = (GPU_CHECK, *PRESET_NAMES)
PREFILL_REQUESTS = 4  # --tokens of prefill are split into this many equal prompts
DECODE_CONTEXT = 1024  # KV-cache tokens per decode request (gpu_check's decode batch)
