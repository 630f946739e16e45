"""Kernel classes: what a GPU kernel (or a simulated op) does, from its name.

One job: one vocabulary of classes for real kernels and simulated ops, so a real trace and a
simulated step can be set side by side per class. The classes follow the simulator's kernel
families (`dbo.sim.cost.op_family`): gemm, grouped_gemm, attention, norm, elementwise, copy,
gather, scatter, sort_topk; plus comm (NCCL, DeepEP, all-to-all and the collectives),
memset and other.

Kernel names are matched by ordered patterns, first match wins, because names overlap:
a flash-attention kernel mentions "wgmma", a grouped GEMM is a cutlass `GemmUniversal` with a
`GroupProblemShape`, an index_add is `indexFuncLargeIndex<..., ReduceAdd>`. The patterns are
a documented registry (`KERNEL_PATTERNS`); `add_kernel_pattern` puts an engine's own kernel
names first.
"""

from __future__ import annotations

import re

__all__ = [
    "CLASSES",
    "COMM_CLASS",
    "KERNEL_PATTERNS",
    "add_kernel_pattern",
    "classify_kernel",
    "class_of_sim_op",
]

COMM_CLASS = "comm"
CLASSES = (
    "gemm",
    "grouped_gemm",
    "attention",
    "norm",
    "elementwise",
    "copy",
    "gather",
    "scatter",
    "sort_topk",
    COMM_CLASS,
    "memcpy",
    "memset",
    "other",
)

# (class, pattern) in match order; case-insensitive search in the kernel's name.
KERNEL_PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    (cls, re.compile(p, re.IGNORECASE))
    for cls, p in (
        (
            COMM_CLASS,
            r"nccl|deep_?ep|all_?to_?all|all_?gather|reduce_?scatter|all_?reduce|"
            r"cross_device_reduce|pplx|nvshmem|internode|intranode|"
            r"(^|::)(dispatch|combine)(<|\(|$)",
        ),
        ("memcpy", r"^memcpy"),
        ("memset", r"^memset"),
        ("grouped_gemm", r"groupproblemshape|grouped_?gemm|grouped_mm|fused_moe|moe_gemm"),
        ("attention", r"sdpa|flash|fmha|attention|attn|paged_?kv|mla_?decode"),
        ("gemm", r"nvjet|gemm|cublas|splitkreduce|xmma|matmul|cutlass"),
        ("norm", r"rms_?norm|layer_?norm|group_?norm"),
        ("sort_topk", r"topk|sort|searchsorted"),
        ("scatter", r"reduceadd|index_?add|scatter"),
        ("gather", r"gather|index|embedding"),
        ("copy", r"direct_copy|copy_kernel|cat_array"),
        ("elementwise", r"elementwise|functor|fill|softmax|reduce_kernel|arange|silu|gelu"),
    )
]

# The simulator's kernel families (dbo.sim.cost.op_family) in this module's classes.
_SIM_FAMILIES = {
    "mm": "gemm",
    "grouped_mm": "grouped_gemm",
    "attention": "attention",
    "copy": "copy",
    "index_select": "gather",
    "index_add": "scatter",
    "norm": "norm",
    "sort_topk": "sort_topk",
    "elementwise": "elementwise",
}


def add_kernel_pattern(cls: str, pattern: str) -> None:
    """Match kernels whose name contains `pattern` (a regex) as `cls`, before every built-in
    pattern. Raises ValueError for a class outside `CLASSES` or a pattern that is no regex."""
    if cls not in CLASSES:
        raise ValueError(f"unknown kernel class {cls!r}; choose one of {', '.join(CLASSES)}")
    try:
        compiled = re.compile(pattern, re.IGNORECASE)
    except re.error as error:
        raise ValueError(
            f"kernel pattern {pattern!r} is not a regular expression: {error}"
        ) from None
    KERNEL_PATTERNS.insert(0, (cls, compiled))


def classify_kernel(name: str) -> str:
    """The class of a kernel, memcpy or memset as a profiler names it."""
    for cls, pattern in KERNEL_PATTERNS:
        if pattern.search(name):
            return cls
    return "other"


def class_of_sim_op(name: str, kind: str) -> str:
    """The class of a simulated op record (`OpRecord.name`, `.kind`)."""
    from dbo.sim.families import op_family  # the simulator's families; imported only when used

    if kind == "comm":
        return COMM_CLASS
    family = op_family(name)
    if family is not None:
        return _SIM_FAMILIES.get(family, "other")
    return classify_kernel(name.split("::")[-1])
