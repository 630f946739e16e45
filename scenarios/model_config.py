"""A model's shape and a step's requests: `ModelConfig` and `Batch`, and the check of a
user's configuration file (`config_changes`). `scenarios.model` re-exports them beside the
model; the presets are in `scenarios.model_presets`.

The module does not import torch (the dtypes are only annotations here), so that the CLI can
refuse a bad `--config` in a fraction of a second, before torch and the simulator load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["Batch", "DTYPE_FIELDS", "DTYPE_NAMES", "ModelConfig", "config_changes"]

# The sizes a model must have (at least 1), and those that are 0 when their option is off.
POSITIVE_SIZES = (
    "num_layers",
    "hidden",
    "num_heads",
    "head_dim",
    "num_experts",
    "top_k",
    "moe_inter",
    "ep_size",
)
OPTIONAL_SIZES = (
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_dim",
    "qk_rope_dim",
    "v_head_dim",
    "num_shared_experts",
    "num_dense_layers",
    "dense_inter",
)
BYTE_WIDTHS = ("dispatch_bytes_per_elem", "combine_bytes_per_elem")
NAMES = ("name", "attention", "tensor_device")
DTYPE_FIELDS = ("dtype", "weight_dtype")
# torch's names of the dtypes a configuration may give ("bfloat16", or "torch.bfloat16"): FP8
# only for the weights (the GEMM scales its inputs), never as the activations' dtype.
DTYPE_NAMES = ("float64", "float32", "bfloat16", "float16")
WEIGHT_DTYPE_NAMES = (*DTYPE_NAMES, "float8_e4m3fn", "float8_e5m2")
# Far above any real model, low enough that sizes multiplied together stay exact in a float.
MAX_SIZE = 1 << 20
# Counts a simulation repeats work for (a layer's ops, an expert's row in every routing table):
# far above real models (DeepSeek-V3: 61 layers, 256 experts, top-8), low enough to stay quick.
MAX_COUNT = {"num_layers": 1024, "num_dense_layers": 1023, "num_experts": 4096, "top_k": 64}


@dataclass(frozen=True)
class ModelConfig:
    name: str
    num_layers: int
    hidden: int
    num_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_inter: int
    ep_size: int
    dtype: torch.dtype
    tensor_device: str  # "cpu" (values) or "meta" (shapes only)
    dispatch_bytes_per_elem: float  # DeepEP sends FP8 on dispatch, BF16 on combine
    combine_bytes_per_elem: float
    # DeepSeek-style options; the defaults are a plain MHA + MoE stack (what "tiny" is).
    attention: str = "mha"  # "mha", or "mla" (multi-head latent attention, DeepSeek-V2/V3)
    q_lora_rank: int = 0  # MLA: q goes hidden -> q_lora_rank -> heads x (nope + rope)
    kv_lora_rank: int = 0  # MLA: the cached latent per token (plus one rope key)
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    num_shared_experts: int = 0  # always-on experts run on the rank's own tokens, no dispatch
    num_dense_layers: int = 0  # the first layers have a dense MLP instead of MoE (no comm)
    dense_inter: int = 0
    # Dtype of the linear layers' weights and GEMM inputs (FP8 for DeepSeek-V3's block-quantized
    # checkpoint); None: `dtype`. Only shapes-only (meta) runs use it.
    weight_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.attention not in ("mha", "mla"):
            raise ValueError(f"attention must be 'mha' or 'mla', got {self.attention!r}")
        if (
            self.attention == "mla"
            and min(self.kv_lora_rank, self.qk_nope_dim, self.qk_rope_dim, self.v_head_dim) <= 0
        ):
            raise ValueError(
                "attention='mla' needs positive kv_lora_rank, qk_nope_dim, qk_rope_dim and "
                "v_head_dim"
            )
        if self.tensor_device not in ("cpu", "meta", "cuda") and not self.tensor_device.startswith(
            "cuda:"
        ):
            raise ValueError(
                f"tensor_device must be 'cpu', 'meta' or 'cuda', got {self.tensor_device!r}"
            )
        self._check_sizes()

    def _check_sizes(self) -> None:
        for name in POSITIVE_SIZES + OPTIONAL_SIZES:
            low, high = _size_range(name)
            if not low <= getattr(self, name) <= high:
                raise ValueError(f"{name} must be in {low}..{high}, got {getattr(self, name)}")
        for name in BYTE_WIDTHS:
            if not 0 < getattr(self, name) <= 8:
                raise ValueError(f"{name} must be above 0 and at most 8, got {getattr(self, name)}")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k {self.top_k} is more than the {self.num_experts} experts (num_experts)"
            )
        if self.num_dense_layers >= self.num_layers:
            raise ValueError(
                f"num_dense_layers {self.num_dense_layers} leaves no MoE layer of the "
                f"{self.num_layers} (num_layers)"
            )

    @property
    def local_experts(self) -> int:
        """Experts held by one EP rank (the grouped GEMM reads all their weights)."""
        return max(1, self.num_experts // max(self.ep_size, 1))

    def with_(self, **changes: object) -> ModelConfig:
        return replace(self, **changes)


@dataclass(frozen=True)
class Batch:
    """The requests of one step. `query_start_loc[r]..[r+1]` are request r's new tokens;
    `context_lens[r]` tokens of request r are already in the KV cache (decode)."""

    query_start_loc: tuple[int, ...]
    context_lens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    @property
    def is_decode(self) -> bool:
        q = self.query_start_loc
        return all(q[r + 1] - q[r] == 1 for r in range(len(q) - 1))

    @staticmethod
    def decode(num_requests: int, context_len: int) -> Batch:
        return Batch(tuple(range(num_requests + 1)), (context_len,) * num_requests)

    @staticmethod
    def prefill(num_requests: int, prompt_len: int) -> Batch:
        return Batch(tuple(r * prompt_len for r in range(num_requests + 1)), (0,) * num_requests)


def config_changes(data: object) -> dict[str, object]:
    """A user's JSON object of `ModelConfig` fields, checked field by field (known name, right
    type, in range) without torch. Dtypes stay names (`model_presets.torch_dtypes` turns them
    into torch's). ValueError names the first field at fault and what it takes."""
    if not isinstance(data, dict):
        raise ValueError('expected a JSON object of ModelConfig fields, e.g. {"num_experts": 64}')
    known = [f.name for f in fields(ModelConfig)]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(
            f"unknown field(s) {', '.join(map(repr, unknown))}; ModelConfig's fields are "
            f"{', '.join(known)}"
        )
    for name, value in data.items():
        why = _field_problem(name, value)
        if why:
            raise ValueError(f"field {name!r}: {why}, got {value!r}")
    return dict(data)


def _size_range(name: str) -> tuple[int, int]:
    return (1 if name in POSITIVE_SIZES else 0), MAX_COUNT.get(name, MAX_SIZE)


def _field_problem(name: str, value: object) -> str | None:
    """What is wrong with `value` for the field `name` (None: nothing)."""
    if name in POSITIVE_SIZES or name in OPTIONAL_SIZES:
        low, high = _size_range(name)
        ok = isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
        return None if ok else f"give a whole number in {low}..{high}"
    if name in BYTE_WIDTHS:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        ok = ok and math.isfinite(value) and 0 < value <= 8
        return None if ok else "give bytes per element above 0 and at most 8 (1: FP8, 2: BF16)"
    if name in DTYPE_FIELDS:
        if value is None and name == "weight_dtype":
            return None
        names = WEIGHT_DTYPE_NAMES if name == "weight_dtype" else DTYPE_NAMES
        ok = isinstance(value, str) and value.removeprefix("torch.") in names
        return None if ok else f"give one of {', '.join(map(repr, names))}"
    if name == "attention":
        return None if value in ("mha", "mla") else "give 'mha' or 'mla'"
    if name == "tensor_device":
        return None if value in ("cpu", "meta", "cuda") else "give 'cpu', 'meta' or 'cuda'"
    ok = isinstance(value, str) and 0 < len(value) <= 100
    return None if ok else "give a non-empty string"
