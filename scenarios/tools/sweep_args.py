"""The sweep's default points and its limits, torch-free: what `dbo-sim sweep`'s parser offers
and what its work (`scenarios.tools.sweep_run`) runs by default.
"""

from __future__ import annotations

__all__ = [
    "DECODE_CONTEXT",
    "DECODE_TOKENS",
    "FULL_LAYERS",
    "MAX_CONTEXT",
    "MAX_TOKENS_PER_DEVICE",
    "PREFILL_PROMPT",
    "PREFILL_TOKENS",
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
