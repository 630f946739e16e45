"""The sweep's default points, its limits and the check of the points asked for, torch-free:
what `dbo-sim sweep`'s parser offers and checks before any work, and what its work
(`scenarios.tools.sweep_run`) runs by default.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "DECODE_CONTEXT",
    "DECODE_TOKENS",
    "FULL_LAYERS",
    "MAX_CONTEXT",
    "MAX_TOKENS_PER_DEVICE",
    "PREFILL_PROMPT",
    "PREFILL_TOKENS",
    "check_points",
]

DECODE_TOKENS = (16, 32, 64, 128, 256, 512)
PREFILL_TOKENS = (1024, 2048, 4096, 8192, 16384)
DECODE_CONTEXT = 2048  # tokens in each decode request's KV cache, as in dsv3-decode-ll
PREFILL_PROMPT = 4096  # tokens per prefill prompt, as in SGLang's prefill benchmark
# Far above any engine's per-device batch and context, and small enough that a point's
# host-side metadata (a token-to-request map, the KV offsets) fits in memory.
MAX_TOKENS_PER_DEVICE = 1 << 18
MAX_CONTEXT = 1 << 20
FULL_LAYERS = 61  # DeepSeek-V3's


def check_points(
    decode_tokens: Iterable[int], prefill_tokens: Iterable[int], num_ubatches: int
) -> str | None:
    """Why these token counts cannot be swept with `num_ubatches` ubatches (None: they can).
    Every ubatch needs at least one real token, so no count may be below the ubatch count."""
    for flag, counts in (("--decode", decode_tokens), ("--prefill", prefill_tokens)):
        small = sorted({t for t in counts if t < num_ubatches})
        if small:
            listed = ", ".join(map(str, small))
            return (
                f"{flag} {listed}: fewer tokens per device than the {num_ubatches} ubatches "
                f"(each ubatch needs at least one); choose counts >= {num_ubatches}"
            )
    return None
