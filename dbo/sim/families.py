"""Which family each aten op belongs to: the kernel-table family that prices it
(`op_family`), the host-cost kind of issuing it (`host_family`), and the GEMM kernels
(`GEMM_OPS`) the device and the reports share.
"""

from __future__ import annotations

__all__ = ["FAMILY_OPS", "GEMM_OPS", "host_family", "op_family"]

# Matrix-multiply kernels (what a GEMM library runs), by op record name: the one list the
# device (SM caps for a ubatch's GEMMs) and the reports (GEMM time) share.
GEMM_OPS = frozenset(
    f"aten::{n}"
    for n in ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_grouped_mm", "_scaled_grouped_mm")
)

# Op name -> the kernel-table family that prices it (see dbo.sim.tables).
_FAMILY: dict[str, str] = {"aten::mm": "mm", "aten::addmm": "mm", "aten::_grouped_mm": "grouped_mm"}
for _n in (
    "_scaled_dot_product_flash_attention _scaled_dot_product_cudnn_attention "
    "_scaled_dot_product_efficient_attention scaled_dot_product_attention"
).split():
    _FAMILY[f"aten::{_n}"] = "attention"
for _n in ("copy_", "_to_copy", "clone", "contiguous", "_copy_from", "cat", "stack"):
    _FAMILY[f"aten::{_n}"] = "copy"
for _n in ("index_select", "gather", "index", "embedding", "searchsorted", "take"):
    _FAMILY[f"aten::{_n}"] = "index_select"
for _n in (
    "index_add_ index_add scatter_add_ scatter_add scatter_ scatter index_put_ index_put "
    "index_copy_ index_copy scatter_reduce_"
).split():
    _FAMILY[f"aten::{_n}"] = "index_add"
for _n in ("native_layer_norm", "layer_norm", "_fused_rms_norm", "rms_norm", "native_group_norm"):
    _FAMILY[f"aten::{_n}"] = "norm"
for _n in ("sort", "argsort", "topk", "_softmax", "softmax", "_log_softmax", "cumsum"):
    _FAMILY[f"aten::{_n}"] = "sort_topk" if _n in ("sort", "argsort", "topk") else "elementwise"
for _n in (
    "add add_ sub sub_ mul mul_ div div_ silu silu_ gelu relu relu_ sigmoid tanh exp neg rsqrt "
    "sqrt pow fill_ zero_ zeros_like ones_like full_like zeros ones full where masked_fill "
    "masked_fill_ floor_divide remainder clamp clamp_ arange minimum maximum eq ne lt gt le ge "
    "abs sum mean amax max min bitwise_and logical_not lerp addcmul"
).split():
    _FAMILY.setdefault(f"aten::{_n}", "elementwise")


def op_family(name: str) -> str | None:
    """The kernel-table family of an op record name ("aten::mm" -> "mm"), or None."""
    return _FAMILY.get(name)


def host_family(name: str) -> str:
    """The host-cost kind of an op: gemm, attention, sort_topk, index or elementwise (any
    other kernel: elementwise, the cheapest to issue)."""
    if name in GEMM_OPS:
        return "gemm"
    family = _FAMILY.get(name)
    if family in ("attention", "sort_topk"):
        return family
    if family in ("index_select", "index_add"):
        return "index"
    return "elementwise"


# The ops a kernel table prices.
FAMILY_OPS = frozenset(_FAMILY)
