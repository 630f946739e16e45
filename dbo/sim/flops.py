"""FLOP and byte counts of one op: torch.utils.flop_counter's registered formulas, with the
causal share of fused attention and the grouped GEMM torch does not count, and the input bytes
an op reads through an alias of another input (so the roofline does not count them twice).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

__all__ = ["aliased_input_bytes", "flop_formula", "op_flops"]

_aten = torch.ops.aten
# Fused attention kernels: torch's formula counts the full q x k square even when causal.
_ATTENTION = {
    getattr(_aten, name)
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(_aten, name)
}


def _causal_share(s_q: int, s_k: int) -> float:
    """Share of the q x k score matrix a causal kernel computes, the queries being the last
    s_q of the s_k keys (an engine's convention: new tokens attend to everything before)."""
    if s_q <= 0 or s_k <= 0:
        return 0.0
    if s_q <= s_k:
        pairs = s_q * (s_k - s_q) + s_q * (s_q + 1) / 2
    else:  # more queries than keys: the first ones see nothing
        pairs = sum(max(0, min(s_k, s_k - s_q + i + 1)) for i in range(s_q))
    return pairs / (s_q * s_k)


def _attention_flops(
    base: Callable[..., int], causal_at: int, *args: Any, out_val: Any = None, **kwargs: Any
) -> float:
    flops = base(*args, out_val=out_val, **kwargs)
    causal = args[causal_at] if len(args) > causal_at else kwargs.get("is_causal", False)
    if causal:
        flops *= _causal_share(args[0].shape[-2], args[1].shape[-2])
    return flops


def _grouped_mm_flops(
    mat_a: torch.Tensor, mat_b: torch.Tensor, *args: Any, out_val: Any = None, **kwargs: Any
) -> float:
    """torch._grouped_mm: each output element is one dot product over the contraction dim
    (a's last dim, except for the 2-D x 2-D form, where groups split the contraction dim and
    each of the G outputs covers a share of it)."""
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        return 2.0 * mat_a.shape[0] * mat_a.shape[1] * mat_b.shape[1]
    out = out_val if isinstance(out_val, torch.Tensor) else None
    n_out = out.numel() if out is not None else mat_a.shape[-2] * mat_b.shape[-1]
    return 2.0 * n_out * mat_a.shape[-1]


_EXTRA_FORMULAS: dict[Any, Callable[..., float]] = {}
if hasattr(_aten, "_grouped_mm"):
    _EXTRA_FORMULAS[_aten._grouped_mm] = _grouped_mm_flops


def flop_formula(func: Any) -> Callable[..., float] | None:
    """The FLOP formula of an op overload (keyed by its packet), or None: torch's registered
    one, made causal-aware for fused attention, plus torch._grouped_mm, which torch lacks."""
    packet = getattr(func, "overloadpacket", func)
    if packet in _EXTRA_FORMULAS:
        return _EXTRA_FORMULAS[packet]
    base = flop_registry.get(packet)
    if base is not None and packet in _ATTENTION:
        names = [a.name for a in func._schema.arguments] if hasattr(func, "_schema") else []
        if "is_causal" in names:
            return functools.partial(_attention_flops, base, names.index("is_causal"))
    return base


def aliased_input_bytes(func: Any, ins: list[torch.Tensor]) -> int:
    """Bytes a kernel's input list counts twice: a fused attention whose V is a view of K's
    own bytes (MLA's latent cache serves as both) streams those bytes once. V in the same
    storage but elsewhere (an MHA cache holding K and V side by side) is read in full."""
    if getattr(func, "overloadpacket", func) not in _ATTENTION or len(ins) < 3:
        return 0
    k, v = ins[1], ins[2]
    try:
        if v.untyped_storage()._cdata != k.untyped_storage()._cdata:
            return 0
    except (RuntimeError, NotImplementedError):  # a tensor without a storage (subclass)
        return 0
    k_lo, k_hi = _element_span(k)
    v_lo, v_hi = _element_span(v)
    if v.element_size() != k.element_size() or v_lo >= k_hi or k_lo >= v_hi:
        return 0
    return v.numel() * v.element_size()


def _element_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) element offsets a strided tensor touches in its storage."""
    if t.numel() == 0:
        return t.storage_offset(), t.storage_offset()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 0)
    return t.storage_offset(), t.storage_offset() + last + 1


def op_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> float:
    """FLOPs of one call by `flop_formula`; 0 where there is none (memory-bound op)."""
    formula = flop_formula(func)
    if formula is None:
        return 0.0
    return float(formula(*args, **kwargs, out_val=out))
